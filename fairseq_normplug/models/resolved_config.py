"""The model's resolved configuration: one frozen object per model build.

:func:`resolve` validates the plugin's flags on ``args`` (with
:func:`~fairseq_normplug.models.normplug_args.resolve_normplug_args`: its one-line refusals, the
extensions recorded) and returns a :class:`ResolvedConfig`: the norm type, the placement, the
modifiers switched on, the other switches and the extension modules, by name, beside the resolved
objects they came from (:class:`NormplugSettings`, with its ``LayerPlan``). ``build_model`` keeps
it on the built model as ``model.normplug_config``; a reader of a built or loaded model (the
diagnostics of a checkpoint, :func:`built_config`) asks it, never the raw flags again.

The model is built from the older forms (``args`` completed in place, by
:mod:`~fairseq_normplug.models.args_writer` only; ``NormplugSettings``, the
``TransformerNormplugConfig`` of the build hooks and the ``LayerPlan`` passed to them); this
object is read beside them (docs/extending.md).
"""
import contextlib
import functools
import io
import logging
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.normplug_args import NormplugSettings, resolve_normplug_args
from fairseq_normplug.models.placements.base import Placement


@dataclass(frozen=True)
class ResolvedConfig:
    """What the plugin's flags chose for one model, resolved and validated.

    ``norm_type``: the ``--norm-type`` (shorthands resolved; ``layernorm`` by default);
    ``norm_flags``: that norm type's own flags ((dest, value) pairs, read with :meth:`norm_flag`);
    ``norm_types_per_layer``: the ``--norm-types-per-layer`` spec, None without one;
    ``placement``: the ``--norm-placement`` name (``--prenorm``/``--postnorm`` and fairseq's
    normalize-before flags resolved); ``modifiers``: the modifiers switched on (their flag names
    without ``--``, in registration order); ``fixnorm``, ``weight_init``, ``qknorm``,
    ``residual_scale``, ``embed_scale``: those flags, resolved; ``extension_modules``: the
    extensions the checkpoint records (``--normplug-modules``, absolute paths or module names);
    ``settings``: the resolved objects (norm type, layer plan, ...) the build uses."""

    norm_type: str
    norm_flags: Tuple[Tuple[str, object], ...]
    norm_types_per_layer: Optional[str]
    placement: str
    modifiers: Tuple[str, ...]
    fixnorm: bool
    weight_init: str
    qknorm: bool
    residual_scale: str
    embed_scale: str
    extension_modules: Tuple[str, ...]
    settings: NormplugSettings = field(repr=False, compare=False)

    @property
    def placement_design(self) -> Placement:
        """The placement object (its capabilities and ``describe()``, for the readers' checks)."""
        return self.settings.layer_plan.placement

    def norm_flag(self, dest: str):
        """The value of the norm type's own flag ``dest`` (``taper_updates``); None for another's."""
        return dict(self.norm_flags).get(dest)

    def has(self, switch: str) -> bool:
        """Whether ``switch`` (a modifier's name, ``qknorm`` or ``fixnorm``; ``-`` or ``_``) is on."""
        name = switch.replace("_", "-")
        return name in self.modifiers or (name == "qknorm" and self.qknorm) or (name == "fixnorm" and self.fixnorm)


def _frozen(value):
    """A flag's value with its list (``nargs``) as a tuple."""
    return tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


def resolve(args) -> ResolvedConfig:
    """Validate the plugin's flags on ``args`` (``resolve_normplug_args``: completed in place by
    models/args_writer.py, one-line :class:`~fairseq_normplug.errors.NormplugError` refusals) and
    return what they chose."""
    settings = resolve_normplug_args(args)
    norm = settings.norm
    modules = getattr(args, "normplug_modules", None)
    return ResolvedConfig(
        norm_type=norm.name,
        norm_flags=tuple((dest, _frozen(getattr(args, dest, default))) for dest, default in norm.defaults.items()),
        norm_types_per_layer=getattr(args, "norm_types_per_layer", None),
        placement=settings.layer_plan.placement.name,
        modifiers=tuple(modifier.name for modifier in settings.layer_plan.modifiers),
        fixnorm=bool(settings.fixnorm),
        weight_init=settings.weight_init,
        qknorm=bool(settings.beyond.qknorm),
        residual_scale=settings.beyond.residual_scale,
        embed_scale=settings.beyond.embed_scale,
        extension_modules=tuple(modules.split(",")) if modules else (),
        settings=settings)


@functools.lru_cache(maxsize=1024)
def _resolve_flag_tuple(flags: Tuple[str, ...]) -> ResolvedConfig:
    from fairseq import options

    import fairseq_normplug

    argv = ["<no data: flags only>", "--task", "translation_normplug", "--arch", "transformer_normplug",
            "--user-dir", os.path.dirname(fairseq_normplug.__file__), *flags]
    loggers = [logging.getLogger(name) for name in ("fairseq_normplug", "fairseq.utils")]
    levels = [logger.level for logger in loggers]
    errors = io.StringIO()
    try:
        for logger in loggers:  # resolving a row's flags is not a run: no "--fixnorm: tying ..." lines
            logger.setLevel(logging.WARNING)
        with contextlib.redirect_stderr(errors):
            args, _ = options.parse_args_and_arch(options.get_training_parser(), argv, parse_known=True)
        return resolve(args)
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        raise NormplugError(lines[-1] if lines else f"fairseq-train refuses the flags {' '.join(flags)}") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def resolve_flags(flags: Sequence[str]) -> ResolvedConfig:
    """What the model flags among ``flags`` choose, as a model built from them would resolve
    them: fairseq-train's own parser with the plugin's task and architecture (no data is read, no
    model built; flags of components ``flags`` does not choose, like an optimizer's
    ``--weight-decay``, are left aside), then :func:`resolve`. The one reading of a table row's flags (the
    tables' published-number matching), so a row is labelled as its model is built. A one-line
    NormplugError for flags fairseq-train or the plugin refuses (argparse's line, or the
    plugin's refusal)."""
    return _resolve_flag_tuple(tuple(flags))


def built_config(model: nn.Module) -> Optional[ResolvedConfig]:
    """The resolved configuration ``model`` was built from (``transformer_normplug``, built or
    loaded from a checkpoint); None for a model the plugin did not build (fairseq's ``transformer``)."""
    return getattr(model, "normplug_config", None)
