"""Where the norms of a Transformer layer sit and how its residuals add up (``--norm-placement``),
and the modifiers on top of a placement (``--normformer``, ``--layernorm-scaling``, ``--gpas``,
``--gated-attention``, ``--value-residual``, ``--bhyt-block-statistics``, ...).

Each placement and modifier is one class in one file here, registered by name with
:func:`register_placement` / :func:`register_modifier` (``base.py`` documents the interface:
flags, refusals, norm slots, layer build, forward wiring, extra init). Everything else reads
the registry: the flags (``--norm-placement``'s choices), the norm slot tables
(``models/norm_placement.py``), the layer build hooks (``layers.py``), the results tables'
labels and the figures. A researcher's own placement, in a module outside the package, uses
the same two decorators (docs/placements.md).

Adding a built-in: one file here and its line below (the import registers it; the order of
the lines is the order of the choices).
"""
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.flag_lists import parse_flag_list
from fairseq_normplug.models.placements.base import (MODIFIERS, PLACEMENTS, SUBLAYER_NORMS, LayerDesign, Modifier,
                                                    Placement, layer_norm_slots, new_norm, register_modifier,
                                                    register_placement, registered_designs, set_final_norm,
                                                    slot_norm)
from fairseq_normplug.models.placements import post, pre, sandwich, resi_dual, b2t, mix, hybrid  # noqa: F401,E402
from fairseq_normplug.models.placements import siamese, output_norm, hyper_connections  # noqa: F401,E402
from fairseq_normplug.models.placements import normformer, layernorm_scaling, ngpt, gpas  # noqa: F401,E402
from fairseq_normplug.models.placements import gated_attention  # noqa: F401,E402
from fairseq_normplug.models.placements import value_residual  # noqa: F401,E402
from fairseq_normplug.models.placements import sigma_reparam  # noqa: F401,E402
from fairseq_normplug.models.placements import denseformer  # noqa: F401,E402
from fairseq_normplug.models.placements import keel  # noqa: F401,E402
from fairseq_normplug.models.placements import attention_residuals  # noqa: F401,E402
from fairseq_normplug.models.placements import bhyt_block  # noqa: F401,E402


def placement_label(name: str, modifiers=()) -> str:
    """A results table's label of ``--norm-placement name`` with the ``modifiers`` switched on
    (``prenorm``, ``prenorm+normformer``); a name that is not registered is its own label."""
    placement = PLACEMENTS.get(name)
    return "+".join([placement.label if placement else name, *modifiers])


def training_task(model_flags) -> "str | None":
    """The fairseq task the placement or modifiers of ``model_flags`` (a command line's model
    flags) must train under (their ``training_task``: nGPT's renormalising step), or None."""
    flags = parse_flag_list(model_flags)
    designs = [MODIFIERS[name[2:]] for name in flags if name[2:] in MODIFIERS]
    if flags.get("--norm-placement"):
        designs.append(PLACEMENTS[flags["--norm-placement"][0]])
    tasks = {design.training_task for design in designs if design.training_task}
    if len(tasks) > 1:
        raise NormplugError(f"{' '.join(model_flags)} combines designs that need different tasks: {sorted(tasks)}")
    return tasks.pop() if tasks else None


__all__ = ["PLACEMENTS", "MODIFIERS", "SUBLAYER_NORMS", "LayerDesign", "Placement", "Modifier", "register_placement",
           "register_modifier", "registered_designs", "layer_norm_slots", "new_norm", "slot_norm", "set_final_norm",
           "placement_label", "training_task"]
