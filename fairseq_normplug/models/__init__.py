"""Registered architectures."""
