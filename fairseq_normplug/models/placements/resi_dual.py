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
checkpointing see an ordinary layer function.
"""
import torch

from fairseq_normplug.modules.norm_registry import FINAL

from fairseq_normplug.models.placements.base import new_norm, stacks, swap_layer_class


class ResiDualLayer:
    def sublayers(self, x, sublayers):
        if self.resi_dual_first:
            y = x
        else:
            x, y = x.chunk(2, dim=-1)
        for kind, sublayer in sublayers:
            branch = self.dropout_module(sublayer(x))
            y = y + branch
            x = self.norm(kind)(self.residual_connection(branch, x))
        if self.resi_dual_last:
            return x + self.resi_dual_layer_norm(y)
        return torch.cat([x, y], dim=-1)



def install(model, settings) -> None:
    for stack in stacks(model):
        last = len(stack.layers) - 1
        for index, layer in enumerate(stack.layers):
            layer.resi_dual_first, layer.resi_dual_last = index == 0, index == last
            if index == last:
                layer.resi_dual_layer_norm = new_norm(layer.embed_dim, FINAL)
            swap_layer_class(layer, ResiDualLayer)
