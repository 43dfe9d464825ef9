"""The output-only norm of OLMo 2 (Team OLMo 2024, "2 OLMo 2 Furious", section 3.2 "reordered
norm"; code: allenai/OLMo ``olmo/model.py`` ``OLMoSequentialBlock`` with ``norm_after``, lines
786-794 and 814-821, and allenai/OLMo-core ``src/olmo_core/nn/transformer/block.py``
``ReorderedNormTransformerBlock``, lines 293-309): every sublayer F (self-attention,
cross-attention, FFN) has a norm on its output and none on its input,

    x <- x + Dropout(LN_out(F(x))),

and each stack ends with a final norm (OLMo's ``ln_f``, ``olmo/model.py`` line 1447; OLMo-core's
LM head norm, ``src/olmo_core/nn/lm_head.py`` lines 171 and 230): fairseq's PreNorm final
``layer_norm``, so ``--no-decoder-final-norm`` is refused. The norm acts before dropout, as in
both files. LN_out are Sandwich's output norms (``self_attn_out_layer_norm``,
``encoder_attn_out_layer_norm``, ``final_out_layer_norm``: the same place, the same names and
statistics); fairseq's input norms are removed. OLMo 2's decoder-only model has no
cross-attention: the decoder's cross-attention gets the same output norm (this project's
choice). OLMo 2 also normalises q and k (QK-norm): that is ``--qknorm``, separate here.
"""
from fairseq_normplug.models.placements.base import SUBLAYER_NORMS, Placement, register_placement, slot_norm
from fairseq_normplug.models.placements.sandwich import OUT_NORMS, Sandwich


@register_placement("output-norm")
class OutputNorm(Placement):
    norm_slots = Sandwich.norm_slots
    final_norm = True
    normalizes_sublayer_output = True
    residual_stream = "raw"

    def build_layer(self, layer, index, num_layers):
        for kind, out in OUT_NORMS.items():
            if getattr(layer, SUBLAYER_NORMS[kind], None) is not None:  # the sublayer exists
                setattr(layer, out, slot_norm(layer, out))
                setattr(layer, SUBLAYER_NORMS[kind], None)

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            branch = getattr(layer, OUT_NORMS[kind])(sublayer(x))
            x = layer.residual_connection(layer.dropout_module(branch), x)
        return x
