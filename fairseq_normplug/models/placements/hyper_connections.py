"""Hyper-Connections (Zhu, Huang, Huang et al., ICLR 2025, "Hyper-Connections", arXiv:2409.19606,
section 2 and Appendix J, Algorithm 2) and manifold-constrained hyper-connections (mHC: Xie, Wei,
Cao et al. 2025, arXiv:2512.24880, eqs. 7-9), built as the reference implementation builds them
(lucidrains/hyper-connections, ``hyper_connections/hyper_connections.py`` and
``manifold_constrained_hyper_connections.py``; the lines each constant comes from are in
docs/beyond.md).

A stack's residual stream becomes n streams H = (h_1 .. h_n) (``--hc-streams n``), n copies of
the embedding output at the first layer and summed at the last (the reference's
``expand_streams`` / ``reduce_streams``), then PreNorm's final norm. Each sublayer F
(self-attention, the decoder's cross-attention with the encoder output as keys and values, the
FFN) is one hyper-connection k (k counts the sublayers through the stack):

    width:   x = sum_s A_m[s] h_s,    h'_t = sum_s A_r[s, t] h_s
    branch:  y = Dropout(F(LN(x)))         (LN: fairseq's PreNorm norm of the sublayer)
    depth:   h_t <- h'_t + B[t] y

Dynamic hyper-connections (the reference's ``HyperConnections``, tanh on): with
H̄ = norm(H) (one norm over each stream's d channels; a norm slot, so ``--norm-type`` applies),

    [A_m A_r] = [A_m A_r]_static + s_alpha tanh(H̄ W_alpha),   B = B_static + s_beta tanh(H̄ w_beta),

init A_m = e_{k mod n}, A_r = I, B = 1, W = 0, s = 0.01: at init the model is PreNorm on stream
k mod n (n = 1: exactly PreNorm). mHC (``--hc-manifold``, the reference's
``ManifoldConstrainedHyperConnections``): no tanh, a scale each for the pre and residual parts,

    A_m = sigmoid(.),   A_r = Sinkhorn-Knopp(.) (doubly stochastic),   B = 2 sigmoid(.)

with the same static init under the constraints. The coefficients are computed in float32
(Sinkhorn's exp and 20 normalisations included) and the streams are mixed in the input dtype.

Between layers the n streams travel concatenated along the feature axis (n*d wide, also the
``return_all_hiddens`` states of inner layers); no state lives outside the tensors, so
incremental decoding and activation checkpointing see an ordinary layer function. Every layer
takes part in the streams, so LayerDrop is refused, as are residual scalings and T-Fixup
(each is defined for one x + F(x) residual).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.modules.float32_params import Float32Params
from fairseq_normplug.modules.norm_registry import FFN
from fairseq_normplug.numeric_flags import number_flag

from fairseq_normplug.models.placements.base import Placement, new_norm, register_placement, slot_norm

#: the expansion rate n of both papers' main models
DEFAULT_STREAMS = 4
#: the reference's init of every dynamic scale (s_alpha, s_beta; mHC's alpha_pre, alpha_res, alpha_post)
DYNAMIC_SCALE_INIT = 1e-2
#: mHC's t_max (eq. 9), the reference's ``sinkhorn_iters`` default
SINKHORN_ITERATIONS = 20


def sinkhorn_knopp(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """mHC eq. 9, as the reference's ``sinkhorn_knopps`` (its default, not the log-domain one):
    M(0) = exp(logits) (less each column's maximum, without gradient, for range), then
    M <- T_r(T_c(M)) ``iterations`` times (columns, the source streams dim -2, then rows,
    normalised to sum 1); in float32. The rows sum to 1 exactly, the columns to 1 within the
    iterations' convergence."""
    logits = logits.float()
    matrix = (logits - logits.amax(dim=-2, keepdim=True).detach()).exp()
    for _ in range(iterations):
        matrix = F.normalize(matrix, p=1, dim=-2)
        matrix = F.normalize(matrix, p=1, dim=-1)
    return matrix


class HyperConnection(Float32Params):
    """The width and depth connections of one sublayer (hyper-connection ``index`` of its stack)
    over ``streams`` residual streams of ``dim`` channels; the mHC constraints with ``manifold``.
    Its scalar scales stay float32 under fp16/bf16 (:class:`Float32Params`). ``norm`` is the slot's
    norm built by the norm factory (``slot_norm``); without one, a LayerNorm placeholder."""

    def __init__(self, dim: int, streams: int, index: int, manifold: bool, norm: Optional[nn.Module] = None):
        super().__init__()
        self.streams, self.manifold = streams, manifold
        self.norm = new_norm(dim, FFN) if norm is None else norm  # H̄ = norm(H), the input of the dynamic weights
        static_alpha = torch.zeros(streams, 1 + streams)
        static_alpha[index % streams, 0] = 1.0  # A_m = e_{k mod n}
        static_alpha[:, 1:] = torch.eye(streams)  # A_r = I
        self.static_alpha = nn.Parameter(static_alpha)
        self.dynamic_alpha = nn.Parameter(torch.zeros(dim, 1 + streams))  # W_alpha = [W_m W_r]
        if manifold:
            self.pre_scale = nn.Parameter(torch.tensor(DYNAMIC_SCALE_INIT))
            self.res_scale = nn.Parameter(torch.tensor(DYNAMIC_SCALE_INIT))
        else:
            self.alpha_scale = nn.Parameter(torch.tensor(DYNAMIC_SCALE_INIT))
        self.static_beta = nn.Parameter(torch.ones(streams))
        self.dynamic_beta = nn.Parameter(torch.zeros(dim))
        self.beta_scale = nn.Parameter(torch.tensor(DYNAMIC_SCALE_INIT))

    def gains(self):
        """The mixing coefficients and scales, which ``--norm-weight-decay`` treats as gains (the
        projections W_alpha, w_beta are weight matrices: ``--weight-decay``)."""
        return [p for name, p in self.named_parameters(recurse=False) if not name.startswith("dynamic_")]

    def coefficients(self, streams: torch.Tensor):
        """(alpha (..., n, 1 + n): column 0 A_m, columns 1.. A_r; beta (..., n)) for the streams
        (..., n, d), in float32."""
        normed = self.norm(streams).float()
        alpha_logits = normed @ self.dynamic_alpha.float()
        beta_logits = normed @ self.dynamic_beta.float()
        static_alpha, static_beta = self.static_alpha.float(), self.static_beta.float()
        if not self.manifold:
            alpha = self.alpha_scale.float() * torch.tanh(alpha_logits) + static_alpha
            return alpha, self.beta_scale.float() * torch.tanh(beta_logits) + static_beta
        scales = torch.cat([self.pre_scale.float().view(1), self.res_scale.float().expand(self.streams)])
        alpha = alpha_logits * scales + static_alpha
        alpha = torch.cat([alpha[..., :1].sigmoid(), sinkhorn_knopp(alpha[..., 1:])], dim=-1)
        return alpha, 2 * (beta_logits * self.beta_scale.float() + static_beta).sigmoid()

    def forward(self, streams: torch.Tensor):
        """The width connection of ``streams`` (..., n, d): (the branch input (..., d), the
        mixed residual streams (..., n, d), beta (..., n)), in the streams' dtype."""
        alpha, beta = self.coefficients(streams)
        mixed = torch.einsum("...st,...sd->...td", alpha.to(streams.dtype), streams)
        return mixed[..., 0, :], mixed[..., 1:, :], beta.to(streams.dtype)


@register_placement("hyper-connections")
class HyperConnections(Placement):
    label = "hc"
    defaults = {"hc_streams": None, "hc_manifold": None}
    #: the norm of each hyper-connection's dynamic weights (enc0.hc_attn, dec1.hc_cross, ...)
    norm_slots = tuple((f"hyper_connections.{kind}.norm", FFN, f"hc_{kind}") for kind in ("attn", "cross", "ffn"))
    final_norm = True
    normalizes_sublayer_input = True
    single_stream = False  # n streams, concatenated

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--hc-streams", metavar="N",
            **number_flag(int, at_least=1, note=f"the number of residual streams; the papers use {DEFAULT_STREAMS}"),
            help=f"--norm-placement hyper-connections: the number of residual streams (expansion rate) "
                 f"N >= 1 (default {DEFAULT_STREAMS}, the papers')")
        parser.add_argument(
            "--hc-manifold", action="store_true", default=None,
            help="--norm-placement hyper-connections: mHC (Xie et al. 2025), the residual mixing projected "
                 "onto doubly stochastic matrices (Sinkhorn-Knopp), sigmoid pre and 2*sigmoid post weights")

    def __init__(self, args):
        super().__init__(args)
        streams = DEFAULT_STREAMS if args.hc_streams is None else args.hc_streams
        self.refuse_residual_scale(args, "the hyper-connections' learned mixing replaces the x + F(x) residual "
                                         "it scales")
        self.refuse_tfixup(args)
        self.refuse_layerdrop(args, "its residual streams run through every layer of the stack")
        self.streams = streams
        self.manifold = bool(args.hc_manifold)

    def resolved_fields(self):
        return {"hc_streams": self.streams, "hc_manifold": self.manifold}

    def build_layer(self, layer, index, num_layers):
        kinds = ["attn", "cross", "ffn"] if getattr(layer, "encoder_attn", None) is not None else ["attn", "ffn"]
        layer.hyper_connections = nn.ModuleDict({
            kind: HyperConnection(layer.embed_dim, self.streams, index * len(kinds) + position, self.manifold,
                                  norm=slot_norm(layer, f"hyper_connections.{kind}.norm"))
            for position, kind in enumerate(kinds)})
        layer.hc_first, layer.hc_last = index == 0, index == num_layers - 1

    def sublayers(self, layer, x, sublayers):
        if layer.hc_first:  # n copies of the embedding output
            streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.streams, x.size(-1))
        else:
            streams = x.unflatten(-1, (self.streams, -1))
        for kind, sublayer in sublayers:
            connection = layer.hyper_connections[kind]
            branch_input, residuals, beta = connection(streams)
            branch = layer.dropout_module(sublayer(layer.norm(kind)(branch_input)))
            streams = residuals + beta.unsqueeze(-1) * branch.unsqueeze(-2)
        return streams.sum(dim=-2) if layer.hc_last else streams.flatten(-2)
