"""ResiDual (Xie, Zhang, Wu et al. 2023, "ResiDual: Transformer with Dual Residual
Connections", eqs. 2-3; code: microsoft/ResiDual): two streams run through a stack. For every
sublayer k (self-attention, cross-attention, FFN, in order through all layers)

    x_{k+1} = LN(x_k + F_k(x_k))      (the PostNorm stream; fairseq's own PostNorm norms)
    y_{k+1} = y_k + F_k(x_k)          (the PreNorm stream: the raw sublayer outputs, y_0 = x_0)

and the stack's output is x_N + LN_f(y_N), LN_f one extra norm per stack. F_k(x_k) is the
sublayer output after dropout, the same tensor in both streams. LN_f is a LayerNorm with eps
1e-7, as in the authors' code (microsoft/ResiDual ``resi_dual/resi_dual.py:24`` encoder,
``:157`` decoder; applied to the PreNorm stream at ``:131`` and ``:283``); with another
``--norm-type`` it is that norm with its usual eps (``--norm-eps``).

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

from fairseq_normplug.modules.norm_registry import FINAL, norm_type_of

from fairseq_normplug.models.placements.base import Placement, register_placement, slot_norm

#: eps of the LayerNorm LN_f of the PreNorm stream (microsoft/ResiDual resi_dual/resi_dual.py:24, :157)
FINAL_LAYER_NORM_EPS = 1e-7


@register_placement("resi-dual")
class ResiDual(Placement):
    norm_slots = (("resi_dual_layer_norm", FINAL, "resi_final"),)
    keeps_final_norm = True
    single_stream = False  # its PostNorm and PreNorm streams, concatenated

    def __init__(self, args):
        super().__init__(args)
        self.refuse_residual_scale(args, "ResiDual's two residual streams share each sublayer output unscaled")
        self.refuse_tfixup(args)
        self.refuse_layerdrop(args)

    def build_layer(self, layer, index, num_layers):
        layer.resi_dual_first, layer.resi_dual_last = index == 0, index == num_layers - 1
        if layer.resi_dual_last:
            layer.resi_dual_layer_norm = slot_norm(layer, "resi_dual_layer_norm")

    def finish_model(self, model):
        """LN_f of each stack gets the authors' eps 1e-7 when it is a LayerNorm (also the
        zero-centred one); set here, after the norm factory built the chosen norm type."""
        for stack in (model.encoder, model.decoder):
            norm = stack.layers[-1].resi_dual_layer_norm
            if norm_type_of(norm) == "layernorm":
                norm.eps = FINAL_LAYER_NORM_EPS

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
