"""The norm types of ``--norm-type``, registered in one place: :data:`NORM_TYPES` maps each name
to its :class:`NormType`, the one object that owns everything about that norm.

The public interface (``from fairseq_normplug import register_norm``), also used by every
built-in norm::

    @register_norm("mynorm", per_channel_gain=True)
    class MyNorm(FormulaNorm):            # or any nn.Module
        '''The paper, and the equation this implements.'''

        @staticmethod
        def add_args(parser):             # optional: the norm's own flags (default None/False)
            parser.add_argument("--mynorm-p", **number_flag(above=0))

        @classmethod
        def check_args(cls, args):        # optional: one-line refusals (NormplugError)
            ...

        def __init__(self, dim, args):    # dim: the width; args: fairseq's parsed arguments
            ...

``scale_init_flags`` (optional) names its flags that take a number or ``auto`` (declared with
``**scale_init_flag()``): they must be finite and positive, and ``auto`` needs --amp with
fp16/bf16. A numeric flag of its own declares its range with ``**number_flag(...)``
(:mod:`fairseq_normplug.numeric_flags`): a value that is not finite or out of range is refused
in one line.
``build(cls, dim, args, slot)`` (a classmethod, optional) replaces ``cls(dim, args)`` when the
module depends on where it sits (:class:`NormSlot`: the role ATTENTION/FFN/FINAL, whether it
feeds the output layer, its logged name) or keeps a constructor of its own. The registry adds
the flags to ``fairseq-train``'s parser (``--norm-type`` choices, ``--NAME`` with
``shorthand=True``), refuses a norm's own flag given with another ``--norm-type``, refuses
``--zero-centered-gamma`` for a norm without ``per_channel_gain``, and then runs the norm's
``check_args``. A :class:`~fairseq_normplug.modules.norm_base.FormulaNorm` subclass also gets
fp16/bf16 computed in float32, float32 scalars, the data-driven ``auto`` init and the gain
``1 + gamma`` of ``--zero-centered-gamma``; every norm gets every placement, the norm
statistics (``--norm-stats-interval``) and ``--norm-weight-decay``. Extensions from outside the
package are loaded by ``fairseq_normplug/extensions.py`` before fairseq parses the arguments.
"""
import argparse
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.flag_lists import flag
from fairseq_normplug.numeric_flags import NumberRange, check_number, check_number_flags, number_flag

#: an init value meaning "choose from the first training batch" (``auto_init.py``)
AUTO = "auto"

#: where a norm sits; DyT takes a separate alpha init for the attention blocks' norms
ATTENTION, FFN, FINAL = "attention", "ffn", "final"

ScaleInit = Union[float, str]
#: the valid values of a scale-init flag: a finite number > 0, or ``auto``
SCALE_INIT_RANGE = NumberRange(low=0, low_open=True, words=(AUTO,))


@dataclass(frozen=True)
class NormSlot:
    """Where one norm sits: its ``role`` (ATTENTION, FFN or FINAL), whether its output goes to
    the output layer (``feeds_output``) and the name it logs under (e.g. ``dec2.ffn``)."""

    role: str = FFN
    feeds_output: bool = False
    name: str = ""


class NormType:
    """One registered ``--norm-type``: its module class and what it owns (module docstring)."""

    def __init__(self, name: str, module: type, shorthand: bool, per_channel_gain: bool):
        self.name = name
        self.module = module
        self.shorthand = shorthand
        self.per_channel_gain = per_channel_gain
        self.flags = self._flag_actions()
        self.defaults = {action.dest: action.default for action in self.flags}

    @property
    def source(self) -> str:
        """The Python module that registered it (built-ins: ``fairseq_normplug.modules...``)."""
        return self.module.__module__

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.module) or ""

    def add_args(self, parser) -> None:
        add_args = getattr(self.module, "add_args", None)
        if add_args is not None:
            add_args(parser)

    def _flag_actions(self) -> Tuple[argparse.Action, ...]:
        """The argparse actions of the norm's own flags (read from a scratch parser)."""
        parser = argparse.ArgumentParser(add_help=False)
        before = {action.dest for action in parser._actions}
        self.add_args(parser)
        return tuple(action for action in parser._actions if action.dest not in before)

    def check_args(self, args) -> None:
        check_number_flags(args, self.flags)  # finite, in the range declared with each flag
        check_scale_inits(args, getattr(self.module, "scale_init_flags", ()))
        check = getattr(self.module, "check_args", None)
        if check is not None:
            check(args)

    def build(self, dim: int, args, slot: NormSlot) -> nn.Module:
        build = getattr(self.module, "build", None)
        return build(dim, args, slot) if build is not None else self.module(dim, args)


#: every registered norm type, by name, in registration order (built-ins first)
NORM_TYPES: Dict[str, NormType] = {}


def register_norm(name: str, *, shorthand: bool = False, per_channel_gain: bool = False) -> Callable[[type], type]:
    """Register the decorated class as ``--norm-type name`` (module docstring).

    ``shorthand``: also accept ``--name`` for ``--norm-type name``; ``per_channel_gain``: the
    norm has a per-channel gain ``weight`` that ``--zero-centered-gamma`` may store as gamma
    (the module then gets ``args.zero_centered_gamma`` and must honour it). A name that is
    already registered is refused, so an extension cannot silently replace a built-in.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum() or name != name.lower():
        raise NormplugError(f"register_norm: the norm type name {name!r} must be lower-case letters, "
                            f"digits, '-' or '_'")

    def register(module: type) -> type:
        if name in NORM_TYPES and NORM_TYPES[name].module is not module:
            raise NormplugError(f"register_norm: --norm-type {name} is already registered by "
                                f"{NORM_TYPES[name].source}; choose another name")
        NORM_TYPES[name] = NormType(name, module, shorthand, per_channel_gain)
        return module

    return register


def norm_type_names() -> Tuple[str, ...]:
    return tuple(NORM_TYPES)


def get_norm_type(name: str) -> NormType:
    """The registered norm type ``name``, or a one-line error naming the registered ones."""
    if name not in NORM_TYPES:
        raise NormplugError(f"unknown --norm-type {name!r}; choose from {', '.join(NORM_TYPES)} "
                            f"(a norm of your own: --normplug-modules FILE, docs/extending.md)")
    return NORM_TYPES[name]


def add_norm_type_args(add, parser) -> None:
    """``--norm-type`` (choices: the registered types at parse time), the shorthands and every
    norm type's own flags. ``add`` is the argument group's add_argument, ``parser`` the group."""
    names = norm_type_names()
    add("--norm-type", choices=names,
        help="the norm used everywhere (sublayers and final norms); default layernorm; one of "
             + ", ".join(names) + " (see docs/norms.md; your own: --normplug-modules)")
    for norm in NORM_TYPES.values():
        if norm.shorthand:
            add(flag(norm.name), action="store_true", help=f"shorthand for --norm-type {norm.name}")
        norm.add_args(parser)


def norm_flag_defaults() -> Dict[str, object]:
    """{dest: default} of every registered norm type's flags and shorthands."""
    defaults: Dict[str, object] = {}
    for norm in NORM_TYPES.values():
        if norm.shorthand:
            defaults[norm.name.replace("-", "_")] = False
        defaults.update(norm.defaults)
    return defaults


def chosen_norm_type(args) -> NormType:
    """The norm type chosen by ``--norm-type`` or a shorthand (layernorm by default); two types
    at once are refused. ``args`` (with :func:`norm_flag_defaults` filled in) is read only: the
    caller writes the name to ``args.norm_type`` (models/args_writer.py) before
    :func:`check_norm_type_args`."""
    chosen = []
    if args.norm_type is not None:
        chosen.append((f"--norm-type {args.norm_type}", get_norm_type(args.norm_type).name))
    chosen += [(flag(n.name), n.name) for n in NORM_TYPES.values()
               if n.shorthand and getattr(args, n.name.replace("-", "_"), False)]
    if len({name for _, name in chosen}) > 1:
        raise NormplugError(f"two norm types at once: {' and '.join(f for f, _ in chosen)}; "
                            f"choose one of {', '.join(NORM_TYPES)}")
    return NORM_TYPES[chosen[0][1] if chosen else "layernorm"]


def check_norm_type_args(args, norm: NormType, also_used: Sequence[str] = ()) -> None:
    """The refusals of the norm type ``norm`` (:func:`chosen_norm_type`): another type's flag (a
    type in ``also_used``, which ``--norm-types-per-layer`` names, may get its flags),
    ``--zero-centered-gamma`` without a gain, then the type's own ``check_args``."""
    for other in NORM_TYPES.values():
        given = [dest for dest, default in other.defaults.items()
                 if other is not norm and other.name not in also_used
                 and getattr(args, dest, default) not in (None, False, default)]
        if given:
            shorthand = f" (or {flag(other.name)})" if other.shorthand else ""
            raise NormplugError(f"{flag(given[0])} needs --norm-type {other.name}{shorthand}, "
                                f"got --norm-type {norm.name}")
    norm.check_args(args)  # first, so a norm's own reason for refusing a flag wins
    if getattr(args, "zero_centered_gamma", False) and not norm.per_channel_gain:
        raise NormplugError(zero_centered_gamma_error(norm.name))


def norm_type_of(module: nn.Module) -> str:
    """The registered norm type that builds modules like ``module`` (a registered class, or one
    of its ``module_classes``); else the class name in lower case."""
    for norm in NORM_TYPES.values():
        classes = getattr(norm.module, "module_classes", (norm.module,))
        if isinstance(module, tuple(c for c in classes if isinstance(c, type))):
            return norm.name
    return type(module).__name__.lower()


def norm_args(norm_type: str = "layernorm", **values) -> argparse.Namespace:
    """Arguments resolved as ``fairseq-train`` resolves them for one norm type, for building its
    norms outside a model (tests, notebooks): ``--norm-eps`` 1e-5, no ``--zero-centered-gamma``,
    the norm's own flags at their defaults, overridden by ``values`` (e.g. ``dyt_alpha_init=0.2``)."""
    fields = {"norm_type": norm_type, "norm_eps": 1e-5, "zero_centered_gamma": False, **values}
    fields.update({dest: default for dest, default in norm_flag_defaults().items() if fields.get(dest) is None})
    norm = chosen_norm_type(argparse.Namespace(**fields))
    args = argparse.Namespace(**{**fields, "norm_type": norm.name})
    check_norm_type_args(args, norm)
    return args


def zero_centered_gamma_types() -> Tuple[str, ...]:
    """The norm types with a per-channel gain, which ``--zero-centered-gamma`` applies to."""
    return tuple(name for name, norm in NORM_TYPES.items() if norm.per_channel_gain)


def zero_centered_gamma_error(norm_type: str, reason: str = "it has no per-channel gain") -> str:
    return (f"--zero-centered-gamma cannot be used with --norm-type {norm_type} ({reason}); "
            f"it applies to {', '.join(zero_centered_gamma_types())}")


def build_norm(args, dim: int, slot: NormSlot = NormSlot()) -> nn.Module:
    """One norm of the type ``args.norm_type`` (already resolved) for a ``dim``-wide input."""
    norm = get_norm_type(args.norm_type)
    wants_zero_centered = bool(getattr(args, "zero_centered_gamma", False))
    if wants_zero_centered and not norm.per_channel_gain:
        norm.check_args(args)  # the norm's own reason, if it gives one
        raise NormplugError(zero_centered_gamma_error(norm.name))
    module = norm.build(dim, args, slot)
    if wants_zero_centered and not getattr(module, "zero_centered_gamma", False):
        raise NormplugError(f"--norm-type {norm.name} ({norm.source}) is registered with a per-channel gain "
                            f"but ignored --zero-centered-gamma; pass args.zero_centered_gamma to its gain "
                            f"(FormulaNorm(dim, zero_centered_gamma=...) and new_gain())")
    return module


def scale_init_value(text: str) -> ScaleInit:
    """argparse type of the scale-init flags: a number or ``auto`` (``check_scale_inits``
    refuses a number <= 0 with a one-line error)."""
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or '{AUTO}', got {text!r}") from None


def scale_init_flag() -> dict:
    """``add_argument`` keywords of a scale-init flag: a finite number > 0 or ``auto``."""
    return number_flag(scale_init_value, above=0, words=(AUTO,))


def check_scale_inits(args, dests: Sequence[str]) -> None:
    """The scale-init flags ``dests``: finite and positive, or ``auto``; ``auto`` sets values during the first
    forward, after fairseq's --fp16/--bf16 optimizer copied its fp32 master weights (which would
    overwrite them after the first step), so it needs --amp or --memory-efficient-*."""
    for dest in dests:
        check_number(flag(dest), getattr(args, dest, None), SCALE_INIT_RANGE)
    autos = [dest for dest in dests if getattr(args, dest, None) == AUTO]
    low = [name for name in ("fp16", "bf16") if getattr(args, name, False)]
    exempt = any(getattr(args, name, False) for name in ("memory_efficient_fp16", "memory_efficient_bf16", "amp"))
    if autos and low and not exempt:
        raise NormplugError(f"{flag(autos[0])} auto cannot be combined with --{low[0]} (its fp32 master "
                            f"weights are copied before the first batch); use --amp or --memory-efficient-{low[0]}")


def scale_init(value: Optional[ScaleInit], make: Callable[[Optional[float]], nn.Module],
               default: Optional[float]) -> nn.Module:
    """``make(value)``, or for ``value == AUTO`` ``make(default)`` marked for the
    data-driven init of ``auto_init.py``."""
    if value != AUTO:
        return make(value)
    module = make(default)
    module.auto_init = True
    return module


#: the built-in norm types, one module each (its registration sits in that file); adding a
#: built-in is one file plus one line here
BUILTIN_NORM_MODULES = ("layer_norm_1p", "scale_norm", "rms_norm", "dynamic_tanh", "derf", "dyisru", "seed_norm",
                        "identity_norm", "taper_norm", "fixed_std_layer_norm", "bhyt")


def _register_builtins() -> None:
    import importlib

    for name in BUILTIN_NORM_MODULES:
        importlib.import_module(f"fairseq_normplug.modules.{name}")


_register_builtins()
