"""The one model-side module that writes fairseq's ``args`` namespace (issue 56).

The resolvers (:mod:`~fairseq_normplug.models.normplug_args` and the modules it calls, the
placements and modifiers, QKNorm's g0) compute values and hand them here; this module writes them,
each field with its one-line reason (:data:`FAIRSEQ_FIELDS`, :data:`PLUGIN_FIELDS`). What ends up
in ``args`` is what a checkpoint records (its ``cfg.model``), and what a second resolution of the
same ``args`` (``build_model`` after the ``--arch`` presets, a checkpoint being loaded) reads
back: every write here is idempotent.

The ``--arch`` presets (:mod:`~fairseq_normplug.models.architectures`) fill in fairseq's defaults
(sizes, dropout, tying), as fairseq's own architectures do; nothing else writes ``args``.
"""
import importlib.util
import logging
from typing import Mapping

from fairseq_normplug.errors import NormplugError

logger = logging.getLogger(__name__)

#: fairseq's own fields the plugin sets, and why (one line each)
FAIRSEQ_FIELDS = {
    "encoder_normalize_before": "--norm-placement pre is fairseq's PreNorm: fairseq's encoder layers and final "
                                "norm read this flag",
    "decoder_normalize_before": "--norm-placement pre is fairseq's PreNorm: fairseq's decoder layers and final "
                                "norm read this flag",
    "share_decoder_input_output_embed": "--fixnorm is defined on the tied output layer (Tears eq. 6): fairseq "
                                        "ties it on this flag",
    "tpu": "fairseq's parser turns --bf16 into --tpu, which fails in torch_xla off a TPU: taken back where "
           "torch_xla is not installed",
}
#: the plugin's own fields written with a resolved value (beyond a default filled in), and why
PLUGIN_FIELDS = {
    "norm_type": "the norm type that --norm-type or a shorthand chose, so a checkpoint names it",
    "norm_placement": "the placement that --norm-placement, --prenorm/--postnorm or fairseq's normalize-before "
                      "flags chose, so a checkpoint names it",
    "normplug_modules": "the extensions defining the model's norms and placements, so a checkpoint loads them",
    "weight_init": "the init that --weight-init or --smallinit chose, so a checkpoint names it",
    "residual_scale": "--residual-scale with its default (none), so a checkpoint names it",
    "embed_scale": "--embed-scale with its default (fixed), so a checkpoint names it",
    "qknorm_g0": "QKNorm's g0, computed from the training data once, so generation and a reloaded "
                 "checkpoint never need the data",
}
#: why a placement's or modifier's own flag is written (its ``resolved_fields``)
DESIGN_FIELD_REASON = "a layer design's own flag with its default resolved, so a checkpoint rebuilds the same design"
#: why a flag's default is filled in
DEFAULT_REASON = ("a plugin flag absent from args (an old checkpoint, a hand-made Namespace) or not given: "
                  "its default, so every reader and the checkpoint see the same value")


def fill_defaults(args, defaults: Mapping[str, object]) -> None:
    """Each field of ``defaults`` ({dest: default}: the plugin's own flags) that ``args`` lacks or
    holds as None gets its default (:data:`DEFAULT_REASON`)."""
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def write_resolved(args, fields: Mapping[str, object]) -> None:
    """Write ``fields`` ({dest: resolved value}) into ``args``, in their order; each must be one of
    :data:`FAIRSEQ_FIELDS` or :data:`PLUGIN_FIELDS`, which give the reason."""
    unknown = [name for name in fields if name not in FAIRSEQ_FIELDS and name not in PLUGIN_FIELDS]
    if unknown:
        raise NormplugError(f"the plugin has no reason to write args.{unknown[0]}; it writes only "
                            f"{', '.join([*FAIRSEQ_FIELDS, *PLUGIN_FIELDS])} (models/args_writer.py)")
    for name, value in fields.items():
        setattr(args, name, value)


def write_design_fields(args, design) -> None:
    """Write a placement's or modifier's resolved flags (``design.resolved_fields()``) into
    ``args`` (:data:`DESIGN_FIELD_REASON`); a design writes only its own flags (``defaults``)."""
    fields = design.resolved_fields()
    foreign = [name for name in fields if name not in design.defaults]
    if foreign:
        raise NormplugError(f"{design.describe()} resolves args.{foreign[0]}, which is not one of its flags "
                            f"({', '.join(design.defaults) or 'it has none'})")
    for name, value in fields.items():
        setattr(args, name, value)


def bf16_without_tpu(args) -> None:
    """Let ``--bf16`` mean bfloat16 on a GPU or CPU. fairseq's argument parser turns every
    ``--bf16`` into ``--tpu`` (a TPU-era shortcut), which then fails in ``torch_xla`` on any
    other machine; where ``torch_xla`` is not installed that can only be a mistake, so the
    TPU switch is taken back (on a TPU machine nothing changes)."""
    if (getattr(args, "bf16", False) and getattr(args, "tpu", False)
            and importlib.util.find_spec("torch_xla") is None):
        logger.info("--bf16 without torch_xla installed: bfloat16 on the GPU or CPU, not a TPU")
        write_resolved(args, {"tpu": False})
