"""Optimisation helpers registered with fairseq (learning-rate schedulers)."""
