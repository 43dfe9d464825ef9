"""Optimisation helpers registered with fairseq (learning-rate schedulers).

Importing this package registers ``--lr-scheduler inv_sqrt_decay`` and ``val_decay``
(the schedules of "Transformers without Tears", section 3.3; see docs/lr_schedulers.md) and
installs :mod:`fairseq_normplug.optim.validation_hook`, which lets them see every validation
and stop training promptly at the lr floor.
"""
from fairseq_normplug.optim import lr_scheduler  # noqa: F401  (registers the schedulers)
from fairseq_normplug.optim import validation_hook

validation_hook.install()
