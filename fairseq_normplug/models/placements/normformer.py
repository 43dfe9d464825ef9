"""NormFormer (Shleifer, Weston & Ott 2021, "NormFormer: Improved Transformer Pretraining with
Extra Normalization", arXiv:2110.09456, section 2 and Fig. 1): three additions to a PreNorm
layer,

    x <- x + Dropout(LN_post(HeadScaleMHA(LN(x))))                  (self-attention)
    HeadScaleMHA(Q, K, V) = Concat(gamma_1 head_1, ..., gamma_h head_h) W_O,  gamma_i init 1
    x <- x + Dropout(W_2 LN_ffn(act(W_1 LN(x))))                    (FFN)

LN_post is the layer's ``attn_ln`` (d wide), LN_ffn its ``ffn_layernorm`` (FFN-width wide, after
fairseq's activation dropout, as in fairseq's ``--scale-fc``): fairseq's own names, listed in
:attr:`NormFormer.norm_slots` (``encN.attn_inner``, ``encN.ffn_inner``, ...), so every
``--norm-type`` replaces them. The head scales gamma are ``self_attn.out_proj.head_scale``
(shape (heads,)): :class:`HeadScaledProjection` multiplies each head's slice of the
concatenated head outputs by its gamma *before* W_O, as the paper's formula says. fairseq's
LM version (``--scale-heads``, ``c_attn``) instead reshapes the *projected* output into
groups of d/h channels and scales those (fairseq issues #3973, #3983), which is not the
paper's formula; it is not used here.

Built for the encoder and the decoder of ``transformer_normplug``. The paper only has
self-attention (decoder-only LMs, and an encoder-only masked LM), so the post-attention norm
and the head scales are on self-attention only; the decoder's cross-attention is fairseq's
PreNorm cross-attention, unchanged. PreNorm's final norm per stack is kept, as in the paper.
The paper's residual scaling lambda_resid (fairseq's ``--scale-resids``) is not built.
"""
import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.modules.norm_registry import ATTENTION, FFN

from fairseq_normplug.models.placements.base import PRENORM_LIKE, Modifier, flag, register_modifier, slot_norm


class HeadScaledProjection(nn.Linear):
    """An attention's output projection W_O whose input, the concatenated head outputs, is
    scaled per head first: (Concat(gamma_1 head_1, ..., gamma_h head_h)) W_O^T + b.
    Same weight and bias (names and values) as the projection it replaces, plus
    ``head_scale`` (gamma, shape (num_heads,), init 1)."""

    def __init__(self, linear: nn.Linear, num_heads: int):
        # built on the meta device (no random init drawn), then given the projection's own tensors
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        if linear.in_features % num_heads:
            raise ValueError(f"{linear.in_features} input features do not split into {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = linear.in_features // num_heads
        self.head_scale = nn.Parameter(torch.ones(num_heads, dtype=linear.weight.dtype, device=linear.weight.device))
        # hooks on the replaced projection (fairseq's --quant-noise-pq) keep acting on W_O
        self._forward_pre_hooks.update(linear._forward_pre_hooks)

    def forward(self, x):
        return F.linear(x * self.head_scale.repeat_interleave(self.head_dim), self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads={self.num_heads} (head_scale before the projection)"


def _insert_module(owner: nn.Module, name: str, module: nn.Module, *, after: str = None, before: str = None) -> None:
    """Register ``module`` as ``owner.<name>`` right after ``after`` (or before ``before``), so
    the parameter order is fairseq's own (its LM layer registers ``attn_ln`` after
    ``self_attn`` and ``ffn_layernorm`` before ``fc1``)."""
    owner.__dict__.pop(name, None)  # fairseq's decoder layer: a plain None attribute
    items = [(key, value) for key, value in owner._modules.items() if key != name]
    owner._modules.clear()
    for key, value in items:
        if key == before:
            owner._modules[name] = module
        owner._modules[key] = value
        if key == after:
            owner._modules[name] = module
    if name not in owner._modules:
        owner._modules[name] = module


#: fairseq's own NormFormer switches (``transformer_lm`` flags; a namespace may still carry them)
FAIRSEQ_NORMFORMER = ("scale_attn", "scale_fc", "scale_heads", "scale_resids")


@register_modifier("normformer")
class NormFormer(Modifier):
    """NormFormer's norms and head scales on every encoder and decoder layer of a PreNorm
    model; the layers run PreNorm's wiring, x + Dropout(F(LN(x))), where the self-attention F
    ends with ``attn_ln`` and the FFN applies ``ffn_layernorm`` (``layers.py``)."""

    norm_slots = (("attn_ln", ATTENTION, "attn_inner"), ("ffn_layernorm", FFN, "ffn_inner"))
    sublayer_forward = True
    requires = PRENORM_LIKE

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--normformer", action="store_true",
            help="NormFormer (Shleifer et al. 2021) on PreNorm, encoder and decoder: a norm after "
                 "self-attention, a learned scale per head applied before the output projection, and "
                 "a norm after the FFN activation; needs --prenorm (--norm-placement pre)")

    def __init__(self, args, placement):
        self.one_stack = [name for name in ("encoder_normalize_before", "decoder_normalize_before")
                          if getattr(args, name, False)]
        super().__init__(args, placement)
        given = [name for name in FAIRSEQ_NORMFORMER if getattr(args, name, False)]
        if given:
            self.refuse(f"--normformer cannot be combined with fairseq's {flag(given[0])} (its LM NormFormer "
                        f"switches: {', '.join(map(flag, FAIRSEQ_NORMFORMER))}); drop it")
        if getattr(args, "no_decoder_final_norm", False):
            self.refuse("--no-decoder-final-norm cannot be combined with --normformer: NormFormer keeps "
                        "PreNorm's final norm")
        self.refuse_xformers(args, "the head scales need fairseq's own attention path (xFormers applies "
                                   "out_proj's weight itself)")

    def refusal(self, placement):
        got = f"only {flag(self.one_stack[0])}" if self.one_stack else placement.describe()
        return f"--normformer needs the PreNorm placement (--prenorm / --norm-placement pre), got {got}"

    def build_layer(self, layer, index, num_layers):
        _insert_module(layer, "attn_ln", slot_norm(layer, "attn_ln"), after="self_attn")
        _insert_module(layer, "ffn_layernorm", slot_norm(layer, "ffn_layernorm", layer.fc1.out_features), before="fc1")
        attn = layer.self_attn
        attn.out_proj = HeadScaledProjection(attn.out_proj, attn.num_heads)
        # fairseq's fast paths (F.multi_head_attention_forward, xFormers) read
        # out_proj.weight directly; this switch makes every call apply out_proj as a module
        attn._set_skip_embed_dim_check()
