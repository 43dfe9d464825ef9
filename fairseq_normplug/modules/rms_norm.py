"""RMSNorm of Zhang & Sennrich (2019), compared with ScaleNorm in Table 7 of
"Transformers without Tears": x / rms(x) * g_i, a gain per unit and no bias."""
import torch
from torch import nn

from fairseq_normplug.modules.precision import upcast


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    """RMSNorm(x)_i = g_i * x_i / sqrt(mean_j x_j^2 + eps); g initialised to ones.

    Statistics are computed in float32 whatever the input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(upcast(x), upcast(self.weight), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
