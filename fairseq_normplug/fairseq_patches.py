"""The plugin's only changes to fairseq's code: three function wrappers, all applied here.

Each entry of :data:`PATCHES` names the fairseq function wrapped, the fairseq function whose
call makes the wrapper take effect, and a digest of the source of both in every fairseq
release the plugin installs (:mod:`fairseq_normplug.install_plan`: ``fairseq==0.12.2``, and
``fairseq-fixed==0.12.3.1`` on Python >= 3.11). ``tests/test_fairseq_patches.py`` fails
when the installed fairseq's source differs, so an upgrade cannot silently change what a
wrapper relies on. :func:`install` (at plugin import, idempotent) applies them; each is a
pass-through unless the plugin asked for its effect (the third: unless loading fails); :func:`uninstall` restores fairseq's
functions. No fairseq file or class is modified. Why each is a wrapper and not a fairseq hook:
docs/beyond.md (1, "How it works"), docs/lr_schedulers.md (2), docs/usage.md (3, checkpoints).

1. ``fairseq.optim._build_optimizer`` (the optimizer registry's builder): per-parameter
   param groups. A parameter given options with :func:`set_param_group` (e.g.
   ``weight_decay=WD`` for ``--norm-weight-decay``'s norm parameters) goes into a torch param
   group with those options; the untagged parameters form the first group, with the
   optimizer's own settings, as in stock fairseq. With no tagged parameter it passes the list
   through unchanged, and the optimizer class is the stock one (the same name in checkpoints).
   ``--optimizer composite`` imports the original by name and is not affected.

2. ``fairseq_cli.train.should_stop_early`` (also the one of ``__main__`` under ``python -m
   fairseq_cli.train``): every validation reaches the listener registered with
   :func:`feed_validations_to` (the plugin's lr schedulers), which may end training at that
   update. fairseq calls it from ``validate_and_save`` after **every** update with
   ``valid_losses[0]`` (the ``--best-checkpoint-metric`` value when that update was followed
   by a validation, mid-epoch or not, else None), before the checkpoint of that update is
   saved, and ORs its answer into ``should_stop``. The wrapper calls fairseq's function first
   (``--patience`` works as in stock fairseq; its ``best``/``num_runs`` counters live on the
   wrapper, the name fairseq's function looks itself up by), then the listener.

3. ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` (reached from
   ``load_model_ensemble_and_task``: fairseq-generate, fairseq-interactive, the hub's
   ``from_pretrained``; and from the trainer's resume): a checkpoint that torch's safe loader
   refuses, or cannot read, is one line naming the file and the refused class
   (:func:`fairseq_normplug.checkpoint_compat.load_error`, a ``NormplugError``: the plugin's
   ``sys.excepthook`` prints it as ``fairseq-normplug: error: ...``, exit status 2) instead of
   torch's 24-line traceback that ends advising to switch safe loading off. Only an error raised
   inside ``torch.load`` is replaced; everything else passes through unchanged. Safe loading
   itself is not touched.
"""
import functools
import hashlib
import importlib
import inspect
import os
import sys
import textwrap
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from fairseq_normplug.checkpoint_compat import torch_load_error

#: marks a function as one of our wrappers (so installing twice wraps once)
_MARK = "_normplug_patch"
#: the key of fairseq's per-parameter ``p.optim_overrides`` that holds the torch param-group
#: options given by :func:`set_param_group`
PARAM_GROUP_KEY = "normplug_param_group"


@dataclass(frozen=True)
class Patch:
    """A fairseq function the plugin wraps (``target``), the fairseq function whose call
    reaches the wrapper (``caller``), and per fairseq version the :func:`source_digest` of
    both, ``(target, caller)``, as read when the wrapper was written for that version."""
    target: str
    caller: str
    digests: Dict[str, Tuple[str, str]]


PARAM_GROUPS = Patch("fairseq.optim._build_optimizer", "fairseq.optim.build_optimizer", {
    "0.12.2": ("844c1491767e34a2", "0b40c7dd2c69f0f9"),
    "0.12.3.1": ("75590e0f8807c536", "0b40c7dd2c69f0f9"),
})
VALIDATIONS = Patch("fairseq_cli.train.should_stop_early", "fairseq_cli.train.validate_and_save", {
    "0.12.2": ("4c442a0bc32021f2", "969ff015ad3972ed"),
    "0.12.3.1": ("4c442a0bc32021f2", "6eaeda1b2df16938"),
})
CHECKPOINT_LOADING = Patch("fairseq.checkpoint_utils.load_checkpoint_to_cpu",
                           "fairseq.checkpoint_utils.load_model_ensemble_and_task", {
                               "0.12.2": ("4f169c4bf48459ab", "e6a4ab09ef84ecb5"),
                               "0.12.3.1": ("4f169c4bf48459ab", "a579b16b0abba804"),
                           })
PATCHES = (PARAM_GROUPS, VALIDATIONS, CHECKPOINT_LOADING)


def source_digest(function: Callable) -> str:
    """A digest of ``function``'s source (dedented, trailing blanks ignored): it changes when
    fairseq's code of that function does."""
    lines = [line.rstrip() for line in textwrap.dedent(inspect.getsource(inspect.unwrap(function))).splitlines()]
    return hashlib.sha256("\n".join(lines).strip("\n").encode()).hexdigest()[:16]


def resolve(dotted: str) -> Callable:
    """The function ``module.name`` of fairseq as fairseq defines it (our wrapper unwrapped)."""
    module, name = dotted.rsplit(".", 1)
    return inspect.unwrap(getattr(importlib.import_module(module), name))


# ---- 1. per-parameter param groups -------------------------------------------------------

def set_param_group(p, **options) -> None:
    """Put parameter ``p`` in an optimizer param group with the torch ``options`` (e.g.
    ``weight_decay=0.0``); parameters with equal options share one group. Stored in fairseq's
    per-parameter attribute ``p.optim_overrides``, which ``FP16Optimizer`` copies to its fp32
    master copies (under ``--bf16`` and ``--fp16 --fp16-no-flatten-grads``)."""
    overrides = getattr(p, "optim_overrides", None)
    p.optim_overrides = {**(overrides if isinstance(overrides, dict) else {}), PARAM_GROUP_KEY: dict(options)}


def param_group_options(p) -> Optional[dict]:
    """The options :func:`set_param_group` gave ``p``, or None."""
    overrides = getattr(p, "optim_overrides", None)
    return overrides.get(PARAM_GROUP_KEY) if isinstance(overrides, dict) else None


def param_groups(params) -> list:
    """The tensors fairseq hands an optimizer, as torch param groups: the untagged ones first
    (the optimizer's own settings), then one group per distinct :func:`set_param_group`
    options, in order of first appearance, each tensor in its given order. Unchanged (a list)
    when none is tagged, or when they are param-group dicts already."""
    params = list(params)
    if not all(isinstance(p, torch.Tensor) for p in params):
        return params
    groups: Dict[Tuple, list] = {(): []}  # sorted options -> tensors; () the untagged
    for p in params:
        options = param_group_options(p)
        groups.setdefault(tuple(sorted(options.items())) if options is not None else (), []).append(p)
    if len(groups) == 1:
        return params
    return [{"params": tensors, **dict(options)} for options, tensors in groups.items() if tensors]


def _build_optimizer_with_param_groups(original):
    @functools.wraps(original)
    def _build_optimizer(cfg, params, *extra_args, **extra_kwargs):
        return original(cfg, param_groups(params), *extra_args, **extra_kwargs)

    return _build_optimizer


# ---- 2. every validation to the plugin's lr scheduler ------------------------------------

_listener = None  # weakref to the object of the last feed_validations_to


def feed_validations_to(listener) -> None:
    """After every update of fairseq-train, call ``listener.on_validate_and_save(valid_loss)``
    (None when the update was not validated); a True answer ends training after that update
    (its checkpoint is saved). ``listener.name`` is its ``--lr-scheduler`` name: a config
    naming another scheduler is not fed. fairseq builds one lr scheduler per trainer (again
    when resuming), so the last one registered replaces the previous one. Also wraps the
    fairseq-train modules imported after the plugin."""
    global _listener
    _listener = weakref.ref(listener)
    _install_into_train_modules()


def validation_listener():
    """The object :func:`feed_validations_to` registered last, while it exists, else None."""
    return _listener() if _listener is not None else None


def stop_feeding_validations() -> None:
    global _listener
    _listener = None


def _feeds(cfg, listener) -> bool:
    """False when the training config names another lr scheduler than ``listener`` (a
    scheduler of an earlier run in the same process)."""
    lr_scheduler = getattr(cfg, "lr_scheduler", None) if cfg is not None else None
    name = getattr(lr_scheduler, "_name", None) if lr_scheduler is not None else None
    return name is None or name == listener.name


def _should_stop_early_feeding_validations(original):
    @functools.wraps(original)
    def should_stop_early(cfg, valid_loss):
        stop = original(cfg, valid_loss)
        listener = validation_listener()
        if listener is not None and _feeds(cfg, listener):
            stop = bool(listener.on_validate_and_save(valid_loss)) or stop
        return stop

    return should_stop_early


def train_modules() -> List[object]:
    """The loaded copies of fairseq's ``fairseq_cli/train.py`` (as a module and/or __main__)."""
    found = []
    module = sys.modules.get("fairseq_cli.train")
    if module is not None:
        found.append(module)
    main = sys.modules.get("__main__")
    main_file = os.path.normpath(getattr(main, "__file__", None) or "")
    if (main is not None and main is not module and main_file.endswith(os.path.join("fairseq_cli", "train.py"))
            and hasattr(main, "should_stop_early")):
        found.append(main)
    return found


# ---- 3. a refused or unreadable checkpoint in one line -----------------------------------

def _load_checkpoint_to_cpu_in_one_line(original):
    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return original(path, *args, **kwargs)
        except Exception as error:
            refusal = torch_load_error(path, error)
            if refusal is None:
                raise
            raise refusal from None

    return load_checkpoint_to_cpu


# ---- install / uninstall -----------------------------------------------------------------

def _wrap(module, name: str, make_wrapper) -> None:
    function = getattr(module, name, None)
    if function is not None and not getattr(function, _MARK, False):
        wrapper = make_wrapper(function)
        setattr(wrapper, _MARK, True)
        setattr(module, name, wrapper)


def _unwrap(module, name: str) -> None:
    function = getattr(module, name, None)
    if getattr(function, _MARK, False):
        setattr(module, name, function.__wrapped__)


def _install_into_train_modules() -> None:
    for module in train_modules():
        _wrap(module, "should_stop_early", _should_stop_early_feeding_validations)


def install() -> None:
    """Apply the wrappers (fairseq-train modules imported later get theirs from
    :func:`feed_validations_to`). Idempotent."""
    import fairseq.checkpoint_utils
    import fairseq.optim

    _wrap(fairseq.optim, "_build_optimizer", _build_optimizer_with_param_groups)
    _wrap(fairseq.checkpoint_utils, "load_checkpoint_to_cpu", _load_checkpoint_to_cpu_in_one_line)
    _install_into_train_modules()


def uninstall() -> None:
    """Put fairseq's own functions back (for tests)."""
    import fairseq.checkpoint_utils
    import fairseq.optim

    _unwrap(fairseq.optim, "_build_optimizer")
    _unwrap(fairseq.checkpoint_utils, "load_checkpoint_to_cpu")
    for module in train_modules():
        _unwrap(module, "should_stop_early")


def installed() -> Dict[str, bool]:
    """For each loaded patch target (``PARAM_GROUPS.target``, ...), whether our wrapper is in place."""
    import fairseq.checkpoint_utils
    import fairseq.optim

    state = {PARAM_GROUPS.target: getattr(fairseq.optim._build_optimizer, _MARK, False),
             CHECKPOINT_LOADING.target: getattr(fairseq.checkpoint_utils.load_checkpoint_to_cpu, _MARK, False)}
    for module in train_modules():
        state[f"{module.__name__}.should_stop_early"] = getattr(module.should_stop_early, _MARK, False)
    return state
