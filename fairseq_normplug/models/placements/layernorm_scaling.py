"""LayerNorm Scaling (Sun, Song, Li, Yin, Zheng & Liu 2025, "The Curse of Depth in Large
Language Models", eq. 9): in a PreNorm model, the output of every norm inside layer l
(1-based, counted per stack) is multiplied by 1/sqrt(l),

    LN_l(x) = LN(x) / sqrt(l),

which keeps the output variance of deep PreNorm layers from growing with depth. It acts
through a forward hook on each norm of a layer (the norms stay the modules they are: names,
parameters and checkpoints unchanged), NormFormer's included; the stacks' final norms and the
embedding norms are not inside a layer and are not scaled. The paper defines it for Pre-LN
layers only: with any other placement some scaled norm sits on the residual stream itself
(PostNorm, B2T, ResiDual's PostNorm stream, Mix-LN's PostNorm layers), scales q and k
(HybridNorm) or the branch after its output norm (Sandwich), which no paper defines.
"""
import math

from fairseq_normplug.modules.norm_registry import FINAL

from fairseq_normplug.models.placements.base import PRENORM_LIKE, Modifier, register_modifier


class ScaleOutput:
    """A forward hook multiplying a module's output by ``scale`` (a class, so models pickle)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, module, inputs, output):
        return output * self.scale


@register_modifier("layernorm-scaling")
class LayerNormScaling(Modifier):
    requires = PRENORM_LIKE

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--layernorm-scaling", action="store_true",
            help="LayerNorm Scaling (The Curse of Depth, Sun et al. 2025): the output of every norm in "
                 "layer l (1-based, per stack) times 1/sqrt(l); PreNorm only (--prenorm)")

    def refusal(self, placement):
        return (f"--layernorm-scaling cannot be combined with {placement.describe()}: LayerNorm Scaling is "
                f"defined for PreNorm layers (Sun et al. 2025)")

    def finish_model(self, model):
        """Hook 1/sqrt(l) onto the output of every norm inside layer l (its final type)."""
        from fairseq_normplug.models.norm_placement import layer_norms

        for stack in (model.encoder, model.decoder):
            for index, layer in enumerate(stack.layers):
                for owner, attr, role, _ in layer_norms(layer):
                    if role != FINAL:
                        getattr(owner, attr).register_forward_hook(ScaleOutput(1.0 / math.sqrt(index + 1)))
