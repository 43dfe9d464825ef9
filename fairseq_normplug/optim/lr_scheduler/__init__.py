"""The learning-rate schedules of "Transformers without Tears" (section 3.3), one per file:
``inv_sqrt_decay`` (InvSqrtDecay) and ``val_decay`` (ValDecay; NoWarmup is ``val_decay``
with ``--warmup-updates 0``). Shared parts live in :mod:`.common`."""
from fairseq_normplug.optim.lr_scheduler import inv_sqrt_decay, val_decay  # noqa: F401
