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
its stack; :func:`rescale_init` does the same, after the chosen ``--weight-init``.
"""
import torch

from fairseq_normplug.models.placements.base import stacks, swap_layer_class


class B2TLayer:
    def sublayers(self, x, sublayers):
        layer_input = x
        for kind, sublayer in sublayers:
            summed = self.residual_connection(self.dropout_module(sublayer(x)), x)
            if kind == "ffn":  # the bottom-to-top connection into the layer's last norm
                summed = summed + layer_input
            x = self.norm(kind)(summed)
        return x



def install(model, settings) -> None:
    for stack in stacks(model):
        for layer in stack.layers:
            swap_layer_class(layer, B2TLayer)


def rescale_init(model) -> None:
    """The authors' ``rescaling_init``: every layer weight whose name has ``weight`` but not
    ``layer_norm`` (attention projections, fc1, fc2) times N^-0.5, N = the stack's depth."""
    with torch.no_grad():
        for stack in stacks(model):
            scaling = len(stack.layers) ** -0.5
            for layer in stack.layers:
                for name, p in layer.named_parameters():
                    if "weight" in name and "layer_norm" not in name:
                        p.mul_(scaling)
