"""Shared parts of the "Transformers without Tears" learning-rate schedules (section 3.3).

The paper's equation 7 (InvSqrtDecay)::

    lr(n) = lambda * d^-0.5 * min(n^-0.5, n * n_warmup^-1.5)

``n`` is the number of the update about to be made, counted from 1 (as in the authors'
code): the first update uses ``lr(1)``, update ``n_warmup`` uses the peak
``lambda * d^-0.5 * n_warmup^-0.5``. fairseq calls ``step_update(num_updates)`` after
``num_updates`` updates are done, so our schedulers set ``lr(num_updates + 1)`` there:
the ``lr`` fairseq logs at ``num_updates = N`` is the one update ``N + 1`` will use.

Training stops once the lr falls below ``--stop-lr`` (paper: 5e-5), checked after every
update (not only at epoch ends: :func:`fairseq_normplug.fairseq_patches.feed_validations_to`)
and never during warmup, where the lr starts near zero. With ``--stop-patience N`` it also stops
once N validations after warmup in a row have not improved on the best one before them
(:func:`patience_exhausted`); the validation history is kept in the scheduler's state, so a
resumed run stops at the same update as the uninterrupted one.
"""
import argparse
import logging
import math
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.optim.lr_scheduler import FairseqLRScheduler
from omegaconf import II, DictConfig, OmegaConf

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.numeric_flags import NumberRange, check_number
from fairseq_normplug.fairseq_patches import feed_validations_to

logger = logging.getLogger(__name__)

PAPER_STOP_LR = 5e-5
PAPER_WARMUP = 8000


def inv_sqrt_decay_lr(n: float, lr_lambda: float, d: float, warmup_updates: int) -> float:
    """Equation 7 of Nguyen & Salazar (2019) for update number ``n`` (>= 1).

    ``warmup_updates == 0`` means no warmup: ``min(n^-0.5, n * 0^-1.5) = n^-0.5``."""
    n = max(float(n), 1.0)
    if warmup_updates > 0:
        factor = min(n ** -0.5, n * warmup_updates ** -1.5)
    else:
        factor = n ** -0.5
    return lr_lambda * d ** -0.5 * factor


def inv_sqrt_decay_peak(lr_lambda: float, d: float, warmup_updates: int) -> float:
    """The highest lr of equation 7, reached at update ``warmup_updates``."""
    return inv_sqrt_decay_lr(warmup_updates, lr_lambda, d, warmup_updates)


@dataclass
class PaperScheduleConfig(FairseqDataclass):
    """Flags shared by ``inv_sqrt_decay`` and ``val_decay``."""

    warmup_updates: int = field(
        default=PAPER_WARMUP,
        metadata={"help": "n_warmup of eq. 7: updates of linear warmup (paper: 8000); "
                          "0 = no warmup"},
    )
    lr_lambda: float = field(
        default=1.0,
        metadata={"help": "lambda of eq. 7, scales the whole schedule (paper: 1; 2xLR: 2); "
                          "must be > 0"},
    )
    lr_d_model: Optional[int] = field(
        default=None,
        metadata={"help": "d of eq. 7; default: the model's encoder_embed_dim "
                          "(else decoder_embed_dim)"},
    )
    stop_lr: float = field(
        default=PAPER_STOP_LR,
        metadata={"help": "stop training as soon as the lr is below this value, checked "
                          "after every update once warmup is over (paper: 5e-5); 0 disables"},
    )
    stop_patience: int = field(
        default=0,
        metadata={"help": "also stop once this many validations after warmup in a row have not "
                          "improved (strictly) on the best --best-checkpoint-metric before them "
                          "(e.g. dev BLEU); 0 disables (default). Unlike fairseq's --patience, "
                          "its count survives a resume"},
    )
    lr: List[float] = II("optimization.lr")
    best_checkpoint_metric: str = II("checkpoint.best_checkpoint_metric")
    maximize_best_checkpoint_metric: bool = II("checkpoint.maximize_best_checkpoint_metric")


def cfg_get(cfg, key: str, default=None):
    """``cfg.key`` for a DictConfig, dataclass or Namespace; ``default`` when it is missing
    or is an interpolation that does not resolve (e.g. a scheduler built outside fairseq)."""
    if isinstance(cfg, DictConfig):
        try:
            value = OmegaConf.select(cfg, key, default=default,
                                     throw_on_resolution_failure=False)
        except Exception:  # pragma: no cover - defensive
            return default
        return default if value is None else value
    value = getattr(cfg, key, default)
    if isinstance(value, str) and value.startswith("${"):
        return default
    return default if value is None else value


def _root(cfg):
    if isinstance(cfg, DictConfig):
        try:
            return cfg._get_root()
        except Exception:  # pragma: no cover - defensive
            return None
    return None


def model_dim(cfg) -> Optional[int]:
    """d of eq. 7 from the full fairseq config the scheduler's config belongs to: the
    model's ``encoder_embed_dim`` (``decoder_embed_dim`` if absent; hydra-style nested
    ``encoder.embed_dim`` too). fairseq applies the ``--arch`` defaults to the model args
    before the config is built, so e.g. ``--arch transformer`` gives 512. None if unknown."""
    root = _root(cfg)
    if root is None:
        return None
    try:
        model = root.get("model") if isinstance(root, DictConfig) else None
    except Exception:  # pragma: no cover - defensive
        model = None
    if model is None:
        return None

    def get(obj, name):
        if isinstance(obj, DictConfig):
            try:
                return OmegaConf.select(obj, name, throw_on_resolution_failure=False)
            except Exception:  # pragma: no cover - defensive
                return None
        node = obj
        for part in name.split("."):
            node = getattr(node, part, None)
            if node is None:
                return None
        return node

    for name in ("encoder_embed_dim", "encoder.embed_dim", "decoder_embed_dim",
                 "decoder.embed_dim"):
        value = get(model, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def patience_exhausted(history: List[List[float]], patience: int, warmup_updates: int,
                       maximize: bool) -> Optional[str]:
    """Why training should stop under ``--stop-patience``, or None.

    ``history`` holds ``[update, metric]`` per validation. The rule: the last ``patience``
    validations were all made after warmup (update >= ``warmup_updates``) and none of them
    is strictly better than the best validation before them (ties are no gain)."""
    if patience <= 0 or len(history) <= patience:
        return None
    recent = history[-patience:]
    if recent[0][0] < warmup_updates:
        return None
    better = (lambda a, b: a > b) if maximize else (lambda a, b: a < b)
    best_update, best = history[0]
    for update, metric in history[1:-patience]:
        if better(metric, best):
            best_update, best = update, metric
    if any(better(metric, best) for _, metric in recent):
        return None
    return (f"no gain for {patience} validations (best {best:.6g} at update {int(best_update)}, "
            f"--stop-patience {patience})")


def fmt_lr(lr: float) -> str:
    return f"{lr:.6g}"


# dest -> (argparse type, valid values, message); one table for argument time and __init__
FLAG_CHECKS = {
    "lr_lambda": (float, NumberRange(low=0, low_open=True),
                  "--lr-lambda must be a finite number > 0 (got {v:g}); paper: 1, 2xLR: 2"),
    "warmup_updates": (int, NumberRange(low=0),
                       "--warmup-updates must be >= 0 (got {v}); 0 means no warmup"),
    "lr_d_model": (int, NumberRange(low=1),
                   "--lr-d-model must be a positive integer (got {v})"),
    "stop_lr": (float, NumberRange(low=0), "--stop-lr must be >= 0 (got {v:g}); 0 disables it"),
    "lr_decay": (float, NumberRange(low=0, high=1, low_open=True, high_open=True),
                 "--lr-decay must be in the open interval (0, 1) (got {v:g}); paper: 0.8"),
    "lr_patience": (int, NumberRange(low=0), "--lr-patience must be >= 0 (got {v}); paper: 3"),
    "stop_patience": (int, NumberRange(low=0), "--stop-patience must be >= 0 (got {v}); 0 disables it"),
}


def check_flag(dest: str, value) -> None:
    """Raise NormplugError when ``value`` is not valid for the flag ``dest``: not finite (the
    plugin's one numeric-flag check, :mod:`fairseq_normplug.numeric_flags`) or out of range."""
    _, valid, message = FLAG_CHECKS[dest]
    if value is None:
        return
    if not math.isfinite(value):
        check_number("--" + dest.replace("_", "-"), value, valid)
    if not valid.contains(value):
        raise NormplugError(message.format(v=value))


class _CheckedStore(argparse.Action):
    """Store a flag value after :func:`check_flag`: bad values fail at argument time, with
    the one-line NormplugError (argparse lets exceptions other than its own through)."""

    def __call__(self, parser, namespace, values, option_string=None):
        check_flag(self.dest, values)
        setattr(namespace, self.dest, values)


class PaperLRSchedule(FairseqLRScheduler):
    """Base of the paper's schedules: flag checks, the "lr of the next update" convention,
    the lr-floor stop and the per-validation log line. Subclasses define :meth:`lr_at`."""

    name = "paper_schedule"

    @classmethod
    def add_args(cls, parser):
        """The dataclass flags, those with a valid range checked as they are parsed."""
        dc = getattr(cls, "__dataclass")()
        for dest, spec in dc.__dataclass_fields__.items():
            if dest not in FLAG_CHECKS:
                continue
            try:
                parser.add_argument("--" + dest.replace("_", "-"), dest=dest,
                                    type=FLAG_CHECKS[dest][0], default=spec.default,
                                    help=spec.metadata.get("help"), action=_CheckedStore)
            except argparse.ArgumentError:  # already defined elsewhere: checked in __init__
                pass
        gen_parser_from_dataclass(parser, dc)  # the rest (adds nothing twice)

    def __init__(self, cfg, optimizer):
        super().__init__(cfg, optimizer)
        self.warmup_updates = int(cfg_get(cfg, "warmup_updates", PAPER_WARMUP))
        self.lr_lambda = float(cfg_get(cfg, "lr_lambda", 1.0))
        self.stop_lr = float(cfg_get(cfg, "stop_lr", PAPER_STOP_LR))
        self.stop_patience = int(cfg_get(cfg, "stop_patience", 0))
        self.maximize = bool(cfg_get(cfg, "maximize_best_checkpoint_metric", False))
        self.metric_name = str(cfg_get(cfg, "best_checkpoint_metric", "loss"))
        self.check_common_flags(cfg)
        self.num_updates = 0
        self.last_validation_update = -1
        self.history: List[List[float]] = []  # [update, metric] per validation
        self._stop_logged = False
        self._warmup_end_logged = False
        feed_validations_to(self)  # every validation, mid-epoch too: on_validate_and_save

    # ----- flags -------------------------------------------------------------------------
    def check_common_flags(self, cfg):
        """Again in __init__ (configs not made by fairseq's argument parser, e.g. hydra)."""
        check_flag("lr_lambda", self.lr_lambda)
        check_flag("warmup_updates", self.warmup_updates)
        check_flag("stop_lr", self.stop_lr)
        check_flag("stop_patience", self.stop_patience)
        d = cfg_get(cfg, "lr_d_model", None)
        check_flag("lr_d_model", None if d is None else int(d))

    def resolve_d(self, cfg) -> int:
        """d from ``--lr-d-model`` or the model config; a NormplugError if neither has it."""
        d = cfg_get(cfg, "lr_d_model", None)
        if d is not None:
            self.d_source = "--lr-d-model"
            return int(d)
        d = model_dim(cfg)
        if d is None:
            raise NormplugError(
                f"{self.name}: cannot find the model dimension d (no encoder_embed_dim or "
                "decoder_embed_dim in the model config); pass --lr-d-model D")
        self.d_source = "model embed dim"
        return d

    def single_lr(self, cfg) -> float:
        lrs = cfg_get(cfg, "lr", None)
        if lrs is None:
            raise NormplugError(f"{self.name}: --lr is required")
        if not isinstance(lrs, (int, float)):
            lrs = list(lrs)
            if len(lrs) != 1:
                raise NormplugError(
                    f"{self.name}: --lr must be a single value (got {','.join(map(str, lrs))})")
            lrs = lrs[0]
        lr = float(lrs)
        if not lr > 0:
            raise NormplugError(f"{self.name}: --lr must be > 0 (got {lr:g})")
        return lr

    def stop_rules(self) -> str:
        """The stopping rules in force, for the start-up log line."""
        rules = [f"lr < {fmt_lr(self.stop_lr)}"] if self.stop_lr > 0 else []
        if self.stop_patience > 0:
            rules.append(f"no gain in valid {self.metric_name} for {self.stop_patience} validations")
        return "stop once " + " or ".join(rules) if rules else "no lr floor"

    # ----- schedule ----------------------------------------------------------------------
    def lr_at(self, n: int) -> float:  # pragma: no cover - abstract
        """lr of update number ``n`` (counted from 1)."""
        raise NotImplementedError

    def in_warmup(self) -> bool:
        """True while fewer than ``warmup_updates`` updates are done."""
        return self.num_updates < self.warmup_updates

    def current_lr(self) -> float:
        """The lr the next update (number ``num_updates + 1``) uses."""
        return self.lr_at(self.num_updates + 1)

    def step_update(self, num_updates):
        """Set the lr of update ``num_updates + 1``."""
        self.num_updates = int(num_updates)
        lr = self.current_lr()
        self.optimizer.set_lr(lr)
        if (self.warmup_updates > 0 and self.num_updates >= self.warmup_updates
                and not self._warmup_end_logged):
            self._warmup_end_logged = True
            logger.info(f"{self.name}: warmup over after {self.warmup_updates} updates, "
                        f"lr {fmt_lr(lr)}")
        return lr

    def step(self, epoch, val_loss=None):
        """End of an epoch: fairseq passes the epoch's last validation metric (or None).
        It was normally seen already through ``on_validate_and_save`` at the same update,
        in which case it is not counted again."""
        super().step(epoch, val_loss)
        if val_loss is not None:
            self.observe_validation(val_loss)

    # ----- validations and stopping ------------------------------------------------------
    def is_new_validation(self, num_updates: int) -> bool:
        if num_updates <= self.last_validation_update:
            logger.debug(f"{self.name}: validation at update {num_updates} already counted")
            return False
        self.last_validation_update = num_updates
        return True

    def observe_validation(self, metric, num_updates=None):
        """One validation result: recorded in the history, and the current lr logged."""
        n = self.num_updates if num_updates is None else int(num_updates)
        if not self.is_new_validation(n):
            return None
        self.history.append([n, float(metric)])
        logger.info(f"{self.name}: update {n}: valid {self.metric_name} {float(metric):.6g}, "
                    f"lr {fmt_lr(self.current_lr())}")
        return None

    def stop_reason(self) -> Optional[str]:
        """Why training is over after the current update, or None: warmup is over and the
        next update's lr is below ``--stop-lr``, or ``--stop-patience`` is exhausted."""
        if self.in_warmup():
            return None
        lr = self.current_lr()
        if self.stop_lr > 0 and lr < self.stop_lr:
            return f"lr {fmt_lr(lr)} < --stop-lr {fmt_lr(self.stop_lr)}"
        return patience_exhausted(self.history, self.stop_patience, self.warmup_updates, self.maximize)

    def should_stop(self) -> bool:
        reason = self.stop_reason()
        if reason and not self._stop_logged:
            self._stop_logged = True
            logger.info(f"{self.name}: stopping training after update {self.num_updates}: {reason}")
        return reason is not None

    def on_validate_and_save(self, valid_metric) -> bool:
        """Called by fairseq-train after every update (through
        :func:`~fairseq_normplug.fairseq_patches.feed_validations_to`; ``valid_metric`` is None when
        that update was not followed by a validation). Returns True to stop training."""
        if valid_metric is not None:
            self.observe_validation(valid_metric)
        return self.should_stop()

    # ----- state -------------------------------------------------------------------------
    def state_dict(self):
        return {"best": self._plain(self.best), "num_updates": int(self.num_updates),
                "last_validation_update": int(self.last_validation_update),
                "history": [[int(u), float(m)] for u, m in self.history],
                "maximize": bool(self.maximize)}  # with the config's --stop-patience: checkpoint_safety.finished

    def load_state_dict(self, state_dict):
        self.best = state_dict.get("best")
        self.num_updates = int(state_dict.get("num_updates", self.num_updates))
        self.last_validation_update = int(state_dict.get("last_validation_update", -1))
        self.history = [[int(u), float(m)] for u, m in state_dict.get("history", [])]
        self._warmup_end_logged = self.num_updates >= self.warmup_updates

    @staticmethod
    def _plain(value):
        return None if value is None else float(value)

