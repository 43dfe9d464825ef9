"""Mix-LN (Li, Yin, Liu et al. 2024, "Mix-LN: Unleashing the Power of Deeper Layers by
Combining Pre-LN and Post-LN", section 3): the first floor(rho * L) layers of each stack are
PostNorm layers, the remaining ones PreNorm layers (rho = ``--mix-ln-ratio``, 0.25 in the
paper; L the stack's number of layers, so encoder and decoder split separately):

    layer l < floor(rho L):  x <- LN(x + F(x))       layer l >= floor(rho L):  x <- x + F(LN(x))

and, as in the paper, a final norm after the stack whenever it ends with PreNorm layers
(floor(rho L) < L). At the boundary nothing is added: the first PreNorm layer takes the
normalised output of the last PostNorm layer. rho = 0 is exactly PreNorm, rho = 1 exactly
PostNorm (no final norm). The layers stay fairseq's own: only their ``normalize_before``
switch is set, so modules and parameter names are PostNorm's plus, if present, the stacks'
``layer_norm`` (PreNorm's final norm).
"""
import math

from fairseq_normplug.modules.norm_registry import FINAL

from fairseq_normplug.models.placements.base import new_norm, set_final_norm, stacks


def post_layers(num_layers: int, ratio: float) -> int:
    """How many leading layers of a stack of ``num_layers`` are PostNorm: floor(ratio * L)."""
    return int(math.floor(ratio * num_layers + 1e-9))


def install(model, settings) -> None:
    for stack in stacks(model):
        k = post_layers(len(stack.layers), settings.mix_ln_ratio)
        for index, layer in enumerate(stack.layers):
            layer.normalize_before = index >= k
        set_final_norm(stack, new_norm(stack.layers[0].embed_dim, FINAL) if k < len(stack.layers) else None)
