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
from fairseq_normplug.numeric_flags import number_flag

from fairseq_normplug.models.placements.base import Placement, new_norm, register_placement, set_final_norm

MIX_LN_DEFAULT_RATIO = 0.25  # Li et al. 2024


def post_layers(num_layers: int, ratio: float) -> int:
    """How many leading layers of a stack of ``num_layers`` are PostNorm: floor(ratio * L)."""
    return int(math.floor(ratio * num_layers + 1e-9))


@register_placement("mix")
class MixLN(Placement):
    defaults = {"mix_ln_ratio": None}
    stock_forward = True
    keeps_final_norm = True

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--mix-ln-ratio", metavar="R", **number_flag(at_least=0, at_most=1, note="the share of PostNorm layers"),
            help=f"--norm-placement mix: the share R in [0, 1] of each stack's layers (the first "
                 f"floor(R*L)) that are PostNorm (default {MIX_LN_DEFAULT_RATIO})")

    def __init__(self, args):
        super().__init__(args)
        ratio = MIX_LN_DEFAULT_RATIO if args.mix_ln_ratio is None else args.mix_ln_ratio
        self.ratio = ratio

    def resolved_fields(self):
        return {"mix_ln_ratio": self.ratio}

    def build_layer(self, layer, index, num_layers):
        layer.normalize_before = index >= post_layers(num_layers, self.ratio)

    def build_stack(self, stack):
        if post_layers(len(stack.layers), self.ratio) < len(stack.layers):
            set_final_norm(stack, new_norm(stack.layers[0].embed_dim, FINAL))
