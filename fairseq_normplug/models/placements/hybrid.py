"""HybridNorm (Zhuo, Zeng, Wang et al. 2025, "HybridNorm: Towards Stable and Efficient
Transformer Training via Hybrid Normalization", section 3; code: BryceZhuo/HybridNorm,
``dense_model/olmo/model.py`` with ``configs/exps/1.2B-dense-HybriedNorm.yaml``): QKV
normalisation inside every attention, and a norm before the FFN whose output also carries
the residual,

    attn_QKV(x) = softmax(N_q(x W_q) N_k(x W_k)^T / sqrt(d_k)) N_v(x W_v) W_o
    y = x + Dropout(attn_QKV(x))                  (self-attention; decoder: also cross-attention)
    z = LN(y);  out = z + Dropout(FFN(z))         (fairseq's ``final_layer_norm``)

plus a final norm after each stack (the authors' model ends with ``ln_f``; PreNorm's
``layer_norm`` here). As in the authors' config (``use_query_norm``/``use_key_norm``/
``use_value_norm``, ``attn_norm: false``, ``ffn_norm: true``, ``ffn_residual_after_norm:
true``): N_q, N_k, N_v are norms of the chosen ``--norm-type`` over each head's d_k channels,
one per projection shared by its heads, applied after the projection and its bias, as
``q_proj.norm`` / ``k_proj.norm`` / ``v_proj.norm`` of every ``MultiheadAttention`` (for
cross-attention, keys and values are the projected encoder states). The attention blocks
have no other norm (fairseq's ``self_attn_layer_norm`` / ``encoder_attn_layer_norm`` are
removed). Keys and values are normalised inside their projections, so the
incremental-decoding cache holds normalised keys and values. The authors' HybridNorm*
(a different first layer) is not built.
"""
from typing import Optional

import torch.nn.functional as F
from torch import nn

from fairseq_normplug.modules.norm_registry import ATTENTION

from fairseq_normplug.models.placements.base import Placement, new_norm, register_placement, slot_norm

ATTENTIONS = (("self_attn", "self_attn_layer_norm", "attn"), ("encoder_attn", "encoder_attn_layer_norm", "cross"))
PROJECTIONS = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"))


class NormedProjection(nn.Linear):
    """A q/k/v projection followed by a norm over each head's part of its output:
    norm(x W^T + b) per head. Same weight and bias (names and values) as the projection it
    replaces, plus ``norm`` (d_k wide): the slot's norm built by the norm factory (``slot_norm``),
    or without one a LayerNorm placeholder (``new_norm``)."""

    def __init__(self, linear: nn.Linear, num_heads: int, norm: Optional[nn.Module] = None):
        # built on the meta device (no random init drawn), then given the projection's own tensors
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.num_heads = num_heads
        self.norm = new_norm(linear.out_features // num_heads, ATTENTION) if norm is None else norm

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return self.norm(y.view(*y.shape[:-1], self.num_heads, -1)).view(y.shape)


@register_placement("hybrid")
class HybridNorm(Placement):
    norm_slots = tuple((f"{attn}.{proj}.norm", ATTENTION, f"{short}_{proj_short}")
                       for attn, _, short in ATTENTIONS for proj, proj_short in PROJECTIONS)
    final_norm = True

    def __init__(self, args):
        super().__init__(args)
        if getattr(args, "qknorm", False):
            self.refuse(f"--qknorm cannot be combined with {self.describe()}: HybridNorm already "
                        f"normalises q and k (QKV-norm); drop one of them")
        if getattr(args, "quant_noise_pq", 0):
            self.refuse(f"--quant-noise-pq {args.quant_noise_pq} cannot be combined with {self.describe()}: "
                        f"the QKV norms replace the projections that quant-noise hooks into")
        self.refuse_xformers(args, "xFormers attention reads the q/k/v weights and would skip the QKV norms")

    def build_layer(self, layer, index, num_layers):
        for attn_name, norm_name, _ in ATTENTIONS:
            attn = getattr(layer, attn_name, None)
            if attn is None:
                continue
            for proj, _ in PROJECTIONS:
                linear = getattr(attn, proj)
                norm = slot_norm(layer, f"{attn_name}.{proj}.norm", linear.out_features // attn.num_heads)
                setattr(attn, proj, NormedProjection(linear, attn.num_heads, norm))
            # fairseq's fast paths (F.multi_head_attention_forward, xFormers) read the
            # projection weights directly; this switch makes every call use the modules
            attn._set_skip_embed_dim_check()
            setattr(layer, norm_name, None)

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            if kind == "ffn":
                x = layer.final_layer_norm(x)
            x = layer.residual_connection(layer.dropout_module(sublayer(x)), x)
        return x
