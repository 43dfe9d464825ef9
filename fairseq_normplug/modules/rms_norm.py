"""RMSNorm of Zhang & Sennrich (2019), compared with ScaleNorm in Table 7 of
"Transformers without Tears": x / rms(x) * g_i, a gain per unit and no bias.
With ``zero_centered_gamma`` (``--zero-centered-gamma``) g_i = 1 + gamma_i, gamma init 0
(``norm_base.py``)."""
import torch

from fairseq_normplug.modules import fused
from fairseq_normplug.modules.fused import Kernel, compute_dtype, native_ops, needs_autograd, rows
from fairseq_normplug.modules.norm_base import FormulaNorm, zero_centered_repr
from fairseq_normplug.modules.norm_registry import register_norm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """RMSNorm on a ``(rows, d)`` matrix: ``y = x * r * g`` with ``r = 1/sqrt(mean x^2 + eps)``
    (one reduction, one fused scale); also returns ``r`` for the backward."""
    xf = x.to(compute_dtype(x))
    sum_sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square()
    inv_rms = torch.rsqrt(sum_sq / x.shape[-1] + eps)
    return (xf * inv_rms * weight.to(xf.dtype)).to(x.dtype), inv_rms


def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, inv_rms: torch.Tensor,
                       weight: torch.Tensor):
    """Hand-derived gradient of RMSNorm. With u = dy * g and r as in the forward:
    ``dx = r (u - x r^2 mean(u x))`` and ``dg = sum_rows dy x r``."""
    dtype = compute_dtype(x)
    xf, gf = x.to(dtype), grad.to(dtype)
    u = gf * weight.to(dtype)
    coef = torch.linalg.vecdot(u, xf, dim=-1).unsqueeze(-1) * (inv_rms * inv_rms / x.shape[-1])
    grad_x = torch.addcmul(u, xf, coef, value=-1).mul_(inv_rms)
    grad_weight = (gf * xf * inv_rms).sum(0)
    return grad_x.to(grad.dtype), grad_weight


rms_norm_forward_kernel = Kernel(_rms_norm_forward)
rms_norm_backward_kernel = Kernel(_rms_norm_backward)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = rows(x)
        y, inv_rms = rms_norm_forward_kernel(x2, weight, eps)
        ctx.save_for_backward(x2, inv_rms, weight)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, inv_rms, weight = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward_kernel(rows(grad), x2, inv_rms, weight)
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.view(grad.shape), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fast path of :func:`rms_norm_reference` (same values and gradients, statistics in
    float32 for fp16/bf16 input, output in the input dtype): the native C++ operator or
    fused kernels, see ``fused.py``."""
    ops = native_ops(x, weight)
    if ops is not None:
        return ops.rms_norm(x, weight, eps)
    if needs_autograd(x, weight):
        return _RMSNormFunction.apply(x, weight, eps)
    return rms_norm_forward_kernel(rows(x), weight, eps)[0].view(x.shape)


@register_norm("rmsnorm", shorthand=True, per_channel_gain=True)
class RMSNorm(FormulaNorm):
    """RMSNorm(x)_i = g_i * x_i / sqrt(mean_j x_j^2 + eps); g initialised to ones.

    Statistics are computed in float32 whatever the input dtype. ``forward`` runs the fused
    fast path :func:`rms_norm`. ``zero_centered_gamma=True``: ``weight`` holds gamma (init 0)
    and g = 1 + gamma, passed to the fast path as its weight (``norm_base.py``).
    """

    @classmethod
    def build(cls, dim, args, slot):
        """``--norm-eps``, ``--zero-centered-gamma``."""
        return cls(dim, eps=args.norm_eps, zero_centered_gamma=args.zero_centered_gamma)

    def __init__(self, dim: int, eps: float = 1e-5, zero_centered_gamma: bool = False):
        super().__init__(dim, zero_centered_gamma)
        self.eps = eps
        self.weight = self.new_gain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.gain(), self.eps)

    def formula(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """:func:`rms_norm_reference` (``reference(x)`` runs it in float32)."""
        return rms_norm_reference(x, weight, self.eps)

    def fast_path(self, x: torch.Tensor) -> str:
        """Which path ``forward(x)`` takes: native, compiled or eager (``fused.py``)."""
        return fused.path(rms_norm_forward_kernel, x, self.weight)

    def extra_repr(self) -> str:
        return ", ".join([f"{self.dim}, eps={self.eps}", *zero_centered_repr(self)])
