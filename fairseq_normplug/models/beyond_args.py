"""Flags of the normalization designs that followed the two papers: QKNorm,
residual scaling (ReZero, LayerScale, DeepNorm, Admin), T-Fixup (a ``--weight-init`` choice) and the
learnable embedding scale; see docs/beyond.md. Also ``--norm-weight-decay`` (the weight
decay of norm parameters and scalar gains, fairseq_normplug/optim/norm_weight_decay.py).
Validated with the other plugin flags at argument-parse time; every combination a method's
paper does not define is refused here."""
from dataclasses import dataclass
from typing import Optional

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.embed_scale import EMBED_SCALES
from fairseq_normplug.modules.residual_scale import RESIDUAL_SCALES
from fairseq_normplug.models.placements.base import lacks
from fairseq_normplug.numeric_flags import number_flag
from fairseq_normplug.optim.norm_weight_decay import check_norm_weight_decay_args

#: the residual scalings defined for PostNorm only (x <- LN(alpha x + F(x)) in every layer), and where
POSTNORM_ONLY = {"deepnorm": "DeepNet, Wang et al. 2022", "admin": "Admin, Liu et al. 2020"}
BEYOND_DEFAULTS = {
    "qknorm": False,
    "qknorm_g0": None,  # computed from the training data in build_model when not given
    "residual_scale": None,
    "embed_scale": None,
    "norm_weight_decay": None,  # None: --weight-decay for every parameter (stock, one param group)
}


def add_beyond_args(add) -> None:
    """Add the flags through ``add`` (an argument group's add_argument)."""
    add("--qknorm", action="store_true",
        help="QKNorm (Henry et al. 2020): q and k l2-normalised per head, a learnable scalar g per "
             "attention layer replaces 1/sqrt(d_k)")
    add("--qknorm-g0", metavar="G", **number_flag(above=0),
        help="QKNorm's initial g (default: log2(L^2-L), L = 97.5th percentile of the training "
             "target lengths, computed from the data dir and stored in the checkpoint)")
    add("--residual-scale", choices=RESIDUAL_SCALES,
        help="residual branch scaling: none (default), rezero (x + a*F(x), a=0 at init), layerscale "
             "(x + diag(l)*F(x), CaiT init), deepnorm (PostNorm(alpha*x + F(x)) with DeepNet's "
             "beta init), admin (PostNorm(omega*x + F(x)), omega profiled on the first batch)")
    add("--embed-scale", choices=EMBED_SCALES,
        help="embedding scale: fixed (default, fairseq's sqrt(d), or 1 with --no-scale-embedding) "
             "or learnable (a learnable scalar starting there; DyT's LLM recipe)")
    add("--norm-weight-decay", metavar="WD", **number_flag(at_least=0),
        help="weight decay of the norm parameters (every norm's gains/biases/g/alpha) and the "
             "scalar or per-channel gains (--residual-scale, QKNorm's g, --embed-scale learnable), "
             "in their own optimizer param group; default: --weight-decay (stock: one group); "
             "0 excludes them from weight decay")


@dataclass(frozen=True)
class BeyondSettings:
    qknorm: bool
    qknorm_g0: Optional[float]
    residual_scale: str
    embed_scale: str
    norm_weight_decay: Optional[float] = None  # None: not given, --weight-decay for everything

    def resolved_fields(self) -> dict:
        """The flags with their defaults resolved, to write into ``args``."""
        return {"residual_scale": self.residual_scale, "embed_scale": self.embed_scale}


def resolve_beyond_args(args, norm_type: str, placement, weight_init_given: bool) -> BeyondSettings:
    """Validate the flags (``norm_type``, ``placement`` (the chosen
    :class:`~fairseq_normplug.models.placements.Placement`) and ``weight_init`` already
    resolved; ``weight_init_given``: the user chose an init other than fairseq's;
    :data:`BEYOND_DEFAULTS` filled in). Reads ``args`` only: the resolved ``residual_scale`` and
    ``embed_scale`` are written by :mod:`~fairseq_normplug.models.args_writer`
    (:meth:`BeyondSettings.resolved_fields`)."""
    residual = args.residual_scale or "none"
    embed_scale = args.embed_scale or "fixed"

    def refuse(message):
        raise NormplugError(message)

    if residual not in RESIDUAL_SCALES:
        refuse(f"unknown --residual-scale {residual!r}; choose from {', '.join(RESIDUAL_SCALES)}")
    if embed_scale not in EMBED_SCALES:
        refuse(f"unknown --embed-scale {embed_scale!r}; choose from {', '.join(EMBED_SCALES)}")
    if args.qknorm_g0 is not None and not args.qknorm:
        refuse("--qknorm-g0 needs --qknorm")
    if args.qknorm:
        for name in ("encoder_xformers_att_config", "decoder_xformers_att_config"):
            if getattr(args, name, None):
                refuse(f"--qknorm cannot be combined with --{name.replace('_', '-')}: xFormers "
                       f"attention applies its own 1/sqrt(d_k) scaling; drop one of them")
        if getattr(args, "quant_noise_pq", 0):
            refuse(f"--qknorm cannot be combined with --quant-noise-pq {args.quant_noise_pq}: "
                   "QKNorm replaces the q/k projections that quant-noise hooks into")
    if residual in POSTNORM_ONLY and not placement.pure_postnorm:
        refuse(f"--residual-scale {residual} is defined for PostNorm only ({POSTNORM_ONLY[residual]}); "
               f"it cannot be combined with {placement.describe()}: {lacks(placement, {'pure_postnorm': True})}")
    if residual == "deepnorm":
        if norm_type == "identity":
            refuse("--residual-scale deepnorm needs a norm after each residual (alpha*x grows "
                   "unboundedly without it); choose a --norm-type other than identity")
        if weight_init_given:
            refuse(f"--residual-scale deepnorm brings its own init (DeepNet's beta-scaled Xavier); "
                   f"drop --weight-init {args.weight_init}")
    if residual == "admin":
        if norm_type == "identity":
            refuse("--residual-scale admin needs a norm after each residual (its omegas scale the "
                   "residual up); choose a --norm-type other than identity")
        low = [flag for flag in ("fp16", "bf16") if getattr(args, flag, False)]
        if low and not any(getattr(args, flag, False) for flag in
                           ("memory_efficient_fp16", "memory_efficient_bf16", "amp")):
            refuse(f"--residual-scale admin cannot be combined with --{low[0]} (its fp32 master weights "
                   f"are copied before the profiling pass sets omega); use --amp or "
                   f"--memory-efficient-{low[0]}")
    if args.weight_init == "tfixup":
        if norm_type != "identity":
            refuse(f"--weight-init tfixup is for models without norms (T-Fixup, Huang et al. 2020); "
                   f"add --norm-type identity, got --norm-type {norm_type}")
        if residual != "none":
            refuse(f"--weight-init tfixup cannot be combined with --residual-scale {residual}: "
                   f"T-Fixup's scaling already controls the residual branches")
        if getattr(args, "fixnorm", False):
            refuse("--weight-init tfixup cannot be combined with --fixnorm: T-Fixup sets the "
                   "embedding init and scale itself")
    norm_weight_decay = check_norm_weight_decay_args(args)
    return BeyondSettings(qknorm=args.qknorm, qknorm_g0=args.qknorm_g0,
                          residual_scale=residual, embed_scale=embed_scale,
                          norm_weight_decay=norm_weight_decay)
