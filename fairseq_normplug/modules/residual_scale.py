"""Scaled residual connections, installed through fairseq's ``residual_connection(x, residual)``
hook of every Transformer layer (x is the sublayer output F(.) after dropout):

* ``rezero`` (Bachlechner et al. 2020, "ReZero is All You Need", section 3):
  residual + a * F, a learnable scalar per sublayer initialised to 0, so every layer is the
  identity at initialisation (the authors' Transformer code shares one a between the
  sublayers of a layer; here each sublayer has its own, like LayerScale's diag).
* ``layerscale`` (Touvron et al. 2021, "Going deeper with Image Transformers" (CaiT), section 2.1):
  residual + diag(lambda) F, a learnable per-channel vector per sublayer initialised to
  eps = 0.1 for depth <= 18, 1e-5 up to depth 24 and 1e-6 deeper (section 2.1).
* ``deepnorm`` (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers", Fig. 2 and
  Table 1, encoder-decoder column): PostNorm(residual * alpha + F), with
  encoder alpha = 0.81 (N^4 M)^(1/16), decoder alpha = (3M)^(1/4); its beta-scaled init is
  :func:`fairseq_normplug.modules.weight_init.apply_deepnorm_init`.
"""
from typing import Dict

import torch
from torch import nn

RESIDUAL_SCALES = ("none", "rezero", "layerscale", "deepnorm")


def layerscale_init(depth: int) -> float:
    """CaiT's initial diag value for a stack of ``depth`` layers (Touvron et al. 2021, 2.1)."""
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


def deepnorm_constants(encoder_layers: int, decoder_layers: int) -> Dict[str, float]:
    """DeepNet's encoder-decoder constants (Wang et al. 2022, Table 1) for N encoder and M
    decoder layers: residual weights alpha and init gains beta."""
    n, m = encoder_layers, decoder_layers
    return {
        "encoder_alpha": 0.81 * (n ** 4 * m) ** (1 / 16),
        "encoder_beta": 0.87 * (n ** 4 * m) ** (-1 / 16),
        "decoder_alpha": (3 * m) ** (1 / 4),
        "decoder_beta": (12 * m) ** (-1 / 4),
    }


class ResidualScale(nn.Module):
    """``forward(x, residual)`` of one Transformer layer with ``num_sublayers`` residual
    connections, called once per sublayer in order (self-attention, [cross-attention], FFN)."""

    def __init__(self, kind: str, num_sublayers: int, dim: int, alpha: float = 1.0,
                 layerscale_eps: float = 0.1):
        super().__init__()
        if kind not in RESIDUAL_SCALES[1:]:
            raise ValueError(f"unknown residual scale {kind!r}; choose from {', '.join(RESIDUAL_SCALES[1:])}")
        self.kind = kind
        self.num_sublayers = num_sublayers
        self.alpha = alpha
        self.gains = None
        if kind == "rezero":
            self.gains = nn.Parameter(torch.zeros(num_sublayers))
        elif kind == "layerscale":
            self.gains = nn.Parameter(torch.full((num_sublayers, dim), float(layerscale_eps)))
        self.calls = 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.gains is None:
            return residual * self.alpha + x
        # modulo: layers wrapped by --checkpoint-activations re-run forward in backward
        index = self.calls % self.num_sublayers
        self.calls += 1
        return residual + self.gains[index] * x

    def extra_repr(self) -> str:
        detail = f"alpha={self.alpha:.4f}" if self.kind == "deepnorm" else f"sublayers={self.num_sublayers}"
        return f"{self.kind}, {detail}"


class ResidualScaledLayer:
    """Mixin put in front of a fairseq Transformer layer class: its residual connections go
    through the layer's ``residual_scale`` module."""

    def residual_connection(self, x, residual):
        return self.residual_scale(x, residual)

    def forward(self, *args, **kwargs):
        self.residual_scale.calls = 0
        return super().forward(*args, **kwargs)


_SCALED_CLASSES: Dict[type, type] = {}


def _scaled_class(cls: type) -> type:
    if cls not in _SCALED_CLASSES:
        _SCALED_CLASSES[cls] = type(f"ResidualScaled{cls.__name__}", (ResidualScaledLayer, cls), {})
    return _SCALED_CLASSES[cls]


def install_residual_scale(model, kind: str) -> None:
    """Give every encoder/decoder layer of ``model`` a ``residual_scale`` of ``kind``."""
    if kind == "none":
        return
    n, m = len(model.encoder.layers), len(model.decoder.layers)
    constants = deepnorm_constants(n, m)
    for stack, alpha, depth in ((model.encoder, constants["encoder_alpha"], n),
                                (model.decoder, constants["decoder_alpha"], m)):
        for layer in stack.layers:
            sublayers = 2 + (getattr(layer, "encoder_attn", None) is not None)
            layer.residual_scale = ResidualScale(kind, sublayers, layer.embed_dim, alpha=alpha,
                                                 layerscale_eps=layerscale_init(depth))
            layer.__class__ = _scaled_class(type(layer))
