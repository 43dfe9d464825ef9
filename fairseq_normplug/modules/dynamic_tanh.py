"""Dynamic Tanh of Zhu et al. (2025), "Transformers without Normalization", eq. (1):
DyT(x) = gamma * tanh(alpha * x) + beta, a drop-in replacement for a norm layer."""
import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.modules.precision import upcast

SQUASH_FUNCTIONS = {
    "tanh": torch.tanh,
    "hardtanh": F.hardtanh,
    "sigmoid": torch.sigmoid,
}


def dynamic_tanh_reference(x, alpha, weight, bias, squash: str = "tanh"):
    """``weight * squash(alpha * x) + bias`` elementwise (section 4 of the DyT paper)."""
    return weight * SQUASH_FUNCTIONS[squash](alpha * x) + bias


class DynamicTanh(nn.Module):
    """DyT: one learnable scalar ``alpha`` (init ``alpha_init``, default 0.5), a per-channel
    gain ``weight`` (gamma, init 1) and shift ``bias`` (beta, init 0).

    ``squash`` selects tanh (the paper's choice), hardtanh or sigmoid (its ablation,
    Table 9); ``learnable_alpha=False`` freezes alpha (the "without alpha" ablation).
    Computed in float32 whatever the input dtype.
    """

    def __init__(
        self,
        dim: int,
        alpha_init: float = 0.5,
        squash: str = "tanh",
        learnable_alpha: bool = True,
    ):
        super().__init__()
        if squash not in SQUASH_FUNCTIONS:
            raise ValueError(
                f"unknown DyT squash function {squash!r}; choose from {sorted(SQUASH_FUNCTIONS)}"
            )
        if not alpha_init > 0:
            raise ValueError(f"DyT alpha init must be positive, got {alpha_init}")
        self.dim = dim
        self.squash = squash
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)), requires_grad=learnable_alpha)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dynamic_tanh_reference(
            upcast(x), upcast(self.alpha), upcast(self.weight), upcast(self.bias), self.squash
        )
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, alpha_init={self.alpha.item():.3g}, squash={self.squash}, "
            f"learnable_alpha={self.alpha.requires_grad}"
        )
