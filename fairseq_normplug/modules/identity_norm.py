"""No normalization: the ``identity`` norm type, output = input, no parameters.

The "no norm" baseline of the normalization-free methods (ReZero, T-Fixup, ...): every norm
slot of the Transformer keeps its place but does nothing.
"""
import torch
from torch import nn


class IdentityNorm(nn.Module):
    """identity(x) = x, for a ``dim``-wide input (``dim`` is kept only for ``repr``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.dim}"
