"""Parallel attention and FFN blocks (Wang & Komatsuzaki 2021, GPT-J; Black et al. 2022,
"GPT-NeoX-20B", section 2.1.1 "Parallel Attention + FF Layers"; Chowdhery et al. 2022, PaLM,
section 2 "Parallel Layers"): every sublayer of a layer reads the same layer input, each through
its own norm, and their outputs are added to the residual stream at once,

    x <- x + Dropout(Attn(LN_attn(x))) + Dropout(FFN(LN_ffn(x)))          (encoder)
    x <- x + Dropout(Attn(LN_attn(x))) + Dropout(Cross(LN_cross(x))) + Dropout(FFN(LN_ffn(x)))

with GPT-NeoX's two norms per block (``use_parallel_residual``; PaLM shares one) and PreNorm's
final norm after each stack. The decoder's cross-attention is this example's choice: the
decoder-only originals have none, so it becomes one more parallel branch.

Written only against the plugin's public interface (``register_placement``, ``Placement``):
fairseq's own norms of each sublayer (``layer.norm(kind)``) take the chosen ``--norm-type``.
"""
from fairseq_normplug import Placement, register_placement


@register_placement("parallel")
class ParallelLayers(Placement):
    """x + sum over the sublayers F of Dropout(F(LN_F(x))), plus a final norm per stack."""

    label = "parallel"
    final_norm = True  # each stack ends with a norm, as in GPT-J / GPT-NeoX

    def __init__(self, args):
        super().__init__(args)  # refuses --no-decoder-final-norm: the formula has a final norm
        self.refuse_tfixup(args)
        if (getattr(args, "residual_scale", None) or "none") != "none":
            self.refuse(f"--residual-scale {args.residual_scale} cannot be combined with --norm-placement parallel: "
                        f"no paper defines a residual scaling of parallel sublayers")

    def sublayers(self, layer, x, sublayers):
        branches = [layer.dropout_module(sublayer(layer.norm(kind)(x))) for kind, sublayer in sublayers]
        return x + sum(branches)
