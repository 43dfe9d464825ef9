"""LayerNorm with a zero-centred gain, the ``layernorm`` type under ``--zero-centered-gamma``:
Megatron-LM's ``LayerNorm1p`` (``--apply-layernorm-1p``), NVIDIA TransformerEngine's
``LayerNorm(zero_centered_gamma=True)``:

    LayerNorm1p(x) = (1 + gamma) * (x - mean(x)) / sqrt(var(x) + eps) + beta

with gamma and beta initialised to 0, so at init it equals a stock LayerNorm (gain 1, bias 0)
and weight decay pulls the applied gain towards 1, not 0. gamma and beta keep the stock
parameter names ``weight`` and ``bias`` (TransformerEngine and Megatron do the same), so a
checkpoint has the same keys; what ``weight`` means is recorded by the ``zero_centered_gamma``
flag in the checkpoint's saved args, which rebuilds this module when it is loaded.
"""
import torch
import torch.nn.functional as F
from fairseq.modules import layer_norm as fairseq_layer_norm
from torch import nn

from fairseq_normplug.modules.fused import upcast
from fairseq_normplug.modules.norm_base import effective_gain
from fairseq_normplug.modules.norm_registry import register_norm


class LayerNorm1p(nn.LayerNorm):
    """torch's LayerNorm (what fairseq builds on CPU) whose ``weight`` is gamma (init 0) and
    whose applied gain is ``1 + gamma``. Computed by ``F.layer_norm`` (torch's fused kernel on
    CPU and GPU) with the effective gain; in float32 for fp16/bf16 input (the plugin's other
    norms do the same), the output in the input's dtype."""

    #: ``weight`` holds gamma; the applied gain is 1 + gamma (``norm_base.effective_gain``)
    zero_centered_gamma = True

    def __init__(self, normalized_shape, eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        gain = effective_gain(self).to(xf.dtype)
        return F.layer_norm(xf, self.normalized_shape, gain, self.bias.to(xf.dtype), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", zero_centered_gamma=True"


@register_norm("layernorm", per_channel_gain=True)
class LayerNormType:
    """LayerNorm (Ba et al. 2016, eq. 4), the stock norm: gamma * (x - mean) / sqrt(var + eps)
    + beta, built exactly as fairseq builds it (``fairseq.modules.LayerNorm``), or as
    :class:`LayerNorm1p` under ``--zero-centered-gamma``."""

    #: what it builds: torch's LayerNorm (fairseq's on CPU; LayerNorm1p is one) or apex's fused one
    module_classes = tuple(c for c in (nn.LayerNorm, getattr(fairseq_layer_norm, "FusedLayerNorm", None)) if c)

    @classmethod
    def build(cls, dim, args, slot):
        return LayerNorm1p(dim) if getattr(args, "zero_centered_gamma", False) else fairseq_layer_norm.LayerNorm(dim)
