"""Experiment tooling: BLEU scoring and significance (``bleu``), result tables laid out like
the paper's (``tables``), parsing of fairseq JSON training logs (``training_log``) and the
papers' figures drawn from those logs (``figures``). See docs/evaluation.md."""
