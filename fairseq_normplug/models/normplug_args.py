"""Command-line flags of ``transformer_normplug`` and their resolution into a validated
:class:`NormplugSettings`. Flag names avoid the ``encoder_``/``decoder_``/``quant_noise_``
prefixes, which fairseq's TransformerConfig would reroute into sub-configs."""
import argparse
import importlib.util
import logging
from dataclasses import dataclass

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.beyond_args import BeyondSettings, add_beyond_args, resolve_beyond_args
from fairseq_normplug.models.placement_args import add_placement_args, resolve_placement_args
from fairseq_normplug.models.placements.layers import LayerPlan
from fairseq_normplug.models.output_layer_args import (
    OutputLayerSettings,
    add_output_layer_args,
    resolve_output_layer_args,
)
from fairseq_normplug.modules.derf import DERF_DEFAULT_ALPHA
from fairseq_normplug.modules.norm_registry import AUTO, DYT_SQUASH_CHOICES, NORM_TYPES, NormSpec
from fairseq_normplug.modules.norm_registry import zero_centered_gamma_error
from fairseq_normplug.modules.weight_init import WEIGHT_INITS

NORM_SHORTHANDS = ("scalenorm", "rmsnorm", "dyt")  # --scalenorm = --norm-type scalenorm, ...
DEFAULTS = {
    "prenorm": False,
    "postnorm": False,
    "norm_type": None,
    "scalenorm": False,
    "rmsnorm": False,
    "dyt": False,
    "norm_eps": 1e-5,
    "zero_centered_gamma": False,
    "scalenorm_fixed_g": False,
    "dyt_alpha_init": None,
    "dyt_attn_alpha_init": None,
    "dyt_squash": None,
    "dyt_freeze_alpha": False,
    "dyt_no_alpha": False,
    "derf_alpha_init": None,
    "dyisru_beta_init": None,
    "fixnorm": False,
    "weight_init": None,
    "smallinit": False,
    "norm_stats_interval": 0,
}
DYT_DEFAULT_ALPHA = 0.5
logger = logging.getLogger(__name__)

#: each element-wise norm's own flags (they need that --norm-type)
NORM_TYPE_FLAGS = {
    "dyt": ("dyt_alpha_init", "dyt_attn_alpha_init", "dyt_squash", "dyt_freeze_alpha", "dyt_no_alpha"),
    "derf": ("derf_alpha_init",),
    "dyisru": ("dyisru_beta_init",),
}
SCALE_INIT_FLAGS = ("dyt_alpha_init", "dyt_attn_alpha_init", "derf_alpha_init", "dyisru_beta_init")


def scale_init_value(text: str):
    """argparse type of the scale-init flags: a number or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or '{AUTO}', got {text!r}") from None


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
    add("--norm-type", choices=NORM_TYPES,
        help="the norm used everywhere (sublayers and final norms); default layernorm; "
             "derf = gamma*erf(alpha*x+s)+beta, dyisru = gamma*sqrt(d)*x/sqrt(beta+x^2), "
             "identity = no normalization (output = input, no parameters); see docs/norms.md")
    add("--scalenorm", action="store_true", help="shorthand for --norm-type scalenorm: g*x/||x||")
    add("--rmsnorm", action="store_true", help="shorthand for --norm-type rmsnorm")
    add("--dyt", action="store_true", help="shorthand for --norm-type dyt: gamma*tanh(alpha*x)+beta")
    add("--norm-eps", type=float, metavar="EPS",
        help="ScaleNorm/RMSNorm epsilon (default 1e-5)")
    add("--zero-centered-gamma", action="store_true",
        help="store each norm's per-channel gain as gamma, init 0, applied as 1+gamma "
             "(TransformerEngine zero_centered_gamma, Megatron --apply-layernorm-1p): weight decay "
             "pulls the gain to 1; layernorm, rmsnorm, dyt, derf, dyisru")
    add("--scalenorm-fixed-g", action="store_true",
        help="freeze every ScaleNorm g at sqrt(d) except the norm feeding the output layer "
             "(paper Table 7, 'fixed g')")
    add("--dyt-alpha-init", type=scale_init_value, metavar="A|auto",
        help=f"DyT alpha initial value (default {DYT_DEFAULT_ALPHA}); auto: 1/std of each norm's "
             "input on the first training batch (all ranks), logged")
    add("--dyt-attn-alpha-init", type=scale_init_value, metavar="A|auto",
        help="DyT alpha initial value (or auto) for the norms of attention blocks, overriding "
             "--dyt-alpha-init there (default: --dyt-alpha-init)")
    add("--dyt-squash", choices=DYT_SQUASH_CHOICES,
        help="DyT squashing function (default tanh; DyT paper's ablation: hardtanh, sigmoid)")
    add("--dyt-freeze-alpha", action="store_true",
        help="keep DyT alpha fixed at its initial value (--dyt-alpha-init, or the auto value); "
             "the DyT paper's 'without alpha' ablation is alpha fixed at 1: --dyt-no-alpha")
    add("--dyt-no-alpha", action="store_true",
        help="the DyT paper's 'without alpha' ablation (section 6): squash(x), i.e. alpha fixed "
             "at 1 (= --dyt-freeze-alpha --dyt-alpha-init 1)")
    add("--derf-alpha-init", type=scale_init_value, metavar="A|auto",
        help=f"Derf alpha initial value (default {DERF_DEFAULT_ALPHA}, the Derf authors' code); "
             "auto: 1/std of each norm's input on the first training batch; the shift s starts at 0")
    add("--dyisru-beta-init", type=scale_init_value, metavar="B|auto",
        help="DyISRU beta initial value (default d-1: RMSNorm's value for unit-variance input); "
             "auto: (d-1)*mean(x^2) of each norm's input on the first training batch")
    add("--fixnorm", action="store_true",
        help="FixNorm: l2-normalised word embeddings, U(-0.01,0.01) init, tied output layer "
             "(implies --share-decoder-input-output-embed unless --share-all-embeddings)")
    add("--weight-init", choices=WEIGHT_INITS,
        help="attention/FFN init: fairseq's own (default), xavier (the paper's Xavier-normal "
             "baseline) or smallinit")
    add("--smallinit", action="store_true",
        help="shorthand for --weight-init smallinit: attention weights ~ N(0, sqrt(2/(5d)))")
    add("--norm-stats-interval", type=int, metavar="N",
        help="every N updates, log each norm's scale (ScaleNorm g, DyT alpha, mean gain) and "
             "its input std into the training log (0 = off, the default)")
    add_output_layer_args(add)
    add_beyond_args(add)
    add_placement_args(group)


@dataclass(frozen=True)
class NormplugSettings:
    prenorm: bool
    norm: NormSpec
    fixnorm: bool
    weight_init: str
    norm_stats_interval: int
    beyond: BeyondSettings
    output: OutputLayerSettings
    layer_plan: LayerPlan  # --norm-placement and the modifiers switched on


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fill_normplug_defaults(args) -> None:
    for name, value in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _resolve_norm_type(args) -> str:
    chosen = []
    if args.norm_type is not None:
        if args.norm_type not in NORM_TYPES:
            raise NormplugError(
                f"unknown --norm-type {args.norm_type!r}; choose from {', '.join(NORM_TYPES)}")
        chosen.append(("--norm-type " + args.norm_type, args.norm_type))
    chosen += [(_flag(norm), norm) for norm in NORM_SHORTHANDS if getattr(args, norm)]
    if len({norm for _, norm in chosen}) > 1:
        raise NormplugError(
            f"two norm types at once: {' and '.join(f for f, _ in chosen)}; "
            f"choose one of {', '.join(NORM_TYPES)}")
    return chosen[0][1] if chosen else "layernorm"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise NormplugError(message)


def _check_auto_precision(args) -> None:
    """``auto`` sets values during the first forward; fairseq's --fp16/--bf16 optimizer has
    copied its fp32 master weights before that and would overwrite them after the first step."""
    autos = [name for name in SCALE_INIT_FLAGS if getattr(args, name) == AUTO]
    low = [flag for flag in ("fp16", "bf16") if getattr(args, flag, False)]
    exempt = any(getattr(args, flag, False) for flag in
                 ("memory_efficient_fp16", "memory_efficient_bf16", "amp"))
    _require(not (autos and low and not exempt),
             f"{_flag(autos[0]) if autos else ''} auto cannot be combined with --{low[0] if low else ''} "
             f"(its fp32 master weights are copied before the first batch); use --amp or "
             f"--memory-efficient-{low[0] if low else ''}")


def bf16_without_tpu(args) -> None:
    """Let ``--bf16`` mean bfloat16 on a GPU or CPU. fairseq's argument parser turns every
    ``--bf16`` into ``--tpu`` (a TPU-era shortcut), which then fails in ``torch_xla`` on any
    other machine; where ``torch_xla`` is not installed that can only be a mistake, so the
    TPU switch is taken back (on a TPU machine nothing changes)."""
    if (getattr(args, "bf16", False) and getattr(args, "tpu", False)
            and importlib.util.find_spec("torch_xla") is None):
        logger.info("--bf16 without torch_xla installed: bfloat16 on the GPU or CPU, not a TPU")
        args.tpu = False


def _tie_output_layer_for_fixnorm(args) -> None:
    """FixNorm is defined on the tied output layer (Tears eq. 6), so ``--fixnorm`` implies
    ``--share-decoder-input-output-embed``. fairseq has no flag that unties the output layer
    (the sharing flags are store_true), so there is no explicit request to refuse."""
    if getattr(args, "share_decoder_input_output_embed", False) or getattr(args, "share_all_embeddings", False):
        return
    args.share_decoder_input_output_embed = True
    logger.info("--fixnorm: tying the output layer to the target embeddings "
                "(--share-decoder-input-output-embed)")


def resolve_normplug_args(args) -> NormplugSettings:
    """Validate the plugin flags on ``args`` (in place: defaults, --prenorm -> fairseq's
    normalize_before flags, shorthands -> norm_type) and return the resolved settings.

    Raises :class:`NormplugError` with a one-line message naming the bad value and choices.
    """
    fill_normplug_defaults(args)
    norm_type = _resolve_norm_type(args)
    args.norm_type = norm_type
    layer_plan = resolve_placement_args(args)  # --norm-placement, --prenorm/--postnorm, modifiers
    prenorm = layer_plan.placement.name == "pre"

    _require(args.norm_eps > 0, f"--norm-eps must be > 0, got {args.norm_eps}")
    _require(not args.zero_centered_gamma or not zero_centered_gamma_error(norm_type),
             zero_centered_gamma_error(norm_type))
    _require(not args.scalenorm_fixed_g or norm_type == "scalenorm",
             f"--scalenorm-fixed-g needs --norm-type scalenorm, got --norm-type {norm_type}")
    for owner, names in NORM_TYPE_FLAGS.items():
        given = [n for n in names if getattr(args, n) not in (None, False)]
        _require(not given or norm_type == owner,
                 f"{_flag(given[0]) if given else ''} needs --norm-type {owner}"
                 f"{' (or --dyt)' if owner == 'dyt' else ''}, got --norm-type {norm_type}")
    for name in SCALE_INIT_FLAGS:
        value = getattr(args, name)
        _require(value in (None, AUTO) or value > 0, f"{_flag(name)} must be > 0, got {value} (or pass auto)")
    _check_auto_precision(args)
    alpha = DYT_DEFAULT_ALPHA if args.dyt_alpha_init is None else args.dyt_alpha_init
    if args.dyt_no_alpha:
        clash = [n for n in ("dyt_alpha_init", "dyt_attn_alpha_init") if getattr(args, n) not in (None, 1.0)]
        _require(not clash, f"--dyt-no-alpha fixes alpha at 1; it contradicts "
                            f"{_flag(clash[0]) if clash else ''} {getattr(args, clash[0]) if clash else ''}")
        alpha = 1.0
    squash = args.dyt_squash or "tanh"
    _require(squash in DYT_SQUASH_CHOICES,
             f"unknown --dyt-squash {squash!r}; choose from {', '.join(DYT_SQUASH_CHOICES)}")

    weight_init_given = args.weight_init not in (None, "fairseq") or args.smallinit
    weight_init = args.weight_init or "fairseq"
    _require(weight_init in WEIGHT_INITS,
             f"unknown --weight-init {weight_init!r}; choose from {', '.join(WEIGHT_INITS)}")
    if args.smallinit:
        _require(args.weight_init in (None, "smallinit"),
                 f"--smallinit contradicts --weight-init {args.weight_init}; "
                 f"choose one of {', '.join(WEIGHT_INITS)}")
        weight_init = "smallinit"
    args.weight_init = weight_init

    if args.fixnorm:
        _tie_output_layer_for_fixnorm(args)
        _require(not getattr(args, "adaptive_softmax_cutoff", None),
                 "--fixnorm cannot be combined with --adaptive-softmax-cutoff "
                 f"(got {getattr(args, 'adaptive_softmax_cutoff', None)})")
    _require(args.norm_stats_interval >= 0,
             f"--norm-stats-interval must be >= 0, got {args.norm_stats_interval}")

    beyond = resolve_beyond_args(args, norm_type, layer_plan.placement, weight_init_given)
    output = resolve_output_layer_args(args)

    spec = NormSpec(
        norm_type=norm_type,
        eps=args.norm_eps,
        scalenorm_fixed_g=args.scalenorm_fixed_g,
        dyt_alpha_init=alpha,
        dyt_attn_alpha_init=args.dyt_attn_alpha_init,
        dyt_squash=squash,
        dyt_freeze_alpha=args.dyt_freeze_alpha or args.dyt_no_alpha,
        derf_alpha_init=DERF_DEFAULT_ALPHA if args.derf_alpha_init is None else args.derf_alpha_init,
        dyisru_beta_init=args.dyisru_beta_init,
        zero_centered_gamma=args.zero_centered_gamma,
    )
    return NormplugSettings(prenorm=prenorm, norm=spec, fixnorm=args.fixnorm,
                            weight_init=weight_init,
                            norm_stats_interval=args.norm_stats_interval, beyond=beyond, output=output,
                            layer_plan=layer_plan)
