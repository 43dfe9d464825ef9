"""ResiDual (Xie, Zhang, Wu et al. 2023, "ResiDual: Transformer with Dual Residual
Connections", eqs. 2-3; code: microsoft/ResiDual): two streams run through a stack. For every
sublayer k (self-attention, cross-attention, FFN, in order through all layers)

    x_{k+1} = LN(x_k + F_k(x_k))      (the PostNorm stream; fairseq's own PostNorm norms)
    y_{k+1} = y_k + F_k(x_k)          (the PreNorm stream: the raw sublayer outputs, y_0 = x_0)

and the stack's output is x_N + LN_f(y_N), LN_f one extra norm per stack. F_k(x_k) is the
sublayer output after dropout, the same tensor in both streams.

fairseq's stack loops pass one tensor from layer to layer, so between layers the two streams
travel concatenated along the feature axis, [x; y] (2d wide; ``return_all_hiddens`` states
are that wide too): the first layer takes the d-wide embedding (y_0 = x_0), the last one
returns x_N + LN_f(y_N), d wide. LN_f is the last layer's ``resi_dual_layer_norm`` (role
final norm). No state lives outside the tensors, so incremental decoding and activation
checkpointing see an ordinary layer function. Every layer of the stack takes part in the
streams, so LayerDrop (which skips layers) is refused, as are residual scalings and T-Fixup
(each is defined for one x + F(x) residual).
"""
import torch

from fairseq_normplug.modules.norm_registry import FINAL

from fairseq_normplug.models.placements.base import Placement, new_norm, register_placement


@register_placement("resi-dual")
class ResiDual(Placement):
    norm_slots = (("resi_dual_layer_norm", FINAL, "resi_final"),)
    keeps_final_norm = True

    def __init__(self, args):
        super().__init__(args)
        self.refuse_single_residual_designs(
            args, "ResiDual's two residual streams share each sublayer output unscaled",
            "its two streams run through every layer of the stack")

    def build_layer(self, layer, index, num_layers):
        layer.resi_dual_first, layer.resi_dual_last = index == 0, index == num_layers - 1
        if layer.resi_dual_last:
            layer.resi_dual_layer_norm = new_norm(layer.embed_dim, FINAL)

    def sublayers(self, layer, x, sublayers):
        if layer.resi_dual_first:
            y = x
        else:
            x, y = x.chunk(2, dim=-1)
        for kind, sublayer in sublayers:
            branch = layer.dropout_module(sublayer(x))
            y = y + branch
            x = layer.norm(kind)(layer.residual_connection(branch, x))
        if layer.resi_dual_last:
            return x + layer.resi_dual_layer_norm(y)
        return torch.cat([x, y], dim=-1)
