"""SeeDNorm of Cai, Zhu, Liu & Min (2025), "SeeDNorm: Self-Rescaled Dynamic Normalization"
(ICLR 2026, arXiv:2510.22777, section 3, the SeeDNorm equation): RMSNorm whose per-channel
scale depends on the input itself,

    SeeDNorm(x) = [tanh(x . beta^T) * alpha + gamma] (.) x / RMS(x),
    RMS(x) = sqrt(mean_i x_i^2 + eps),

gamma, beta, alpha in R^{1 x D}: gamma RMSNorm's static gain, beta the self-rescaling vector
(x . beta^T is one scalar per token), alpha the per-channel weight of the dynamic term; the
paper's sigma is tanh. The paper's multi-head SeeDNorm splits the D channels into H heads of
D/H and takes one scalar tanh(x_h . beta_h^T) per head (``--seednorm-heads H``; 1, the
default, is the single-head equation above).

No code is published; the inits are the paper's: gamma = 1, beta = 0, alpha = 1, so that at
initialisation SeeDNorm equals RMSNorm (tanh(0) = 0) and beta gets a gradient from the first
step (its gradient carries alpha). eps is ``--norm-eps``, inside the square root as in
``rms_norm.py``. With ``zero_centered_gamma`` (``--zero-centered-gamma``) gamma is stored as
1 + gamma, gamma init 0 (``norm_base.py``).
"""
import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.modules.norm_registry import register_norm
from fairseq_normplug.numeric_flags import number_flag


def seednorm_reference(x: torch.Tensor, weight: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor,
                       eps: float, heads: int = 1) -> torch.Tensor:
    """``[tanh(x_h . beta_h) * alpha + weight] * x / sqrt(mean(x^2) + eps)`` over the last
    dimension, with one dot product per head of ``D / heads`` channels."""
    shape = x.shape
    per_head = x.reshape(*shape[:-1], heads, shape[-1] // heads)
    dynamic = torch.tanh((per_head * beta.view(heads, -1)).sum(-1, keepdim=True))  # (..., heads, 1)
    scale = (dynamic * alpha.view(heads, -1)).reshape(shape) + weight
    return scale * x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


@register_norm("seednorm", per_channel_gain=True)
class SeeDNorm(FormulaNorm):
    """SeeDNorm: per-channel ``weight`` (gamma, init 1), ``beta`` (the self-rescaling vector,
    init 0) and ``alpha`` (init 1), all of width D; ``heads`` dot products x_h . beta_h.
    Computed by ``FormulaNorm.reference``: float32 statistics for fp16/bf16 input."""

    @staticmethod
    def add_args(parser):
        parser.add_argument(
            "--seednorm-heads", metavar="H", **number_flag(int, at_least=1),
            help="SeeDNorm: split the D channels into H heads, one tanh(x_h . beta_h) per head "
                 "(the paper's multi-head SeeDNorm); default 1, the single-head equation")

    @classmethod
    def check_args(cls, args):
        heads = getattr(args, "seednorm_heads", None)
        for dest in ("encoder_embed_dim", "decoder_embed_dim"):
            dim = getattr(args, dest, None)
            if heads and isinstance(dim, int) and dim % heads:
                raise NormplugError(f"--seednorm-heads {heads} does not divide --{dest.replace('_', '-')} "
                                    f"{dim}; choose a divisor of the model width")

    @classmethod
    def build(cls, dim, args, slot):
        """``--norm-eps``, ``--seednorm-heads``, ``--zero-centered-gamma``."""
        return cls(dim, eps=args.norm_eps, heads=args.seednorm_heads or 1,
                   zero_centered_gamma=args.zero_centered_gamma)

    def __init__(self, dim: int, eps: float = 1e-5, heads: int = 1, zero_centered_gamma: bool = False):
        super().__init__(dim, zero_centered_gamma)
        if heads < 1 or dim % heads:
            raise NormplugError(f"SeeDNorm: {heads} heads do not split a width of {dim}")
        self.eps = eps
        self.heads = heads
        self.weight = self.new_gain()
        self.beta = nn.Parameter(torch.zeros(dim))
        self.alpha = nn.Parameter(torch.ones(dim))

    def logged_stats(self):
        """``--norm-stats-interval``: mean |alpha| and mean |beta| (``seed_alpha:<norm>``,
        ``seed_beta:<norm>``): how far the gain moves with the input (the SeeDNorm equation)."""
        return {"seed_alpha": float(self.alpha.detach().float().abs().mean()),
                "seed_beta": float(self.beta.detach().float().abs().mean())}

    def formula(self, x, weight, beta, alpha):
        return seednorm_reference(x, weight, beta, alpha, self.eps, self.heads)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}, heads={self.heads}"
