"""Weight initialisations compared in "Transformers without Tears", section 2.2 and Table 2.

* ``fairseq``: fairseq's own (q/k/v Xavier-uniform with gain 1/sqrt(2), out_proj gain 1,
  FFN PyTorch default); nothing is touched.
* ``xavier``: the paper's "default" baseline, Xavier normal everywhere (eq. 5): attention
  std sqrt(2/(d+d)) = sqrt(1/d), FFN std sqrt(2/(d+d_ff)); biases zero.
* ``smallinit``: SmallInit, attention q/k/v/out ~ N(0, sqrt(2/(5d))) (eq. 6), FFN Xavier
  normal, biases zero.
"""
import math

from torch import nn

WEIGHT_INITS = ("fairseq", "xavier", "smallinit")


def _attention_projections(attn):
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj]


def _ffn_projections(layer):
    return [layer.fc1, layer.fc2]


def apply_weight_init(layers, scheme: str) -> None:
    """Re-initialise the attention and FFN weights of Transformer ``layers`` in place."""
    if scheme not in WEIGHT_INITS:
        raise ValueError(f"unknown weight init {scheme!r}; choose from {', '.join(WEIGHT_INITS)}")
    if scheme == "fairseq":
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
