"""ScaleNorm of Nguyen & Salazar (2019), "Transformers without Tears", eq. (8)."""
import math

import torch
from torch import nn

from fairseq_normplug.modules.precision import upcast


def scale_norm_reference(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """``g * x / max(||x||_2, eps)`` over the last dimension, written as in the paper."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=eps)
    return g * x / norm


class ScaleNorm(nn.Module):
    """ScaleNorm(x) = g * x / max(||x||, eps): one learned scalar ``g`` per norm, g0 = sqrt(d).

    Statistics are computed in float32 whatever the input dtype (fp16/bf16 training).
    ``learnable=False`` freezes g (the paper's fixed-g rows of Table 7).
    """

    def __init__(self, dim: int, eps: float = 1e-5, learnable: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)), requires_grad=learnable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_norm_reference(upcast(x), upcast(self.g), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, learnable={self.g.requires_grad}"
