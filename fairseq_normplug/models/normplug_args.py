"""Command-line flags of ``transformer_normplug`` and their resolution into a validated
:class:`NormplugSettings`. Flag names avoid the ``encoder_``/``decoder_``/``quant_noise_``
prefixes, which fairseq's TransformerConfig would reroute into sub-configs."""
import logging
from dataclasses import dataclass

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.extensions import LOADED, load_extensions, needed_sources
from fairseq_normplug.models.args_writer import fill_defaults, write_resolved
from fairseq_normplug.models.beyond_args import BEYOND_DEFAULTS, BeyondSettings, add_beyond_args, resolve_beyond_args
from fairseq_normplug.models.norm_types_per_layer import (EXAMPLE, check_norm_types_per_layer, named_norm_types,
                                                          norm_type_sources)
from fairseq_normplug.models.placement_args import add_placement_args, resolve_placement_args
from fairseq_normplug.models.placements.base import PRENORM_LIKE, lacks, missing_capability
from fairseq_normplug.models.placements.layers import LayerPlan
from fairseq_normplug.numeric_flags import check_number_flags, number_flag
from fairseq_normplug.models.output_layer_args import (
    OUTPUT_LAYER_DEFAULTS,
    OutputLayerSettings,
    add_output_layer_args,
    resolve_output_layer_args,
)
from fairseq_normplug.modules.norm_registry import (NormType, add_norm_type_args, check_norm_type_args,
                                                     chosen_norm_type, norm_flag_defaults,
                                                     zero_centered_gamma_types)
from fairseq_normplug.modules.weight_init import WEIGHT_INITS

DEFAULTS = {
    "prenorm": False,
    "postnorm": False,
    "norm_type": None,
    "norm_eps": 1e-5,
    "zero_centered_gamma": False,
    "fixnorm": False,
    "weight_init": None,
    "smallinit": False,
    "norm_stats_interval": 0,
    "normplug_modules": None,
    "norm_types_per_layer": None,
}
logger = logging.getLogger(__name__)


def add_normplug_args(parser) -> None:
    """Add the plugin's flags (defaults are filled in by the architecture presets)."""
    group = parser.add_argument_group("fairseq-normplug (Transformers without Tears / DyT)")
    add = group.add_argument
    add("--prenorm", action="store_true",
        help="PreNorm: norm before each sublayer plus a final norm after the encoder and decoder "
             "stacks (= --norm-placement pre = --encoder-normalize-before --decoder-normalize-before)")
    add("--postnorm", action="store_true",
        help="PostNorm (the default): norm after each residual addition; no final norms "
             "(= --norm-placement post)")
    add("--norm-eps", metavar="EPS", **number_flag(above=0),
        help="ScaleNorm/RMSNorm/DyISRU epsilon (default 1e-5)")
    add("--zero-centered-gamma", action="store_true",
        help="store each norm's per-channel gain as gamma, init 0, applied as 1+gamma "
             "(TransformerEngine zero_centered_gamma, Megatron --apply-layernorm-1p): weight decay "
             "pulls the gain to 1; applies to " + ", ".join(zero_centered_gamma_types()))
    add("--fixnorm", action="store_true",
        help="FixNorm: l2-normalised word embeddings, U(-0.01,0.01) init, tied output layer "
             "(implies --share-decoder-input-output-embed unless --share-all-embeddings)")
    add("--weight-init", choices=WEIGHT_INITS,
        help="attention/FFN init: fairseq's own (default), xavier (the paper's Xavier-normal "
             "baseline) or smallinit")
    add("--smallinit", action="store_true",
        help="shorthand for --weight-init smallinit: attention weights ~ N(0, sqrt(2/(5d)))")
    add("--norm-stats-interval", metavar="N", **number_flag(int, at_least=0),
        help="every N updates, log each norm's scale (ScaleNorm g, DyT alpha, mean gain) and "
             "its input std into the training log (0 = off, the default)")
    add("--normplug-modules", metavar="PATH[,PATH...]",
        help="your own norm types and placements: .py files, package folders or importable module names, "
             "loaded before the model's arguments are parsed and recorded in the checkpoint "
             "(docs/extending.md)")
    add_norm_type_args(add, group)
    add("--norm-types-per-layer", metavar="SPEC",
        help=f"a norm type per layer or per norm site, overriding --norm-type where named: comma-separated "
             f"STACK.LAYERS[.SITE]=TYPE[:INIT] (STACK enc/dec, LAYERS N, A-B or *, SITE a norm's logged name "
             f"such as attn/cross/ffn; STACK.final / STACK.embed; INIT the scale init of a type with one), "
             f"later entries win, e.g. {EXAMPLE} (docs/beyond.md)")
    add_output_layer_args(add)
    add_beyond_args(add)
    add_placement_args(group)


@dataclass(frozen=True)
class NormplugSettings:
    prenorm: bool
    norm: NormType
    fixnorm: bool
    weight_init: str
    norm_stats_interval: int
    beyond: BeyondSettings
    output: OutputLayerSettings
    layer_plan: LayerPlan  # --norm-placement and the modifiers switched on


def check_numeric_flags(args) -> None:
    """Every numeric flag of the plugin (extensions' included) on ``args``: finite and in the
    range declared with it (:mod:`fairseq_normplug.numeric_flags`), whatever made ``args``
    (fairseq-train checks as it parses; a checkpoint's or a hand-made Namespace is checked here)."""
    from fairseq_normplug.models.normplug_config import flag_actions  # it imports this module

    check_number_flags(args, flag_actions(add_normplug_args).values())


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise NormplugError(message)


def fixnorm_ties_output_layer(args) -> bool:
    """Whether ``--fixnorm`` must tie the output layer: it is not tied yet (the caller writes
    ``share_decoder_input_output_embed``). FixNorm is defined on the tied output layer (Tears
    eq. 6), so ``--fixnorm`` implies ``--share-decoder-input-output-embed``. fairseq has no flag
    that unties the output layer (the sharing flags are store_true), so there is no explicit
    request to refuse."""
    if getattr(args, "share_decoder_input_output_embed", False) or getattr(args, "share_all_embeddings", False):
        return False
    logger.info("--fixnorm: tying the output layer to the target embeddings "
                "(--share-decoder-input-output-embed)")
    return True


def recorded_extensions(args, modules) -> dict:
    """The value of ``args.normplug_modules`` (saved with every checkpoint), as fields to write:
    where the extensions it names and the ones defining ``modules`` (the chosen norm type and
    placement) came from, as absolute paths or module names; with built-ins only none (it stays
    as it was, None)."""
    recorded = [LOADED.get(name, name) for name in load_extensions(args.normplug_modules)]
    recorded += [source for source in needed_sources(modules) if source not in recorded]
    return {"normplug_modules": ",".join(recorded)} if recorded else {}


def resolve_normplug_args(args) -> NormplugSettings:
    """Validate the plugin flags on ``args`` and return the resolved settings. ``args`` is
    completed in place, by :mod:`~fairseq_normplug.models.args_writer` only: defaults, the
    resolved names (--prenorm -> fairseq's normalize_before flags, shorthands -> norm_type),
    each written as soon as it is resolved, before the next step reads ``args``.

    Raises :class:`NormplugError` with a one-line message naming the bad value and choices.
    """
    fill_defaults(args, DEFAULTS)
    load_extensions(args.normplug_modules)  # the checkpoint's or the command line's own norms/placements
    check_numeric_flags(args)  # finite and in range, before any combination is judged
    per_layer_types = named_norm_types(args)  # --norm-types-per-layer's form: one line if malformed
    fill_defaults(args, norm_flag_defaults())
    norm = chosen_norm_type(args)  # --norm-type or its shorthands
    write_resolved(args, {"norm_type": norm.name})
    check_norm_type_args(args, norm, also_used=per_layer_types)  # other types' flags, the type's own refusals
    norm_type = norm.name
    layer_plan = resolve_placement_args(args)  # --norm-placement, --prenorm/--postnorm, modifiers
    write_resolved(args, recorded_extensions(args, [norm.source, *norm_type_sources(args), *layer_plan.sources]))
    prenorm = missing_capability(layer_plan.placement, PRENORM_LIKE) is None
    prenorm_requirement = getattr(norm.module, "prenorm_requirement", None)  # the norm type's flags
    needs_prenorm = prenorm_requirement(args) if prenorm_requirement else None
    if needs_prenorm and not prenorm:
        placement = layer_plan.placement
        raise NormplugError(f"{needs_prenorm}, got {placement.describe()}: {lacks(placement, PRENORM_LIKE)}")

    weight_init_given = args.weight_init not in (None, "fairseq") or args.smallinit
    weight_init = args.weight_init or "fairseq"
    _require(weight_init in WEIGHT_INITS,
             f"unknown --weight-init {weight_init!r}; choose from {', '.join(WEIGHT_INITS)}")
    if args.smallinit:
        _require(args.weight_init in (None, "smallinit"),
                 f"--smallinit contradicts --weight-init {args.weight_init}; "
                 f"choose one of {', '.join(WEIGHT_INITS)}")
        weight_init = "smallinit"
    write_resolved(args, {"weight_init": weight_init})

    if args.fixnorm:
        if fixnorm_ties_output_layer(args):
            write_resolved(args, {"share_decoder_input_output_embed": True})
        _require(not getattr(args, "adaptive_softmax_cutoff", None),
                 "--fixnorm cannot be combined with --adaptive-softmax-cutoff "
                 f"(got {getattr(args, 'adaptive_softmax_cutoff', None)})")

    fill_defaults(args, BEYOND_DEFAULTS)
    beyond = resolve_beyond_args(args, norm_type, layer_plan.placement, weight_init_given)
    write_resolved(args, beyond.resolved_fields())
    check_norm_types_per_layer(args, layer_plan, beyond.residual_scale, weight_init)
    fill_defaults(args, OUTPUT_LAYER_DEFAULTS)
    output = resolve_output_layer_args(args)

    return NormplugSettings(prenorm=prenorm, norm=norm, fixnorm=args.fixnorm,
                            weight_init=weight_init,
                            norm_stats_interval=args.norm_stats_interval, beyond=beyond, output=output,
                            layer_plan=layer_plan)
