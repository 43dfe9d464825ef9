"""``--lr-scheduler inv_sqrt_decay``: InvSqrtDecay, equation 7 of "Transformers without
Tears" (Nguyen & Salazar 2019, section 3.3)."""
import logging
from dataclasses import dataclass

from fairseq.optim.lr_scheduler import register_lr_scheduler

from fairseq_normplug.optim.lr_scheduler.common import (
    PaperLRSchedule,
    PaperScheduleConfig,
    fmt_lr,
    inv_sqrt_decay_lr,
    inv_sqrt_decay_peak,
)

logger = logging.getLogger(__name__)


@dataclass
class InvSqrtDecayConfig(PaperScheduleConfig):
    """Flags of ``inv_sqrt_decay``: ``--warmup-updates``, ``--lr-lambda``, ``--lr-d-model``,
    ``--stop-lr``, ``--stop-patience``. ``--lr`` is not used."""


@register_lr_scheduler("inv_sqrt_decay", dataclass=InvSqrtDecayConfig)
class InvSqrtDecay(PaperLRSchedule):
    """InvSqrtDecay, equation 7 of Nguyen & Salazar (2019)::

        lr(n) = lambda * d^-0.5 * min(n^-0.5, n * n_warmup^-1.5)

    for the n-th update (n counted from 1): linear warmup to the peak
    ``lambda * (d * n_warmup)^-0.5`` at update ``n_warmup``, then decay with ``n^-0.5``.
    Unlike fairseq's ``inverse_sqrt`` it is parameterised by lambda (``--lr-lambda``), not by
    the peak lr, and ``--warmup-updates 0`` is allowed (``lr(n) = lambda * (d n)^-0.5``).
    d is the model's ``encoder_embed_dim`` unless ``--lr-d-model`` is given. Validations do
    not change the lr; each one logs the current lr. Training stops once the lr, after
    warmup, is below ``--stop-lr``.
    """

    name = "inv_sqrt_decay"

    def __init__(self, cfg: InvSqrtDecayConfig, optimizer):
        super().__init__(cfg, optimizer)
        self.d = self.resolve_d(cfg)
        head = f"inv_sqrt_decay: lr(n) = {self.lr_lambda:g} * {self.d}^-0.5 * "
        if self.warmup_updates > 0:
            peak = inv_sqrt_decay_peak(self.lr_lambda, self.d, self.warmup_updates)
            head += (f"min(n^-0.5, n * {self.warmup_updates}^-1.5) (d from {self.d_source}); "
                     f"peak lr {fmt_lr(peak)} at update {self.warmup_updates}")
        else:
            head += (f"n^-0.5 (no warmup; d from {self.d_source}); lr {fmt_lr(self.lr_at(1))} "
                     "at update 1")
        logger.info(head + "; " + self.stop_rules())

    def lr_at(self, n: int) -> float:
        return inv_sqrt_decay_lr(n, self.lr_lambda, self.d, self.warmup_updates)
