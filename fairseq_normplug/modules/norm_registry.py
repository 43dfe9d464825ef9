"""The norm layers the plugin offers, behind one ``build_norm`` hook (x-transformers style:
tiny interchangeable classes, one registry)."""
from dataclasses import dataclass
from typing import Optional

from fairseq.modules import LayerNorm
from torch import nn

from fairseq_normplug.modules.dynamic_tanh import SQUASH_FUNCTIONS, DynamicTanh
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm

NORM_TYPES = ("layernorm", "scalenorm", "rmsnorm", "dyt", "identity")
DYT_SQUASH_CHOICES = tuple(SQUASH_FUNCTIONS)

#: where a norm sits; DyT takes a separate alpha init for the attention blocks' norms
ATTENTION, FFN, FINAL = "attention", "ffn", "final"


@dataclass(frozen=True)
class NormSpec:
    """Everything needed to build any norm of a model (resolved from the flags)."""

    norm_type: str = "layernorm"
    eps: float = 1e-5
    scalenorm_fixed_g: bool = False
    dyt_alpha_init: float = 0.5
    dyt_attn_alpha_init: Optional[float] = None
    dyt_squash: str = "tanh"
    dyt_freeze_alpha: bool = False


def build_norm(spec: NormSpec, dim: int, role: str, feeds_output: bool = False) -> nn.Module:
    """One norm layer of type ``spec.norm_type`` for a ``dim``-wide input.

    ``role`` is ATTENTION, FFN or FINAL; ``feeds_output`` marks the norm whose output goes
    to the output layer (its ScaleNorm g stays learnable in the fixed-g variant).
    """
    if spec.norm_type == "layernorm":
        return LayerNorm(dim)
    if spec.norm_type == "scalenorm":
        return ScaleNorm(dim, eps=spec.eps, learnable=feeds_output or not spec.scalenorm_fixed_g)
    if spec.norm_type == "rmsnorm":
        return RMSNorm(dim, eps=spec.eps)
    if spec.norm_type == "dyt":
        alpha = spec.dyt_alpha_init
        if role == ATTENTION and spec.dyt_attn_alpha_init is not None:
            alpha = spec.dyt_attn_alpha_init
        return DynamicTanh(dim, alpha_init=alpha, squash=spec.dyt_squash,
                           learnable_alpha=not spec.dyt_freeze_alpha)
    if spec.norm_type == "identity":
        return IdentityNorm(dim)
    raise ValueError(f"unknown norm type {spec.norm_type!r}; choose from {', '.join(NORM_TYPES)}")
