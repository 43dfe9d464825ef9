"""``--lr-scheduler val_decay``: ValDecay and NoWarmup of "Transformers without Tears"
(Nguyen & Salazar 2019, section 3.3)."""
import logging
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.optim.lr_scheduler import register_lr_scheduler
from omegaconf import II

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.optim.lr_scheduler.common import (
    PaperLRSchedule,
    PaperScheduleConfig,
    cfg_get,
    check_flag,
    fmt_lr,
    inv_sqrt_decay_lr,
    inv_sqrt_decay_peak,
)

logger = logging.getLogger(__name__)

WARMUP_PEAK_CHOICES = ChoiceEnum(["inv_sqrt", "lr"])


@dataclass
class ValDecayConfig(PaperScheduleConfig):
    """Flags of ``val_decay``: those of ``inv_sqrt_decay`` plus ``--warmup-peak``,
    ``--lr-decay``, ``--lr-patience``; ``--lr`` is the constant lr of NoWarmup."""

    warmup_peak: WARMUP_PEAK_CHOICES = field(
        default="inv_sqrt",
        metadata={"help": "what warmup climbs to: 'inv_sqrt' = the peak of eq. 7, "
                          "lambda * (d * n_warmup)^-0.5; 'lr' = --lr. Unused with "
                          "--warmup-updates 0 (NoWarmup), which always starts at --lr"},
    )
    lr_decay: float = field(
        default=0.8,
        metadata={"help": "alpha_decay: factor the lr is multiplied by on a decay, in (0, 1) "
                          "(paper: 0.8)"},
    )
    lr_patience: int = field(
        default=3,
        metadata={"help": "decay when a validation is worse than each of the previous "
                          "N validations (paper: 3); 0 = decay after every validation "
                          "once warmup is over"},
    )
    disable_validation: bool = II("dataset.disable_validation")


@register_lr_scheduler("val_decay", dataclass=ValDecayConfig)
class ValDecay(PaperLRSchedule):
    """ValDecay / NoWarmup of Nguyen & Salazar (2019), section 3.3.

    Warmup (``--warmup-updates`` > 0): the linear part of equation 7,
    ``lr(n) = lambda * d^-0.5 * n * n_warmup^-1.5`` for update n <= n_warmup, up to the
    InvSqrtDecay peak ``lambda * (d * n_warmup)^-0.5`` (with ``--warmup-peak lr``:
    ``lr(n) = --lr * n / n_warmup``); then the lr stays flat.

    NoWarmup (``--warmup-updates 0``): the constant ``--lr`` (paper: 3e-4) from update 1.

    After each validation (every one fairseq makes: at epoch ends and every
    ``--validate-interval-updates``; a validation reported twice at the same update counts
    once) its metric (fairseq's ``--best-checkpoint-metric``: loss by default, BLEU with
    ``--eval-bleu --best-checkpoint-metric bleu --maximize-best-checkpoint-metric``) is
    appended to the history; when warmup is over and it is strictly worse than each of the
    previous ``--lr-patience`` validations (ties are not worse)::

        lr <- lr * alpha_decay          (--lr-decay, paper 0.8)

    Validations during warmup enter the history but never decay the lr. Training stops
    once the lr is below ``--stop-lr`` (paper 5e-5), or when ``--stop-patience`` is exhausted. lr, history and decays are kept in
    :meth:`state_dict` as plain Python values, so a resumed run decides exactly as the
    uninterrupted one would.
    """

    name = "val_decay"

    def __init__(self, cfg: ValDecayConfig, optimizer):
        super().__init__(cfg, optimizer)
        self.lr_decay = float(cfg_get(cfg, "lr_decay", 0.8))
        self.patience = int(cfg_get(cfg, "lr_patience", 3))
        check_flag("lr_decay", self.lr_decay)
        check_flag("lr_patience", self.patience)
        if bool(cfg_get(cfg, "disable_validation", False)):
            raise NormplugError(
                "--lr-scheduler val_decay decays the lr on validation results, but validation "
                "is disabled (--disable-validation); remove that flag or use inv_sqrt_decay")
        self.warmup_peak = str(cfg_get(cfg, "warmup_peak", "inv_sqrt"))
        if self.warmup_peak not in ("inv_sqrt", "lr"):
            raise NormplugError(
                f"--warmup-peak must be one of inv_sqrt, lr (got {self.warmup_peak})")

        self.d: Optional[int] = None
        if self.warmup_updates == 0:
            self.mode = "NoWarmup"
            self.peak = self.single_lr(cfg)
            how = f"NoWarmup: constant lr {fmt_lr(self.peak)} (--lr) from update 1"
            if self.peak >= 1e-2:
                logger.warning(f"val_decay: NoWarmup starts at --lr {fmt_lr(self.peak)}; "
                               "the paper uses --lr 3e-4")
        elif self.warmup_peak == "lr":
            self.mode = "ValDecay"
            self.peak = self.single_lr(cfg)
            how = (f"ValDecay: linear warmup to --lr {fmt_lr(self.peak)} at update "
                   f"{self.warmup_updates}, then flat")
        else:
            self.mode = "ValDecay"
            self.d = self.resolve_d(cfg)
            self.peak = inv_sqrt_decay_peak(self.lr_lambda, self.d, self.warmup_updates)
            how = (f"ValDecay: linear warmup (eq. 7, lambda {self.lr_lambda:g}, d {self.d} "
                   f"from {self.d_source}) to {fmt_lr(self.peak)} at update "
                   f"{self.warmup_updates}, then flat")
        self.flat_lr = self.peak
        self.decays: List[List[float]] = []  # [update, lr before, lr after] per decay
        direction = "higher" if self.maximize else "lower"
        logger.info(
            f"val_decay: {how}; after each validation, lr *= {self.lr_decay:g} when valid "
            f"{self.metric_name} ({direction} is better) is worse than each of the previous "
            f"{self.patience}; "
            + self.stop_rules())

    # ----- schedule ----------------------------------------------------------------------
    def lr_at(self, n: int) -> float:
        if self.warmup_updates > 0 and n <= self.warmup_updates:
            if self.d is not None:
                return inv_sqrt_decay_lr(n, self.lr_lambda, self.d, self.warmup_updates)
            return self.peak * max(n, 1) / self.warmup_updates
        return self.flat_lr

    def is_worse(self, a: float, b: float) -> bool:
        """Strictly worse in the direction of ``--maximize-best-checkpoint-metric``."""
        return a < b if self.maximize else a > b

    def observe_validation(self, metric, num_updates=None):
        """Record one validation result and decide. Returns the decay ``[update, old, new]``
        when the lr was decayed, else None (also for a repeat at an already counted update)."""
        n = self.num_updates if num_updates is None else int(num_updates)
        if not self.is_new_validation(n):
            return None
        metric = float(metric)
        previous = [m for _, m in self.history[-self.patience:]] if self.patience > 0 else []
        self.history.append([n, metric])
        head = f"val_decay: update {n}: valid {self.metric_name} {metric:.6g}"
        if n < self.warmup_updates:
            logger.info(f"{head}, lr {fmt_lr(self.current_lr())} (warmup: no decay decision)")
            return None
        if len(previous) < self.patience:
            logger.info(f"{head}, lr {fmt_lr(self.flat_lr)} (no decay: only {len(previous)} "
                        f"previous validations, patience {self.patience})")
            return None
        if all(self.is_worse(metric, p) for p in previous):
            old = self.flat_lr
            self.flat_lr = old * self.lr_decay
            decay = [n, old, self.flat_lr]
            self.decays.append(decay)
            self.optimizer.set_lr(self.current_lr())
            shown = ", ".join(f"{p:.6g}" for p in previous) or "none"
            logger.info(f"{head} is worse than each of the previous {self.patience} "
                        f"({shown}): decay #{len(self.decays)}, lr {fmt_lr(old)} -> "
                        f"{fmt_lr(self.flat_lr)}")
            return decay
        logger.info(f"{head}, lr {fmt_lr(self.flat_lr)} (no decay)")
        return None

    # ----- state -------------------------------------------------------------------------
    def state_dict(self):
        state = super().state_dict()
        state.update({
            "flat_lr": float(self.flat_lr),
            "peak": float(self.peak),
            "decays": [[int(u), float(a), float(b)] for u, a, b in self.decays],
        })
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "flat_lr" not in state_dict:
            return
        self.flat_lr = float(state_dict["flat_lr"])
        self.decays = [[int(u), float(a), float(b)] for u, a, b in state_dict.get("decays", [])]
        recent = ", ".join(f"{m:.6g}" for _, m in self.history[-max(self.patience, 1):])
        logger.info(
            f"val_decay: restored at update {self.num_updates}: lr {fmt_lr(self.current_lr())}, "
            f"{len(self.history)} validations (last: {recent or 'none'}), "
            f"{len(self.decays)} decays")
