"""Exports of trained models to inference engines: ``fairseq-normplug-ct2`` writes a
CTranslate2 model, exactly or not at all (``ct2.py``; docs/deployment.md)."""
