"""PreNorm (Wang et al. 2019, "Learning Deep Transformer Models for Machine Translation";
Nguyen & Salazar 2019, "Transformers without Tears", eq. 2): the norm before every sublayer,

    x <- x + Dropout(F(LN(x))),

plus a final norm after each stack: fairseq's ``--encoder-normalize-before
--decoder-normalize-before`` model, as built (nothing changes). :meth:`PreNorm.sublayers` is
the same wiring for modifiers whose sublayers fairseq's forward does not run (NormFormer).
"""
from fairseq_normplug.models.placements.base import Placement, register_placement


@register_placement("pre")
class PreNorm(Placement):
    label = "prenorm"
    stock_model = stock_forward = True
    normalizes_sublayer_input = True
    residual_stream = "raw"

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            x = layer.residual_connection(layer.dropout_module(sublayer(layer.norm(kind)(x))), x)
        return x
