"""Attention Residuals (Kimi Team, "Attention Residuals", 2026, arXiv:2603.15031; authors' code
MoonshotAI/Attention-Residuals, whose code is the "PyTorch-style pseudocode" block of its
``README.md``, the paper's Figure 2: ``block_attn_res`` (README.md:53-65 at commit 85e2231) and the
layer's ``forward`` (README.md:67-90); docs/beyond.md says how these were checked): each
sublayer's input is a softmax-weighted sum over depth of the earlier sublayer outputs and the
embedding output, in place of PreNorm's unit-weight residual sum,

    h_l = sum_{i=0..l-1} alpha_{i->l} v_i,     alpha_{i->l} = softmax_i( w_l . RMSNorm(v_i) ),
    v_0 = the embedding output,   v_i = Dropout(F_i(LN_i(h_i)))   (i >= 1),

one pseudo-query w_l (d numbers, zero at init: uniform weights) per sublayer l (self-attention,
the decoder's cross-attention, FFN: the README's "block_size counts ATTN + MLP"), keys the
values under an RMSNorm with its own gain (``K = norm(V)``, ``logits = einsum('d, n b t d -> n b
t', proj.weight.squeeze(), K)``, ``h = einsum('n b t, n b t d -> b t d', logits.softmax(0),
V)``). The weights are per token: the softmax runs over depth at each position, so the layers
stay position-wise and incremental decoding needs no cache of its own (the sources of the new
position travel with it). LN_i is fairseq's PreNorm norm of the sublayer (``attn_norm``,
``mlp_norm`` in the pseudocode); ``--norm-type`` fills those and the final norm. The key norm
inside the softmax is the paper's RMSNorm whatever ``--norm-type`` (it belongs to the kernel
exp(w^T RMSNorm(k)), not to the placement's norms), eps 1e-5.

Block AttnRes (``--attn-res-blocks N``): the L layers of a stack form N blocks of L/N layers;
within a block the sublayer outputs add up as plain residuals into the partial sum b_n^i, and
every sublayer attends over the completed block sums b_0 (the embedding output), ..., b_{n-1}
and the current partial sum when it is not empty (the pseudocode's ``V = stack(blocks +
[partial_block])``; at a block's first layer the partial sum is moved to ``blocks`` after the
self-attention's aggregation, as the pseudocode does, which equals attending over the
completed blocks only). The pseudocode is read with ``blocks = []``, the embedding output as
the first ``hidden_states`` and ``layer_number`` counted from 0, the reading that gives b_0 =
the embedding output once.

Each stack's output is one more aggregation with its own pseudo-query over every source
(h_{L+1}; the pseudocode stops at the layer, the public ports of the authors' models call it
``final_attn_res_proj`` / ``final_attn_res_norm``), then the stack's final norm. The authors'
model is decoder-only; here the encoder gets the same design, and the decoder's cross-attention
is a sublayer like the others: its query input is its own aggregation, its keys and values the
encoder's output, its output one more source.

Between layers the sources travel concatenated along the feature axis (Full: 1 + the number of
sublayers so far, d each; Block: the completed blocks and the partial sum; ``return_all_hiddens``
states of inner layers are that wide), the last layer returns d; no state lives outside the
tensors, so ``--checkpoint-activations`` recomputes a layer from its own input. The logits, the
softmax and the weighted sum are computed in float32 under fp16/bf16. The pseudo-queries and key
gains are not norm slots: they get the ordinary ``--weight-decay``, not ``--norm-weight-decay``.
Refused, one line: any ``--residual-scale`` and ``--weight-init tfixup`` (there is no x + F(x)
residual to scale), LayerDrop and ``--*-layers-to-keep`` (every layer's outputs are sources of
the later ones), an N that does not divide a stack's layers; ``--denseformer``,
``--normformer``, ``--layernorm-scaling``, ``--gpas`` and ``--ngpt`` refuse this placement
themselves. ``--value-residual`` composes (its V_1 channels travel behind the sources).
"""
from typing import List, Optional

import torch
from torch import Tensor, nn

from fairseq_normplug.modules.float32_params import HALF_DTYPES
from fairseq_normplug.numeric_flags import number_flag

from fairseq_normplug.models.placements.base import Placement, flag, register_placement

#: eps of the key norm RMSNorm(v_i): the pseudocode leaves it open; the plugin's RMSNorm default
KEY_NORM_EPS = 1e-5
#: the sublayer kinds, in a layer's order, each with its own pseudo-query
KINDS = ("attn", "cross", "ffn")
#: the pseudo-query of a stack's output aggregation (on its last layer)
FINAL = "final"


class DepthAttention(nn.Module):
    """One aggregation over depth: the pseudo-query w (``query``, zero init) and the gain of the
    key RMSNorm (``key_norm_weight``, ones), the pseudocode's ``proj`` and ``norm``."""

    def __init__(self, dim: int):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_norm_weight = nn.Parameter(torch.ones(dim))

    def weights(self, sources: List[Tensor]) -> Tensor:
        """alpha (S, ...): softmax over depth of w . RMSNorm(v_i) = (v_i . (g w)) / rms(v_i) per
        position, for the sources v_i (each (..., d)). Source by source, reductions in float32
        for fp16/bf16 sources, so the backward keeps references to the sources, not stacked or
        upcast copies."""
        compute = torch.float32 if sources[0].dtype in HALF_DTYPES else sources[0].dtype
        gained_query = (self.key_norm_weight * self.query).to(sources[0].dtype)
        width = sources[0].size(-1)
        logits = []
        for source in sources:
            mean_square = torch.linalg.vector_norm(source, dim=-1, dtype=compute).square() / width
            logits.append((source * gained_query).sum(dim=-1, dtype=compute) * torch.rsqrt(mean_square + KEY_NORM_EPS))
        return torch.stack(logits).softmax(dim=0)

    def forward(self, sources: List[Tensor]) -> Tensor:
        """h = sum_i alpha_i v_i over ``sources`` (each (..., d)), summed in float32 for fp16/bf16,
        returned in their dtype."""
        alpha = self.weights(sources).unsqueeze(-1)
        mixed = alpha[0] * sources[0]
        for weight, source in zip(alpha[1:], sources[1:]):
            mixed = mixed + weight * source
        return mixed.to(sources[0].dtype)


@register_placement("attention-residuals")
class AttentionResiduals(Placement):
    """PreNorm sublayers whose inputs are softmax aggregations over depth (module docstring)."""

    label = "attnres"
    defaults = {"attn_res_blocks": None}
    final_norm = True
    normalizes_sublayer_input = True
    single_stream = False  # every earlier sublayer output travels with the layer

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--attn-res-blocks", metavar="N", **number_flag(int, at_least=1, note="the number of blocks per stack"),
            help="--norm-placement attention-residuals: Block AttnRes, each stack's layers in N blocks (N must "
                 "divide the layers); each sublayer attends over the block sums and the current partial sum "
                 "(default: Full AttnRes, over every sublayer output)")

    def __init__(self, args):
        super().__init__(args)
        reason = "Attention Residuals replace the x + F(x) residual with a softmax aggregation over depth"
        self.refuse_residual_scale(args, reason)
        self.refuse_tfixup(args)
        self.refuse_layerdrop(args, "every layer's outputs are sources of the later layers' aggregations")
        for name in ("encoder_layers_to_keep", "decoder_layers_to_keep"):
            if getattr(args, name, None):
                self.refuse(f"{flag(name)} cannot be combined with {self.describe()}: every layer's outputs are "
                            f"sources of the later layers' aggregations")
        self.blocks: Optional[int] = args.attn_res_blocks
        for name in ("encoder_layers", "decoder_layers"):
            if getattr(args, name, None) is not None:
                self.check_blocks(name.split("_")[0], getattr(args, name))

    def check_blocks(self, stack: str, num_layers: int) -> None:
        """Refuse an N that does not divide the stack's layers (blocks of L/N layers)."""
        if self.blocks is not None and num_layers % self.blocks:
            divisors = ", ".join(str(n) for n in range(1, num_layers + 1) if num_layers % n == 0)
            self.refuse(f"--attn-res-blocks {self.blocks} does not divide the {stack}'s {num_layers} layers; "
                        f"choose one of {divisors}")

    def build_layer(self, layer, index, num_layers):
        self.check_blocks("decoder" if hasattr(layer, "encoder_attn") else "encoder", num_layers)
        kinds = [kind for kind in KINDS if kind != "cross" or getattr(layer, "encoder_attn", None) is not None]
        if index == 0:
            kinds.remove("attn")  # its only source is the embedding output: h = v_0, no weights to learn
        if index == num_layers - 1:
            kinds.append(FINAL)
        layer.attention_residuals = nn.ModuleDict({kind: DepthAttention(layer.embed_dim) for kind in kinds})
        layer.attn_res_first, layer.attn_res_last = index == 0, index == num_layers - 1
        per_block = num_layers // self.blocks if self.blocks else 1
        layer.attn_res_block_start = self.blocks is not None and index > 0 and index % per_block == 0

    def sublayers(self, layer, x, sublayers):
        width = layer.embed_dim
        partial: Optional[Tensor] = None
        if layer.attn_res_first:
            completed = [x]  # v_0 = b_0 = the embedding output
        else:
            completed = list(x.split(width, dim=-1))
            if self.blocks is not None:
                partial = completed.pop()
        if layer.attn_res_block_start:  # the partial sum is a completed block
            completed.append(partial)
            partial = None
        for kind, sublayer in sublayers:
            sources = completed if partial is None else [*completed, partial]
            h = sources[0] if len(sources) == 1 else layer.attention_residuals[kind](sources)
            out = layer.dropout_module(sublayer(layer.norm(kind)(h)))
            if self.blocks is None:
                completed.append(out)
            else:
                partial = out if partial is None else partial + out
        sources = completed if partial is None else [*completed, partial]
        if layer.attn_res_last:
            return layer.attention_residuals[FINAL](sources)
        return torch.cat(sources, dim=-1)
