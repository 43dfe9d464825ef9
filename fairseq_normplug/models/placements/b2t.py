"""B2T connection (Takase, Kiyono, Kobayashi & Suzuki 2023, "B2T Connection: Serving Stability
and Performance in Deep Transformers", Findings of ACL 2023, eq. 4; code: takase/b2t_connection):
a PostNorm layer whose last norm also receives the layer's input x (a connection from the
bottom of the layer to its top that skips every norm but the last):

    encoder:  h = LN(x + Attn(x)),                         out = LN(x + h + FFN(h))
    decoder:  h1 = LN(x + SelfAttn(x)), h2 = LN(h1 + CrossAttn(h1)),  out = LN(x + h2 + FFN(h2))

The norms are fairseq's own PostNorm norms; no norm is added, and like PostNorm the stacks
have no final norm. Dropout acts on each sublayer output as in fairseq.

The authors' code also rescales the init of every B2T layer (``rescaling_init`` in
``fairseq/modules/transformer_layer.py``, applied with ``--residual-bottom-to-top``): each
weight of the layer that is not a norm's is multiplied by N^-0.5, N the number of layers of
its stack; :meth:`B2T.finish_model` does the same, after the chosen ``--weight-init``.
"""
import torch

from fairseq_normplug.models.placements.base import Placement, register_placement


@register_placement("b2t")
class B2T(Placement):
    residual_stream = "normalized"

    def __init__(self, args):
        super().__init__(args)
        self.refuse_tfixup(args)

    def sublayers(self, layer, x, sublayers):
        layer_input = x
        for kind, sublayer in sublayers:
            summed = layer.residual_connection(layer.dropout_module(sublayer(x)), x)
            if kind == "ffn":  # the bottom-to-top connection into the layer's last norm
                summed = summed + layer_input
            x = layer.norm(kind)(summed)
        return x

    def finish_model(self, model):
        """The authors' ``rescaling_init``: every layer weight whose name has ``weight`` but not
        ``layer_norm`` (attention projections, fc1, fc2) times N^-0.5, N = the stack's depth."""
        with torch.no_grad():
            for stack in (model.encoder, model.decoder):
                scaling = len(stack.layers) ** -0.5
                for layer in stack.layers:
                    for name, p in layer.named_parameters():
                        if "weight" in name and "layer_norm" not in name:
                            p.mul_(scaling)
