"""Weight initialisations compared in "Transformers without Tears", section 2.2 and Table 2.

* ``fairseq``: fairseq's own (q/k/v Xavier-uniform with gain 1/sqrt(2), out_proj gain 1,
  FFN PyTorch default); nothing is touched.
* ``xavier``: the paper's "default" baseline, Xavier normal everywhere (eq. 4): attention
  std sqrt(2/(d+d)) = sqrt(1/d), FFN std sqrt(2/(d+d_ff)); biases zero.
* ``smallinit``: SmallInit, attention q/k/v/out ~ N(0, sqrt(2/(5d))) (section 2.2, in the
  text after eq. 4: sqrt(2/(d+4d)) instead of sqrt(2/(d+d))), FFN Xavier normal, biases zero.
* ``tfixup``: T-Fixup (Huang, Perez, Ba & Volkovs 2020, "Improving Transformer Optimization
  Through Better Initialization", ICML, Algorithm 1), for models without norms and without
  warmup; see :func:`apply_tfixup_init`.

DeepNorm's init (Wang et al. 2022) belongs to ``--residual-scale deepnorm``:
:func:`apply_deepnorm_init`.
"""
import math

import torch
from torch import nn

WEIGHT_INITS = ("fairseq", "xavier", "smallinit", "tfixup")
#: schemes that need the whole model (embeddings, depths), applied by apply_model_init
MODEL_INITS = ("tfixup",)


def _attention_projections(attn):
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj]


def _ffn_projections(layer):
    return [layer.fc1, layer.fc2]


def apply_weight_init(layers, scheme: str) -> None:
    """Re-initialise the attention and FFN weights of Transformer ``layers`` in place."""
    if scheme not in WEIGHT_INITS:
        raise ValueError(f"unknown weight init {scheme!r}; choose from {', '.join(WEIGHT_INITS)}")
    if scheme == "fairseq" or scheme in MODEL_INITS:
        return
    for layer in layers:
        attentions = [getattr(layer, name, None) for name in ("self_attn", "encoder_attn")]
        for attn in filter(None, attentions):
            for proj in _attention_projections(attn):
                if scheme == "smallinit":
                    d = attn.embed_dim
                    nn.init.normal_(proj.weight, mean=0.0, std=math.sqrt(2.0 / (5 * d)))
                else:
                    nn.init.xavier_normal_(proj.weight)
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
        for proj in _ffn_projections(layer):
            nn.init.xavier_normal_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)


def _reinit(proj: nn.Linear, gain: float = 1.0, normal: bool = False) -> None:
    (nn.init.xavier_normal_ if normal else nn.init.xavier_uniform_)(proj.weight, gain=gain)
    if proj.bias is not None:
        nn.init.zeros_(proj.bias)


def _attentions(layer):
    return [a for a in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)) if a is not None]


def tfixup_scales(encoder_layers: int, decoder_layers: int):
    """T-Fixup's gains (Algorithm 1): encoder v/out/FFN weights by 0.67 N^(-1/4); decoder
    v/out (self- and cross-attention) and FFN weights, and the input embeddings, by (9M)^(-1/4)."""
    return 0.67 * encoder_layers ** (-1 / 4), (9 * decoder_layers) ** (-1 / 4)


def apply_tfixup_init(model) -> None:
    """T-Fixup (Huang et al. 2020, Algorithm 1): Xavier init (the authors' code keeps
    fairseq's q/k init, Xavier-uniform with gain 1/sqrt(2), and gives v/out/FFN gain 1, biases
    zero), input embeddings N(0, d^-1/2), then the scales of :func:`tfixup_scales`. The paper
    scales both embeddings by (9M)^(-1/4) (the authors' code uses N for the encoder's; the same
    when N = M); a shared embedding is scaled once. fairseq's sqrt(d) embedding scale is kept,
    as in the authors' code."""
    encoder_scale, decoder_scale = tfixup_scales(len(model.encoder.layers), len(model.decoder.layers))
    with torch.no_grad():
        for stack, scale in ((model.encoder, encoder_scale), (model.decoder, decoder_scale)):
            for layer in stack.layers:
                for proj in [p for a in _attentions(layer) for p in (a.v_proj, a.out_proj)] + _ffn_projections(layer):
                    _reinit(proj)
                    proj.weight.mul_(scale)
        embeddings = {id(e): e for e in (model.encoder.embed_tokens, model.decoder.embed_tokens)}
        for embedding in embeddings.values():
            nn.init.normal_(embedding.weight, mean=0.0, std=embedding.embedding_dim ** -0.5)
            if embedding.padding_idx is not None:
                embedding.weight[embedding.padding_idx].zero_()
            embedding.weight.mul_(decoder_scale)


def apply_deepnorm_init(model, encoder_beta: float, decoder_beta: float) -> None:
    """DeepNorm's init (Wang et al. 2022, Fig. 2): Xavier normal with gain beta for the FFN,
    v_proj and out_proj weights (cross-attention included), gain 1 for q_proj and k_proj;
    biases of these projections zero."""
    with torch.no_grad():
        for stack, beta in ((model.encoder, encoder_beta), (model.decoder, decoder_beta)):
            for layer in stack.layers:
                for attn in _attentions(layer):
                    _reinit(attn.q_proj, normal=True)
                    _reinit(attn.k_proj, normal=True)
                    _reinit(attn.v_proj, gain=beta, normal=True)
                    _reinit(attn.out_proj, gain=beta, normal=True)
                for proj in _ffn_projections(layer):
                    _reinit(proj, gain=beta, normal=True)


def apply_model_init(model, scheme: str) -> None:
    """Re-initialise ``model`` with ``scheme`` (layer-level schemes via apply_weight_init)."""
    apply_weight_init(list(model.encoder.layers) + list(model.decoder.layers), scheme)
    if scheme == "tfixup":
        apply_tfixup_init(model)
