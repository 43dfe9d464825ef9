"""LayerNorm Scaling (Sun, Song, Li, Yin, Zheng & Liu 2025, "The Curse of Depth in Large
Language Models", eq. 9): the output of every norm inside layer l (1-based, counted per
stack) is multiplied by 1/sqrt(l),

    LN_l(x) = LN(x) / sqrt(l),

which keeps the output variance of deep PreNorm layers from growing with depth. It acts
through a forward hook on each norm of a layer (the norms stay the modules they are: names,
parameters and checkpoints unchanged); the stacks' final norms (``enc.final``, ``dec.final``,
ResiDual's ``resi_final``) and the embedding norms are not inside a layer and are not scaled.
It composes with every placement and norm type (``--layernorm-scaling``).
"""
import math
import re
from typing import Dict

#: names (``norm_placement.named_norms``) of norms that sit outside the layers
OUTSIDE_LAYERS = (".final", ".embed", ".resi_final")


class ScaleOutput:
    """A forward hook multiplying a module's output by ``scale`` (a class, so models pickle)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, module, inputs, output):
        return output * self.scale


def layer_scales(named_norms: Dict[str, object]) -> Dict[str, float]:
    """{norm name: 1/sqrt(l)} for the norms inside layers (``enc0.attn`` is in layer l = 1)."""
    scales = {}
    for name in named_norms:
        found = re.match(r"^(enc|dec)(\d+)\.", name)
        if found and not name.endswith(OUTSIDE_LAYERS):
            scales[name] = 1.0 / math.sqrt(int(found.group(2)) + 1)
    return scales


def install_layernorm_scaling(model, enabled: bool) -> None:
    """Hook 1/sqrt(l) onto the output of every norm inside a layer of ``model``."""
    if not enabled:
        return
    from fairseq_normplug.models.norm_placement import named_norms

    norms = named_norms(model)
    for name, scale in layer_scales(norms).items():
        norms[name].register_forward_hook(ScaleOutput(scale))
