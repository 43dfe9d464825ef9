"""Diagnostics of trained models: what each norm does on real data (``plot_norms``) and
conversion of a trained LayerNorm Transformer to DyT with calibrated parameters
(``convert``). See docs/diagnostics.md."""
