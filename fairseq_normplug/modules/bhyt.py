"""BHyT, bounded hyperbolic tanh (arXiv 2601.09719, 2026; authors' code MLAI-Yonsei/BHyT,
commit e170c9b): a DyT successor whose tanh input is bounded by the token's RMS statistic,

    BHyT(x) = weight * tanh(lam * x / (kappa * sqrt(mean_i x_i^2 + eps))),

so that |lam x / (kappa RMS(x))| stays of order lam / kappa whatever the scale of x (DyT's
tanh(alpha x) saturates when the activations grow with depth). Transcribed from the authors'
``models/hf_src/llama/modeling_llama.py``:

- the norm: ``BHyT_Star.forward``, lines 95-101 (``var_x = mean(x*x)`` in float32,
  ``alpha = lam * rsqrt(var_x + eps) * inv_kappa``, ``weight * tanh(alpha * x)``); it is the
  same map as their block-level ``BHyT`` input norm (``BHyT.forward`` line 209 with ``rstd1``
  of ``LayerWiseVarApprox``, line 228);
- the defaults: lam init 2.0 (line 72, ``lam_init: float = 2.0``), learnable
  (``config/norm_config_bhyt.yaml:5``, ``learnable_lam: True``); kappa 10
  (``src/llamafactory/hparams/model_args.py:204-206``, ``bhyt_kappa`` default 10.0, read at
  modeling_llama.py:536; ``inv_kappa = 1/kappa``, line 550); eps 1e-6 (lines 72, 112, 228);
  weight (gamma) init 1 (line 93); no bias.

Scope: this norm type is the per-norm form above (their ``bhytstar``), identical to their BHyT
at every block's first norm. Being a per-token map it composes with every placement, and
incremental decoding equals the full forward. The authors' full "bhyt" norm type (lines 567-596,
989-1095) computes the statistic once per block: the block's second norm (post-attention) does
not measure its own input but predicts its variance from the block input's, ``var_x + c_attn *
lam^2 / kappa^2`` (lines 242, 279; :func:`predicted_variance`), with ``c_attn = ||W_V W_O||_F^2 /
(seq_len d)`` from the attention weights (``update_scaler``, lines 623-661). That couples two
norms and the attention's weights; it is ``--bhyt-block-statistics``
(``models/placements/bhyt_block.py``), which gives this module's norms their statistic with
:meth:`BHyT.from_variance`.

With ``zero_centered_gamma`` (``--zero-centered-gamma``) the gain applied is 1 + gamma, gamma
init 0 (``norm_base.py``).
"""
import torch
from torch import nn

from fairseq_normplug.modules.fused import upcast
from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.modules.norm_registry import register_norm
from fairseq_normplug.numeric_flags import number_flag

#: the authors' lam init (modeling_llama.py:72)
BHYT_DEFAULT_LAM = 2.0
#: the authors' kappa (model_args.py:204-206)
BHYT_DEFAULT_KAPPA = 10.0
#: the authors' eps, inside the square root (modeling_llama.py:72, 228)
BHYT_EPS = 1e-6


def bhyt_from_variance(x: torch.Tensor, variance: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
                       kappa: float, eps: float = BHYT_EPS) -> torch.Tensor:
    """``weight * tanh(lam * x / (kappa * sqrt(variance + eps)))``: BHyT with its statistic
    ``variance`` (one value per token, last dimension kept) given, measured or predicted (the
    authors' ``BHyT.forward``, line 209, with ``rstd = rsqrt(variance + 1e-6) / kappa``, lines 228, 247)."""
    bound = lam * torch.rsqrt(variance + eps) / kappa
    return weight * torch.tanh(bound * x)


def bhyt_reference(x: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor, kappa: float,
                   eps: float = BHYT_EPS) -> torch.Tensor:
    """``weight * tanh(lam * x / (kappa * sqrt(mean(x^2) + eps)))`` over the last dimension."""
    return bhyt_from_variance(x, x.pow(2).mean(dim=-1, keepdim=True), lam, weight, kappa, eps)


def predicted_variance(measured: torch.Tensor, c_attn: torch.Tensor, lam: torch.Tensor,
                       kappa: float) -> torch.Tensor:
    """The authors' prediction of the variance after an attention sublayer from the one of its
    input (``LayerWiseVarApproxParrallel.compute_rstd2``, modeling_llama.py:262-285, the baseline
    method, line 279): ``measured + c_attn * lam^2 / kappa^2``, ``lam`` the BHyT in front of the
    attention (its output has variance about lam^2 / kappa^2), ``c_attn`` the attention's
    variance gain (``models/placements/bhyt_block.py``)."""
    return measured + c_attn * (lam.square() * (1.0 / kappa) ** 2)


@register_norm("bhyt", per_channel_gain=True)
class BHyT(FormulaNorm):
    """BHyT: a learnable scalar ``lam`` (init ``lam_init``), a per-channel gain ``weight``
    (gamma, init 1), a fixed ``kappa``. Computed by ``FormulaNorm.reference``: float32
    statistics for fp16/bf16 input (the authors take ``var_x`` in float32, line 96)."""

    @staticmethod
    def add_args(parser):
        parser.add_argument(
            "--bhyt-lam-init", metavar="L", **number_flag(float, above=0),
            help=f"BHyT: initial value of the learnable scalar lam (default {BHYT_DEFAULT_LAM}, the "
                 "BHyT authors' code)")
        parser.add_argument(
            "--bhyt-kappa", metavar="K", **number_flag(float, above=0),
            help=f"BHyT: kappa, the tanh input is lam x / (kappa RMS(x)) (default {BHYT_DEFAULT_KAPPA}, "
                 "the BHyT authors' code)")

    @classmethod
    def build(cls, dim, args, slot):
        """``--bhyt-lam-init``, ``--bhyt-kappa``, ``--zero-centered-gamma``."""
        lam = args.bhyt_lam_init if args.bhyt_lam_init is not None else BHYT_DEFAULT_LAM
        kappa = args.bhyt_kappa if args.bhyt_kappa is not None else BHYT_DEFAULT_KAPPA
        return cls(dim, lam_init=lam, kappa=kappa, zero_centered_gamma=args.zero_centered_gamma)

    def __init__(self, dim: int, lam_init: float = BHYT_DEFAULT_LAM, kappa: float = BHYT_DEFAULT_KAPPA,
                 zero_centered_gamma: bool = False):
        super().__init__(dim, zero_centered_gamma)
        if not lam_init > 0 or not kappa > 0:
            raise ValueError(f"BHyT lam init and kappa must be positive, got {lam_init} and {kappa}")
        self.kappa = float(kappa)
        self.lam = nn.Parameter(torch.tensor(float(lam_init)))
        self.weight = self.new_gain()

    def formula(self, x, lam, weight):
        return bhyt_reference(x, lam, weight, self.kappa)

    def from_variance(self, x: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
        """This norm with its statistic ``variance`` given (float32 for fp16/bf16 ``x``, as
        ``reference``; the output in ``x``'s dtype): ``--bhyt-block-statistics``."""
        weight = upcast(self.gain())
        return bhyt_from_variance(upcast(x), variance, upcast(self.lam), weight, self.kappa).to(x.dtype)

    def logged_stats(self):
        """``--norm-stats-interval``: lam (``bhyt_lam:<norm>``)."""
        return {"bhyt_lam": float(self.lam.detach())}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kappa={self.kappa}, eps={BHYT_EPS}"
