"""Flags of the norm placement (``--norm-placement`` with its shorthands ``--prenorm`` and
``--postnorm``, ``--mix-ln-ratio``, ``--layernorm-scaling``, ``--normformer``) and their resolution into a
:class:`PlacementSettings`, at argument-resolution time. Every combination a placement's
paper does not define is refused here in one line."""
from dataclasses import dataclass

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements import PLACEMENT_NAMES

MIX_LN_DEFAULT_RATIO = 0.25  # Li et al. 2024
PLACEMENT_DEFAULTS = {"norm_placement": None, "mix_ln_ratio": None, "layernorm_scaling": False,
                      "normformer": False}
NORMALIZE_BEFORE = ("encoder_normalize_before", "decoder_normalize_before")
#: the residual scalings defined for PostNorm only, and where
POSTNORM_ONLY = {"deepnorm": "DeepNet, Wang et al. 2022", "admin": "Admin, Liu et al. 2020"}
#: placements whose layers have their own forward (fairseq's --checkpoint-activations wrapper
#: keeps the stock forward it captured at build time)
OWN_FORWARD = ("sandwich", "resi-dual", "b2t", "hybrid")
#: fairseq's own NormFormer switches (``transformer_lm`` flags; a namespace may still carry them)
FAIRSEQ_NORMFORMER = ("scale_attn", "scale_fc", "scale_heads", "scale_resids")


def add_placement_args(add) -> None:
    """Add the flags through ``add`` (an argument group's add_argument)."""
    add("--norm-placement", choices=PLACEMENT_NAMES,
        help="where the norms of a layer sit (F = sublayer): post = LN(x+F(x)) (default, fairseq's "
             "PostNorm), pre = x+F(LN(x)) plus a final norm per stack, sandwich (Peri-LN) = "
             "x+LN(F(LN(x))), resi-dual (ResiDual) = a PostNorm stream plus a stream of the raw "
             "F outputs, b2t (B2T connection) = PostNorm whose last norm also gets the layer input, "
             "mix (Mix-LN) = the first floor(R*L) layers PostNorm, the rest PreNorm, hybrid "
             "(HybridNorm) = QKV-normalised attention x+Attn(x), PostNorm FFN; see docs")
    add("--mix-ln-ratio", type=float, metavar="R",
        help=f"--norm-placement mix: the share R in [0, 1] of each stack's layers (the first "
             f"floor(R*L)) that are PostNorm (default {MIX_LN_DEFAULT_RATIO})")
    add("--layernorm-scaling", action="store_true",
        help="LayerNorm Scaling (The Curse of Depth, Sun et al. 2025): the output of every norm in "
             "layer l (1-based, per stack) times 1/sqrt(l); composes with every --norm-placement")
    add("--normformer", action="store_true",
        help="NormFormer (Shleifer et al. 2021) on PreNorm, encoder and decoder: a norm after "
             "self-attention, a learned scale per head applied before the output projection, and "
             "a norm after the FFN activation; needs --prenorm (--norm-placement pre)")


@dataclass(frozen=True)
class PlacementSettings:
    placement: str
    mix_ln_ratio: float
    layernorm_scaling: bool
    normformer: bool = False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _refuse(message: str) -> None:
    raise NormplugError(message)


def resolve_placement_args(args) -> PlacementSettings:
    """Resolve ``--norm-placement`` / ``--prenorm`` / ``--postnorm`` / fairseq's normalize-before
    flags into one placement (written back to ``args.norm_placement``; ``pre`` also sets
    fairseq's two normalize-before flags) and validate what goes with it."""
    for name, value in PLACEMENT_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    given = args.norm_placement
    if given is not None and given not in PLACEMENT_NAMES:
        _refuse(f"unknown --norm-placement {given!r}; choose from {', '.join(PLACEMENT_NAMES)}")
    if args.prenorm and args.postnorm:
        _refuse("--prenorm contradicts --postnorm; choose one residual placement")
    shorthand = "pre" if args.prenorm else "post" if args.postnorm else None
    if given is not None and shorthand is not None and given != shorthand:
        _refuse(f"--{shorthand}norm contradicts --norm-placement {given}; --{shorthand}norm is "
                f"--norm-placement {shorthand}: drop one of them")
    normalize_before = [flag for flag in NORMALIZE_BEFORE if getattr(args, flag, False)]
    if args.postnorm and normalize_before:
        _refuse(f"--postnorm contradicts {' '.join(map(_flag, normalize_before))}; "
                f"drop one of them (PostNorm normalises after each residual addition)")
    placement = given or shorthand
    if placement not in (None, "pre") and normalize_before:
        _refuse(f"{' '.join(map(_flag, normalize_before))} (fairseq's PreNorm) contradicts "
                f"--norm-placement {placement}; drop it (PreNorm is --norm-placement pre)")
    if placement is None and len(normalize_before) == 1:
        # fairseq's own mixed model (one stack PreNorm), reported as post; args keep no
        # placement, so resolving them again (build_model, checkpoint load) is not refused
        placement = "post"
    else:
        placement = placement or ("pre" if normalize_before else "post")
        if placement == "pre":
            args.encoder_normalize_before = args.decoder_normalize_before = True
        args.norm_placement = placement

    ratio = args.mix_ln_ratio
    if ratio is not None and placement != "mix":
        _refuse(f"--mix-ln-ratio needs --norm-placement mix, got --norm-placement {placement}")
    if placement == "mix":
        ratio = MIX_LN_DEFAULT_RATIO if ratio is None else ratio
        if not 0.0 <= ratio <= 1.0:
            _refuse(f"--mix-ln-ratio must be in [0, 1] (the share of PostNorm layers), got {ratio}")
        args.mix_ln_ratio = ratio
    _check_compositions(args, placement)
    if args.normformer:
        _check_normformer(args, placement, normalize_before)
    return PlacementSettings(placement=placement, mix_ln_ratio=ratio, layernorm_scaling=bool(args.layernorm_scaling),
                             normformer=bool(args.normformer))


def _check_compositions(args, placement: str) -> None:
    """Refuse what the placement's paper (or the other method's) does not define."""
    residual = getattr(args, "residual_scale", None) or "none"
    if residual in POSTNORM_ONLY and placement not in ("post", "pre"):  # pre: refused by beyond_args
        _refuse(f"--residual-scale {residual} is defined for PostNorm only ({POSTNORM_ONLY[residual]}); "
                f"it cannot be combined with --norm-placement {placement}")
    if placement == "resi-dual" and residual != "none":
        _refuse(f"--residual-scale {residual} cannot be combined with --norm-placement resi-dual: "
                f"ResiDual's two residual streams share each sublayer output unscaled")
    if getattr(args, "weight_init", None) == "tfixup" and placement in ("b2t", "resi-dual"):
        _refuse(f"--weight-init tfixup cannot be combined with --norm-placement {placement}: T-Fixup's "
                f"scaling is derived for single x + F(x) residuals")
    if placement in OWN_FORWARD and getattr(args, "checkpoint_activations", False):
        _refuse(f"--checkpoint-activations cannot be combined with --norm-placement {placement}: "
                f"fairseq's checkpoint wrapper keeps the stock layer forward")
    if placement == "hybrid":
        if getattr(args, "qknorm", False):
            _refuse("--qknorm cannot be combined with --norm-placement hybrid: HybridNorm already "
                    "normalises q and k (QKV-norm); drop one of them")
        if getattr(args, "quant_noise_pq", 0):
            _refuse(f"--quant-noise-pq {args.quant_noise_pq} cannot be combined with --norm-placement "
                    f"hybrid: the QKV norms replace the projections that quant-noise hooks into")
        for name in ("encoder_xformers_att_config", "decoder_xformers_att_config"):
            if getattr(args, name, None):
                _refuse(f"--{name.replace('_', '-')} cannot be combined with --norm-placement hybrid: "
                        f"xFormers attention reads the q/k/v weights and would skip the QKV norms")


def _check_normformer(args, placement: str, normalize_before) -> None:
    """``--normformer`` is defined on PreNorm layers (Shleifer et al. 2021), in both stacks."""
    if placement != "pre":
        got = (f"only {_flag(normalize_before[0])}" if len(normalize_before) == 1
               else f"--norm-placement {placement}")
        _refuse(f"--normformer needs the PreNorm placement (--prenorm / --norm-placement pre), got {got}")
    given = [name for name in FAIRSEQ_NORMFORMER if getattr(args, name, False)]
    if given:
        _refuse(f"--normformer cannot be combined with fairseq's {_flag(given[0])} (its LM NormFormer "
                f"switches: {', '.join(map(_flag, FAIRSEQ_NORMFORMER))}); drop it")
    if getattr(args, "checkpoint_activations", False):
        _refuse("--checkpoint-activations cannot be combined with --normformer: fairseq's checkpoint "
                "wrapper keeps the stock layer forward")
    for name in ("encoder_xformers_att_config", "decoder_xformers_att_config"):
        if getattr(args, name, None):
            _refuse(f"--{name.replace('_', '-')} cannot be combined with --normformer: the head scales need "
                    f"fairseq's own attention path (xFormers applies out_proj's weight itself)")
