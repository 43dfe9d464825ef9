"""Dynamic erf (Derf) of Chen, Lu, Zhu, Sun & Liu (2025), "Stronger Normalization-Free
Transformers" (arXiv:2512.10938): the point-wise function Derf(x) = erf(alpha x + s) of the
paper, with DyT's per-channel affine, as in the authors' code (zlab-princeton/Derf,
``Dynamic_erf``): Derf(x) = gamma * erf(alpha * x + s) + beta.

The paper text available to us gives no equation number; the defaults alpha0 = 0.5 and
s0 = 0 are the authors' code defaults (``alpha_init_value=0.5, shift_init_value=0.0``).
With ``zero_centered_gamma`` (``--zero-centered-gamma``) the gain applied is 1 + gamma,
gamma init 0 (``norm_base.py``).

``affine=False`` (``--derf-no-affine``): no gamma and beta, Derf(x) = erf(alpha x + s), as the
authors' DiT module with ``elementwise_affine=False`` (zlab-princeton/Derf
``DiT/dynamic_erf.py:15-25``). The authors' alpha and s are always one scalar each
(``torch.ones(1)``, ``ViT/dynamic_erf.py:14,17``, ``DiT/dynamic_erf.py:14,18``), so there is
no per-channel alpha for Derf. Their (1,)-shaped alpha and s load into our 0-dim parameters
(torch's ``Module._load_from_state_dict`` copies a (1,) entry into a 0-dim parameter).
"""
import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.norm_base import FormulaNorm, inverse_std
from fairseq_normplug.modules.norm_registry import register_norm, scale_init, scale_init_flag

DERF_DEFAULT_ALPHA = 0.5


@register_norm("derf", per_channel_gain=True)
class Derf(FormulaNorm):
    """Derf: learnable scalars ``alpha`` (init ``alpha_init``) and ``shift`` (s, init 0), a
    per-channel gain ``weight`` (gamma, init 1) and ``bias`` (beta, init 0).
    ``init_from_input`` sets alpha0 = 1/std of the input (``--derf-alpha-init auto``).
    ``zero_centered_gamma=True``: ``weight`` holds gamma (init 0), the gain is 1 + gamma.
    ``affine=False``: no ``weight`` and ``bias``, erf(alpha x + s) (module docstring)."""

    auto_init_parameter = "alpha"
    scale_init_flags = ("derf_alpha_init",)

    @staticmethod
    def add_args(parser):
        parser.add_argument(
            "--derf-alpha-init", metavar="A|auto", **scale_init_flag(),
            help=f"Derf alpha initial value (default {DERF_DEFAULT_ALPHA}, the Derf authors' code); "
                 "auto: 1/std of each norm's input on the first training batch; the shift s starts at 0")
        parser.add_argument(
            "--derf-no-affine", action="store_true",
            help="ablation: Derf without its per-channel gain and bias, erf(alpha x + s) (the Derf "
                 "authors' elementwise_affine=False)")

    @classmethod
    def check_args(cls, args):
        if args.derf_no_affine and getattr(args, "zero_centered_gamma", False):
            raise NormplugError("--derf-no-affine cannot be combined with --zero-centered-gamma: without "
                                "the affine there is no gamma to store zero-centred")

    @classmethod
    def build(cls, dim, args, slot):
        return scale_init(DERF_DEFAULT_ALPHA if args.derf_alpha_init is None else args.derf_alpha_init,
                          lambda a: cls(dim, alpha_init=a, zero_centered_gamma=args.zero_centered_gamma,
                                        affine=not args.derf_no_affine),
                          DERF_DEFAULT_ALPHA)

    def __init__(self, dim: int, alpha_init: float = DERF_DEFAULT_ALPHA, shift_init: float = 0.0,
                 zero_centered_gamma: bool = False, affine: bool = True):
        super().__init__(dim, zero_centered_gamma)
        if not alpha_init > 0:
            raise ValueError(f"Derf alpha init must be positive, got {alpha_init}")
        if zero_centered_gamma and not affine:
            raise ValueError("a Derf without affine has no gamma to zero-centre")
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.shift = nn.Parameter(torch.tensor(float(shift_init)))
        if affine:
            self.weight = self.new_gain()
            self.bias = nn.Parameter(torch.zeros(dim))

    def formula(self, x, alpha, shift, weight=None, bias=None):
        squashed = torch.erf(alpha * x + shift)
        return squashed if weight is None else weight * squashed + bias

    def init_from_input(self, mean: float, mean_square: float) -> float:
        return self.set_scalar("alpha", inverse_std(mean, mean_square))
