"""No normalization: the ``identity`` norm type, output = input, no parameters.

The "no norm" baseline of the normalization-free methods (ReZero, T-Fixup, ...): every norm
slot of the Transformer keeps its place but does nothing.
"""
import torch

from fairseq_normplug.modules.norm_base import FormulaNorm


class IdentityNorm(FormulaNorm):
    """identity(x) = x, for a ``dim``-wide input (``dim`` is kept only for ``repr``)."""

    def formula(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
