"""Gated attention (Qiu, Wang, Zheng et al., "Gated Attention for Large Language Models:
Non-linearity, Sparsity, and Attention-Sink-Free", NeurIPS 2025; authors' code
qiuzh20/gated_attention at 49645df, ``modeling_qwen3.py``): the attention output of every head, before
the output projection, is multiplied elementwise by a sigmoid gate computed from the layer's
query input x,

    O = W_o [ softmax(q k^T / sqrt(d_h)) v  *  sigmoid(x W_g + b_g) ],

one gate per head and channel (the authors' best variant, "G1: SDPA output, head-specific,
elementwise, sigmoid", ``elementwise_attn_output_gate``). In the authors' code the gate rows are
extra outputs of the query projection (``modeling_qwen3.py:273-274``: ``q_proj`` widened to
``num_heads * head_dim * 2``), split from the query per head (lines 309-313), and applied to the
SDPA output before ``o_proj`` (lines 355-356: ``attn_output = attn_output * torch.sigmoid(gate_score)``;
``o_proj`` at line 360).
Here W_g is a separate ``gate_proj`` (``nn.Linear(d, d)``, a bias when fairseq's ``q_proj``
has one, as the authors' gate shares ``q_proj``'s bias; initialised like fairseq's
``q_proj``: Xavier uniform with gain 1/sqrt(2), bias 0) on every ``MultiheadAttention``:

* encoder self-attention and decoder self-attention: the gate reads the layer's (normalised,
  where the placement normalises) attention input, which is also q, k and v;
* decoder cross-attention: the gate reads the query, the decoder state (the authors' model is
  decoder-only; gating the cross-attention from its query is the same formula, one head at a time).

The gate depends on the current position's query only, so incremental decoding is unchanged:
fairseq's key/value caches hold no gate. The product sits in front of ``out_proj`` (a forward
pre-hook; its input is fairseq's heads concatenated in head order, the authors' per-head layout),
and every call takes fairseq's own attention path (``_set_skip_embed_dim_check``: the fast
paths ``F.multi_head_attention_forward`` and xFormers apply ``out_proj``'s weight themselves).
It composes with every placement and norm type; refused: ``--ngpt`` (nGPT renormalises every
matrix after each step and defines no gate) and fairseq's xFormers attention configs.
"""
import math

import torch
from torch import Tensor, nn

from fairseq_normplug.models.placements.base import Modifier, register_modifier
from fairseq_normplug.modules.mixins import mix_into


def gated(attention_output: Tensor, gate_logits: Tensor) -> Tensor:
    """The authors' product: the attention output (heads concatenated) times sigmoid(gate logits)."""
    return attention_output * torch.sigmoid(gate_logits)


def gate_out_proj_input(out_proj: nn.Module, inputs):
    """Forward pre-hook of ``out_proj``: its input (the heads concatenated) times the gate that
    the owning attention set for this call (``out_proj.gate_logits``). A hook, not a new class,
    so it composes with any ``out_proj`` (NormFormer's head scales, fairseq's quant-noise)."""
    if out_proj.gate_logits is None:
        raise RuntimeError("gated attention: out_proj called outside its attention's forward")
    return (gated(inputs[0], out_proj.gate_logits), *inputs[1:])


class GatedAttentionMixin:
    """Put in front of a ``MultiheadAttention``'s class: each call computes the gate logits
    ``gate_proj(query)`` for its ``out_proj``."""

    def forward(self, query, *args, **kwargs):
        self.out_proj.gate_logits = self.gate_proj(query)
        try:
            return super().forward(query, *args, **kwargs)
        finally:
            self.out_proj.gate_logits = None


def install_gate(attention: nn.Module) -> None:
    """Give one fairseq ``MultiheadAttention`` its ``gate_proj`` and the gated ``out_proj``."""
    dim = attention.embed_dim
    attention.gate_proj = nn.Linear(attention.q_proj.in_features, dim, bias=attention.q_proj.bias is not None)
    nn.init.xavier_uniform_(attention.gate_proj.weight, gain=1 / math.sqrt(2))  # fairseq's q_proj init
    if attention.gate_proj.bias is not None:
        nn.init.zeros_(attention.gate_proj.bias)
    attention.out_proj.gate_logits = None
    attention.out_proj.register_forward_pre_hook(gate_out_proj_input)
    mix_into(attention, GatedAttentionMixin, "Gated")
    attention._set_skip_embed_dim_check()


@register_modifier("gated-attention")
class GatedAttention(Modifier):
    """A sigmoid gate of the query input on every attention's output (module docstring)."""

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--gated-attention", action="store_true",
            help="gated attention (Qiu et al. 2025): each head's attention output, before the output "
                 "projection, times an elementwise sigmoid gate of the query input, on encoder and "
                 "decoder self-attention and cross-attention; every placement and norm type")

    def __init__(self, args, placement):
        super().__init__(args, placement)
        if getattr(args, "ngpt", False):
            self.refuse("--gated-attention cannot be combined with --ngpt: nGPT renormalises every matrix "
                        "after each step and defines no attention gate")
        self.refuse_xformers(args, "the gate needs fairseq's own attention path (xFormers applies "
                                   "out_proj's weight itself)")

    def build_layer(self, layer, index, num_layers):
        for name in ("self_attn", "encoder_attn"):
            attention = getattr(layer, name, None)
            if attention is not None:
                install_gate(attention)
