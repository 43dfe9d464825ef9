"""Sandwich / Peri-LN (Ding et al. 2021, "CogView", section 2.4 "Sandwich-LN"; Kim et al.
2025, "Peri-LN: Revisiting Layer Normalization in the Transformer Architecture", eq. 3):
every sublayer F (self-attention, cross-attention, FFN) is wrapped by a norm on its input and
one on its output,

    x <- x + Dropout(LN_out(F(LN_in(x)))),

plus PreNorm's final norm after each stack (both papers keep it). LN_in are fairseq's own
``self_attn_layer_norm`` / ``encoder_attn_layer_norm`` / ``final_layer_norm``; LN_out are the
new ``self_attn_out_layer_norm`` / ``encoder_attn_out_layer_norm`` / ``final_out_layer_norm``.
Dropout acts on the normalised branch output, before the residual addition.
"""
from fairseq_normplug.modules.norm_registry import FINAL

from fairseq_normplug.models.placements.base import (new_norm, set_final_norm, stacks,
                                                    swap_layer_class)

OUT_NORMS = {"attn": "self_attn_out_layer_norm", "cross": "encoder_attn_out_layer_norm",
             "ffn": "final_out_layer_norm"}


class SandwichLayer:
    def sublayers(self, x, sublayers):
        for kind, sublayer in sublayers:
            branch = getattr(self, OUT_NORMS[kind])(sublayer(self.norm(kind)(x)))
            x = self.residual_connection(self.dropout_module(branch), x)
        return x



def install(model, settings) -> None:
    from fairseq_normplug.models.norm_placement import LAYER_NORM_SLOTS

    roles = {attr: role for attr, role, _ in LAYER_NORM_SLOTS}
    for stack in stacks(model):
        for layer in stack.layers:
            for kind, attr in OUT_NORMS.items():
                if kind != "cross" or getattr(layer, "encoder_attn", None) is not None:
                    setattr(layer, attr, new_norm(layer.embed_dim, roles[attr]))
            swap_layer_class(layer, SandwichLayer)
        set_final_norm(stack, new_norm(stack.layers[0].embed_dim, FINAL))
