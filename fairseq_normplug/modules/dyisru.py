"""Dynamic Inverse Square Root Unit (DyISRU) of Stollenwerk (2025), "On the Mathematical
Relationship Between Layer Normalization and Dynamic Activation Functions" (arXiv:2503.21708,
EACL 2026): the exact element-wise counterpart of RMSNorm,

    y_i = sqrt(C) * x_i / sqrt(beta + x_i^2)

RMSNorm is ``sqrt(C) x_i / sqrt(x_i^2 + sum_{j != i} x_j^2)``; DyISRU replaces the other
channels' sum of squares by one learnable scalar beta. We add RMSNorm's per-channel gain
gamma (``weight``, init 1) and, like RMSNorm, no bias. beta is clamped at ``eps`` so the
denominator stays positive.

Init: the paper trains no model and states no beta0 (its fit to simulated outliers gives
301.1); we take beta0 = C - 1, the other channels' sum of squares for a unit-variance input,
so DyISRU starts as RMSNorm does on such input. ``init_from_input`` (``--dyisru-beta-init
auto``) sets beta0 = (C - 1) * mean(x^2) of the actual input.

With ``zero_centered_gamma`` (``--zero-centered-gamma``) the gain applied is 1 + gamma,
gamma init 0 (``norm_base.py``).
"""
import math

import torch
from torch import nn

from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.modules.norm_registry import register_norm, scale_init, scale_init_flag


def default_beta(dim: int) -> float:
    """beta0 = C - 1 (at least 1): RMSNorm's denominator for a unit-variance input."""
    return float(max(dim - 1, 1))


@register_norm("dyisru", per_channel_gain=True)
class DyISRU(FormulaNorm):
    """DyISRU: a learnable scalar ``beta`` (init ``beta_init``, default C - 1) and a
    per-channel gain ``weight`` (gamma, init 1; or init 0 and gain 1 + gamma with
    ``zero_centered_gamma=True``)."""

    auto_init_parameter = "beta"
    scale_init_flags = ("dyisru_beta_init",)

    @staticmethod
    def add_args(parser):
        parser.add_argument(
            "--dyisru-beta-init", metavar="B|auto", **scale_init_flag(),
            help="DyISRU beta initial value (default d-1: RMSNorm's value for unit-variance input); "
                 "auto: (d-1)*mean(x^2) of each norm's input on the first training batch")

    @classmethod
    def build(cls, dim, args, slot):
        """``--dyisru-beta-init`` (default C - 1), ``--norm-eps``, ``--zero-centered-gamma``."""
        return scale_init(args.dyisru_beta_init,
                          lambda b: cls(dim, beta_init=b, eps=args.norm_eps, zero_centered_gamma=args.zero_centered_gamma),
                          None)

    def __init__(self, dim: int, beta_init: float = None, eps: float = 1e-5,
                 zero_centered_gamma: bool = False):
        super().__init__(dim, zero_centered_gamma)
        beta_init = default_beta(dim) if beta_init is None else beta_init
        if not beta_init > 0:
            raise ValueError(f"DyISRU beta init must be positive, got {beta_init}")
        self.eps = eps
        self.beta = nn.Parameter(torch.tensor(float(beta_init)))
        self.weight = self.new_gain()

    def formula(self, x, beta, weight):
        return weight * math.sqrt(self.dim) * x * torch.rsqrt(beta.clamp(min=self.eps) + x * x)

    def init_from_input(self, mean: float, mean_square: float) -> float:
        return self.set_scalar("beta", max(default_beta(self.dim) * mean_square, self.eps))
