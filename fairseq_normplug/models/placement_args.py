"""Flags of the layer design: ``--norm-placement`` (its choices are the registered placements,
read when the flags are added, so extensions loaded before parsing appear) with the shorthands
``--prenorm`` and ``--postnorm``, and every registered placement's and modifier's own flags
(``--mix-ln-ratio``, ``--normformer``, ``--layernorm-scaling``, ...), resolved into a
:class:`~fairseq_normplug.models.placements.layers.LayerPlan` at argument-resolution time.

Here: which placement the flags choose, and a design's own flag given without the design.
Every other refusal belongs to the design concerned (``models/placements/``)."""

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.args_writer import fill_defaults, write_design_fields, write_resolved
from fairseq_normplug.models.placements import MODIFIERS, PLACEMENTS, Placement, registered_designs
from fairseq_normplug.models.placements.base import flag
from fairseq_normplug.models.placements.layers import LayerPlan

NORMALIZE_BEFORE = ("encoder_normalize_before", "decoder_normalize_before")


def add_placement_args(group) -> None:
    """Add the flags to the argument group ``group``."""
    group.add_argument(
        "--norm-placement", choices=tuple(PLACEMENTS),
        help="where the norms of a layer sit and how its residuals add up (F = sublayer): post = "
             "LN(x+F(x)) (default, fairseq's PostNorm), pre = x+F(LN(x)) plus a final norm per stack, "
             "sandwich (Peri-LN), resi-dual (ResiDual), b2t (B2T connection), mix (Mix-LN), hybrid "
             "(HybridNorm), siamese (SiameseNorm), output-norm = x+LN(F(x)) (OLMo 2), hyper-connections "
             "(Hyper-Connections / mHC), and any registered by an extension; formulas and papers: "
             "docs/placements.md")
    for design in registered_designs():
        design.add_args(group)


def _refuse(message: str) -> None:
    raise NormplugError(message)


def placement_defaults() -> dict:
    """{dest: default} of every design's flags (filled in where ``args`` lacks them: old
    checkpoints, other entry points)."""
    defaults = {"norm_placement": None}
    for design in registered_designs():
        defaults.update(design.defaults)
    defaults.update({name.replace("-", "_"): False for name in MODIFIERS})
    return defaults


def _chosen_placement(args):
    """``(name, fields)``: the placement that ``--norm-placement`` / ``--prenorm`` / ``--postnorm``
    / fairseq's normalize-before flags choose, and the fields to write into ``args`` for it
    (``norm_placement``; for ``pre`` first fairseq's two normalize-before flags). ``args`` is
    read only."""
    given = args.norm_placement
    if given is not None and given not in PLACEMENTS:
        _refuse(f"unknown --norm-placement {given!r}; choose from {', '.join(PLACEMENTS)}")
    if args.prenorm and args.postnorm:
        _refuse("--prenorm contradicts --postnorm; choose one residual placement")
    shorthand = "pre" if args.prenorm else "post" if args.postnorm else None
    if given is not None and shorthand is not None and given != shorthand:
        _refuse(f"--{shorthand}norm contradicts --norm-placement {given}; --{shorthand}norm is "
                f"--norm-placement {shorthand}: drop one of them")
    normalize_before = [name for name in NORMALIZE_BEFORE if getattr(args, name, False)]
    if args.postnorm and normalize_before:
        _refuse(f"--postnorm contradicts {' '.join(map(flag, normalize_before))}; "
                f"drop one of them (PostNorm normalises after each residual addition)")
    placement = given or shorthand
    if placement not in (None, "pre") and normalize_before:
        _refuse(f"{' '.join(map(flag, normalize_before))} (fairseq's PreNorm) contradicts "
                f"--norm-placement {placement}; drop it (PreNorm is --norm-placement pre)")
    if placement is None and len(normalize_before) == 1:
        # fairseq's own mixed model (one stack PreNorm), reported as post; args keep no
        # placement, so resolving them again (build_model, checkpoint load) is not refused
        return "post", {}
    placement = placement or ("pre" if normalize_before else "post")
    fields = dict.fromkeys(NORMALIZE_BEFORE, True) if placement == "pre" else {}
    return placement, {**fields, "norm_placement": placement}


def resolve_placement_args(args) -> LayerPlan:
    """The placement and modifiers the flags choose, each validating what goes with it; what
    they resolve is written into ``args`` by models/args_writer.py as each is chosen."""
    fill_defaults(args, placement_defaults())
    name, fields = _chosen_placement(args)
    write_resolved(args, fields)
    placement = PLACEMENTS[name](args)
    write_design_fields(args, placement)
    for name, cls in PLACEMENTS.items():
        given = [dest for dest in cls.defaults if getattr(args, dest) is not None]
        if given and type(placement) is not cls:
            _refuse(f"{flag(given[0])} needs --norm-placement {name}, got {placement.describe()}")
    modifiers = []
    for name, cls in MODIFIERS.items():
        if cls.enabled(args):
            modifiers.append(cls(args, placement))
            write_design_fields(args, modifiers[-1])
        else:
            given = [dest for dest in cls.defaults if getattr(args, dest) not in (None, False)]
            if given:
                _refuse(f"{flag(given[0])} needs --{name}")
    return LayerPlan(placement, modifiers)
