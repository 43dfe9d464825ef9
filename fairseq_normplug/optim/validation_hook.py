"""The one hook into fairseq internals: every validation result reaches our LR schedulers,
and they can stop training as soon as the lr falls below ``--stop-lr``.

Why. fairseq-train (``fairseq_cli/train.py``) gives the LR scheduler a validation result
only at the end of an epoch (``trainer.lr_step(epoch, valid_losses[0])``); the validations
made every ``--validate-interval-updates`` updates never reach it, and training can only be
stopped for a low lr at epoch boundaries (``--stop-min-lr``). The paper validates every 1000
updates and stops once lr < 5e-5, so both are needed mid-epoch.

What it patches. Exactly one module attribute: ``fairseq_cli.train.should_stop_early``
(and the same function of ``__main__`` when fairseq's train.py runs as a script). fairseq
calls it from ``validate_and_save`` after **every** update with ``valid_losses[0]``: the
``--best-checkpoint-metric`` value of the first validation subset when that update was
followed by a validation (mid-epoch or end of epoch), else None; its boolean result is
OR-ed into ``should_stop``, after which fairseq saves a checkpoint (with the scheduler state)
and leaves the training loop. That is where fairseq's validation results are already
available. The wrapper calls the original first (fairseq's ``--patience`` early stopping
is unchanged; the original keeps its ``best``/``num_runs`` counters on the module
attribute, i.e. on the wrapper, as before), then, if a normplug scheduler is active,
``scheduler.on_validate_and_save(valid_loss)``, which records the validation and returns
True once the lr is below the floor. With no normplug scheduler (or when ``cfg`` names
another ``--lr-scheduler``) it is a pass-through.

The end-of-epoch ``lr_step`` reports the same validation a second time; the schedulers
count a validation once per update number. Without the hook (fairseq used through another
entry point) the schedulers still work, fed by ``lr_step`` at epoch ends only.

Installed at plugin import (``fairseq_normplug.optim``) and again when one of our schedulers
is built (in case ``fairseq_cli.train`` was imported after the plugin). Idempotent: an
already wrapped function is left alone. :func:`uninstall` restores the original.
"""
import functools
import os
import sys
import weakref
from typing import List, Optional

from omegaconf import OmegaConf

_MARK = "_normplug_validation_hook"
_active = None  # weakref to the scheduler built last


def set_active_scheduler(scheduler) -> None:
    """Make ``scheduler`` the one the hook feeds (fairseq builds one per trainer; the
    last one built is the trainer's current one)."""
    global _active
    _active = weakref.ref(scheduler)


def active_scheduler():
    return _active() if _active is not None else None


def clear_active_scheduler() -> None:
    global _active
    _active = None


def _train_modules() -> List[object]:
    """The loaded copies of fairseq's ``fairseq_cli/train.py`` (as module and/or __main__)."""
    found = []
    module = sys.modules.get("fairseq_cli.train")
    if module is not None:
        found.append(module)
    main = sys.modules.get("__main__")
    main_file = os.path.normpath(getattr(main, "__file__", None) or "")
    if (main is not None and main is not module
            and main_file.endswith(os.path.join("fairseq_cli", "train.py"))
            and hasattr(main, "should_stop_early") and hasattr(main, "validate_and_save")):
        found.append(main)
    return found


def _runs_with(cfg, scheduler) -> bool:
    """False when the training config names another LR scheduler than ``scheduler``'s (a
    normplug scheduler left over from earlier in the same process)."""
    if not hasattr(scheduler, "on_validate_and_save"):
        return False
    try:
        name = OmegaConf.select(cfg, "lr_scheduler._name", default=None,
                                throw_on_resolution_failure=False)
    except Exception:
        name = None
    return name is None or name == getattr(scheduler, "name", name)


def _wrap(original):
    @functools.wraps(original)
    def should_stop_early(cfg, valid_loss):
        stop = original(cfg, valid_loss)
        scheduler = active_scheduler()
        if scheduler is not None and _runs_with(cfg, scheduler):
            stop = bool(scheduler.on_validate_and_save(valid_loss)) or stop
        return stop

    setattr(should_stop_early, _MARK, True)
    return should_stop_early


def is_installed(module=None) -> bool:
    modules = [module] if module is not None else _train_modules()
    return bool(modules) and all(
        getattr(getattr(m, "should_stop_early", None), _MARK, False) for m in modules)


def install(module: Optional[object] = None) -> bool:
    """Wrap ``should_stop_early`` of ``module`` (default: every loaded fairseq train
    module). Returns True when a wrapper is in place afterwards."""
    modules = [module] if module is not None else _train_modules()
    for m in modules:
        fn = getattr(m, "should_stop_early", None)
        if fn is None or getattr(fn, _MARK, False):
            continue
        m.should_stop_early = _wrap(fn)
    return bool(modules) and is_installed(module)


def uninstall(module: Optional[object] = None) -> None:
    """Put the original ``should_stop_early`` back (for tests)."""
    modules = [module] if module is not None else _train_modules()
    for m in modules:
        fn = getattr(m, "should_stop_early", None)
        if fn is not None and getattr(fn, _MARK, False):
            m.should_stop_early = fn.__wrapped__
