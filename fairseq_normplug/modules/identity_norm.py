"""No normalization: the ``identity`` norm type, output = input, no parameters.

The "no norm" baseline of the normalization-free methods (ReZero, T-Fixup, ...): every norm
slot of the Transformer keeps its place but does nothing.
"""
import torch

from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.norm_registry import register_norm, zero_centered_gamma_error


@register_norm("identity")
class IdentityNorm(FormulaNorm):
    """identity(x) = x, for a ``dim``-wide input (``dim`` is kept only for ``repr``)."""

    @classmethod
    def check_args(cls, args):
        if getattr(args, "zero_centered_gamma", False):
            raise NormplugError(zero_centered_gamma_error("identity", "it has no gain"))

    @classmethod
    def build(cls, dim, args, slot):
        return cls(dim)

    def formula(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
