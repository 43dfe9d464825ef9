"""``--norm-types-per-layer SPEC``: a norm type per layer, or per norm site, instead of one
``--norm-type`` everywhere (x-transformers issue #199; the DyT authors' LLaMA recipes set a
different alpha per site). Every norm the spec does not name keeps ``--norm-type``.

SPEC is comma-separated entries ``SELECTOR=TYPE[:INIT]``:

* ``SELECTOR`` is ``STACK.LAYERS`` (every norm of those layers), ``STACK.LAYERS.SITE`` (one norm
  of each of those layers) or ``STACK.final`` / ``STACK.embed`` (the stack's final norm and
  ``--layernorm-embedding``). ``STACK`` is ``enc`` or ``dec``; ``LAYERS`` is a 0-based layer
  ``N``, a range ``A-B`` (both included) or ``*`` (every layer); ``SITE`` is a norm's short name
  as the norm statistics log it (``attn``, ``cross``, ``ffn``, and the chosen placement's and
  modifiers' own: Sandwich's ``attn_out``, HybridNorm's ``attn_q``, ...). The selectors are the
  logged names: ``dec3.ffn`` is ``dec.3.ffn``, ``enc.final`` is ``enc.final``.
* ``TYPE`` is a registered norm type (``--norm-type``'s choices, extensions' included).
* ``INIT`` (optional) is the scale init of those norms, a number > 0 or ``auto``, for a norm type
  with one (its ``scale_init_flags``: DyT's alpha, Derf's alpha, DyISRU's beta); it overrides
  every scale-init flag of that type at those sites.

A later entry overrides an earlier one where both select a norm
(``enc.*=dyt,enc.0=layernorm``). A type's own flags (``--dyt-squash``, ``--taper-updates``, ...)
apply to every norm of that type and are accepted when the type is named only here.
Example: ``enc.0-1=layernorm,enc.2-5=dyt,dec.*=rmsnorm,dec.*.attn=dyt:0.8``.

The spec is parsed and checked when the arguments are resolved (before any data is read); a
malformed one is one :class:`NormplugError` line naming the bad part (stack, layer range, a
layer the stack does not have, site, norm type with the valid ones, init). The build's norm
factory (``models/norm_factory.py``) builds each norm from it, per slot, where the slot's layer or
stack is built; an entry that selects no norm of the built model is refused right after the build.
"""
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.flag_lists import flag
from fairseq_normplug.models.placements.base import STOCK_LAYER_SLOTS
from fairseq_normplug.modules.norm_registry import (AUTO, NORM_TYPES, SCALE_INIT_RANGE, get_norm_type,
                                                     zero_centered_gamma_error)
from fairseq_normplug.numeric_flags import number_error

FLAG = "--norm-types-per-layer"
EXAMPLE = "enc.0-1=layernorm,enc.2-5=dyt,dec.*=rmsnorm"
#: the stacks of a selector and their layer-count flags
STACKS = {"enc": "encoder_layers", "dec": "decoder_layers"}
STACK_NAMES = {"enc": "encoder", "dec": "decoder"}
#: a stack's own norms (``models/norm_placement.STACK_NORM_SLOTS``' short names)
STACK_SITES = ("final", "embed")
_LAYERS = re.compile(r"^(\*|\d+|\d+-\d+)$")

ScaleInit = Union[float, str, None]


@dataclass(frozen=True)
class NormTypeEntry:
    """One entry of the spec: ``stack`` (enc/dec); ``layers`` (first, last) inclusive, None for
    every layer, or ``stack_site`` (final/embed) instead; ``site`` (a layer norm's short name,
    None for all); the norm type ``norm_type`` and its ``scale_init`` (None: the flags')."""

    text: str
    stack: str
    layers: Optional[Tuple[int, int]]
    site: Optional[str]
    stack_site: Optional[str]
    norm_type: str
    scale_init: ScaleInit

    def selects(self, name: str) -> bool:
        """Whether the norm logged as ``name`` (``enc0.attn``, ``dec.final``) is selected."""
        stack, _, short = name.partition(".")
        if self.stack_site is not None:
            return stack == self.stack and short == self.stack_site
        match = re.fullmatch(rf"{self.stack}(\d+)", stack)
        if match is None:
            return False
        index = int(match.group(1))
        in_layers = self.layers is None or self.layers[0] <= index <= self.layers[1]
        return in_layers and (self.site is None or short == self.site)


def _refuse(entry: str, message: str) -> None:
    raise NormplugError(f"{FLAG} entry {entry!r}: {message}")


def _scale_init(entry: str, text: str) -> ScaleInit:
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        value = text
    problem = number_error("the scale init", value, SCALE_INIT_RANGE)
    if problem:
        _refuse(entry, problem)
    return value


def parse_norm_types_per_layer(spec: Optional[str]) -> Tuple[NormTypeEntry, ...]:
    """The entries of ``spec`` (module docstring), checked for form: stack, layer range, norm
    type, init. Layer counts and sites are checked by :func:`check_norm_types_per_layer`."""
    if spec is None:
        return ()
    if not str(spec).strip():
        raise NormplugError(f"{FLAG} is empty; give SELECTOR=TYPE entries, e.g. {EXAMPLE}")
    entries = []
    for text in str(spec).split(","):
        text = text.strip()
        if not text:
            raise NormplugError(f"{FLAG} {spec!r} has an empty entry (two commas, or one at an end)")
        selector, equals, choice = text.partition("=")
        if not equals or not choice:
            _refuse(text, f"expected STACK.LAYERS[.SITE]=TYPE[:INIT], e.g. {EXAMPLE}")
        parts = selector.split(".")
        stack = parts[0]
        if stack not in STACKS:
            _refuse(text, f"unknown stack {stack!r}; choose enc or dec")
        if len(parts) not in (2, 3) or not all(parts[1:]):
            _refuse(text, f"the selector {selector!r} must be STACK.LAYERS, STACK.LAYERS.SITE, STACK.final "
                          f"or STACK.embed")
        layers, site, stack_site = None, None, None
        if parts[1] in STACK_SITES:
            if len(parts) == 3:
                _refuse(text, f"{stack}.{parts[1]} is one norm of the stack; it takes no site")
            stack_site = parts[1]
        elif not _LAYERS.match(parts[1]):
            _refuse(text, f"bad layer range {parts[1]!r}; use N, A-B (0-based, both included) or *, "
                          f"or {' / '.join(STACK_SITES)} for the stack's own norms")
        else:
            if parts[1] != "*":
                first, _, last = parts[1].partition("-")
                layers = (int(first), int(last or first))
                if layers[0] > layers[1]:
                    _refuse(text, f"bad layer range {parts[1]!r}: {layers[0]} > {layers[1]}")
            site = parts[2] if len(parts) == 3 else None
        norm_type, colon, init = choice.partition(":")
        if norm_type not in NORM_TYPES:
            _refuse(text, f"unknown norm type {norm_type!r}; choose from {', '.join(NORM_TYPES)}")
        scale_init = None
        if colon:
            if not getattr(NORM_TYPES[norm_type].module, "scale_init_flags", ()):
                with_init = [n for n, t in NORM_TYPES.items() if getattr(t.module, "scale_init_flags", ())]
                _refuse(text, f"norm type {norm_type} has no scale init (types with one: {', '.join(with_init)})")
            scale_init = _scale_init(text, init)
        entries.append(NormTypeEntry(text, stack, layers, site, stack_site, norm_type, scale_init))
    return tuple(entries)


def named_norm_types(args) -> Tuple[str, ...]:
    """The norm types ``args.norm_types_per_layer`` names (parsed; malformed: one line)."""
    entries = parse_norm_types_per_layer(getattr(args, "norm_types_per_layer", None))
    return tuple(dict.fromkeys(entry.norm_type for entry in entries))


class SiteArgs:
    """``args`` as one site's norm sees them: ``norm_type`` and the type's scale-init flags
    replaced (``values``), everything else read through."""

    def __init__(self, args, values: Dict[str, object]):
        self._args, self._values = args, values

    def __getattr__(self, name):
        if name in ("_args", "_values"):
            raise AttributeError(name)
        return self._values[name] if name in self._values else getattr(self._args, name)


def site_args(args, norm_type: str, scale_init: ScaleInit) -> SiteArgs:
    """The arguments a norm of ``norm_type`` (with ``scale_init`` when given) is built from."""
    values: Dict[str, object] = {"norm_type": norm_type}
    if scale_init is not None:
        for dest in getattr(NORM_TYPES[norm_type].module, "scale_init_flags", ()):
            values[dest] = scale_init
    return SiteArgs(args, values)


def _layer_sites(layer_plan, stack: str) -> Tuple[str, ...]:
    """The short names a layer norm of ``stack`` can have with ``layer_plan``'s designs."""
    sites = [short for _, _, short in STOCK_LAYER_SLOTS if not (stack == "enc" and short == "cross")]
    for design in layer_plan.designs:
        sites += [short for _, _, short in design.norm_slots if short not in sites]
    return tuple(sites)


def check_norm_types_per_layer(args, layer_plan, residual_scale: str, weight_init: str) -> Tuple[NormTypeEntry, ...]:
    """Check the spec against the model's flags: layers the stack has, sites the placement has,
    each named type's own flags (``check_args``, with the entry's init), and the designs that
    constrain the norm type (nGPT, T-Fixup, DeepNorm/Admin, ``--zero-centered-gamma``)."""
    entries = parse_norm_types_per_layer(getattr(args, "norm_types_per_layer", None))
    if not entries:
        return entries
    if getattr(args, "ngpt", False):
        raise NormplugError(f"{FLAG} cannot be combined with --ngpt: nGPT has no norm layers")
    for entry in entries:
        layers = getattr(args, STACKS[entry.stack], None)
        if entry.layers is not None and layers is not None and entry.layers[1] >= layers:
            bad = entry.layers[1] if entry.layers[0] < layers else entry.layers[0]
            _refuse(entry.text, f"layer {bad} is out of range: the {STACK_NAMES[entry.stack]} has layers "
                                f"0-{layers - 1} ({flag(STACKS[entry.stack])} {layers})")
        sites = _layer_sites(layer_plan, entry.stack)
        if entry.site is not None and entry.site not in sites:
            _refuse(entry.text, f"unknown site {entry.site!r} for {STACK_NAMES[entry.stack]} layers with "
                                f"{layer_plan.placement.describe()}; choose from {', '.join(sites)}")
        name = entry.norm_type
        norm = get_norm_type(name)
        if getattr(args, "zero_centered_gamma", False) and not norm.per_channel_gain:
            _refuse(entry.text, zero_centered_gamma_error(name))
        if weight_init == "tfixup" and name != "identity":
            _refuse(entry.text, f"--weight-init tfixup is for models without norms (T-Fixup); it names {name}")
        if residual_scale in ("deepnorm", "admin") and name == "identity":
            _refuse(entry.text, f"--residual-scale {residual_scale} needs a norm after each residual; "
                                f"choose a norm type other than identity")
        try:
            norm.check_args(site_args(args, name, entry.scale_init))
        except NormplugError as error:
            _refuse(entry.text, str(error))
    return entries


def norm_type_sources(args) -> Sequence[str]:
    """The Python modules defining the norm types the spec names (recorded in a checkpoint)."""
    return [NORM_TYPES[name].source for name in named_norm_types(args)]


def norm_choice(entries: Iterable[NormTypeEntry], name: str) -> Optional[NormTypeEntry]:
    """The last entry selecting the norm logged as ``name``, or None (``--norm-type``'s)."""
    chosen = None
    for entry in entries:
        if entry.selects(name):
            chosen = entry
    return chosen


def spec_label(spec: str) -> str:
    """The spec as a results table's ``norm`` label shows it: ``per-layer(SPEC)`` without spaces."""
    return f"per-layer({''.join(spec.split())})"
