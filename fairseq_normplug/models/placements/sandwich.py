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
from fairseq_normplug.modules.norm_registry import ATTENTION, FFN

from fairseq_normplug.models.placements.base import Placement, register_placement, slot_norm

OUT_NORMS = {"attn": "self_attn_out_layer_norm", "cross": "encoder_attn_out_layer_norm",
             "ffn": "final_out_layer_norm"}


@register_placement("sandwich")
class Sandwich(Placement):
    norm_slots = (("self_attn_out_layer_norm", ATTENTION, "attn_out"),
                  ("encoder_attn_out_layer_norm", ATTENTION, "cross_out"),
                  ("final_out_layer_norm", FFN, "ffn_out"))
    final_norm = True
    normalizes_sublayer_input = normalizes_sublayer_output = True
    residual_stream = "raw"

    def build_layer(self, layer, index, num_layers):
        for attr, _, _ in self.norm_slots:
            if attr != OUT_NORMS["cross"] or getattr(layer, "encoder_attn", None) is not None:
                setattr(layer, attr, slot_norm(layer, attr))

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            branch = getattr(layer, OUT_NORMS[kind])(sublayer(layer.norm(kind)(x)))
            x = layer.residual_connection(layer.dropout_module(branch), x)
        return x
