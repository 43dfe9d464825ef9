"""Optimisation helpers registered with fairseq (learning-rate schedulers).

Importing this package registers ``--lr-scheduler inv_sqrt_decay`` and ``val_decay``
(the schedules of "Transformers without Tears", section 3.3; see docs/lr_schedulers.md). They
see every validation and stop training promptly at the lr floor through
:func:`fairseq_normplug.fairseq_patches.feed_validations_to`.
"""
from fairseq_normplug.optim import lr_scheduler  # noqa: F401  (registers the schedulers)
