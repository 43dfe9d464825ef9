"""ScaleNorm of Nguyen & Salazar (2019), "Transformers without Tears", eq. (5)."""
import math

import torch
from torch import nn

from fairseq_normplug.modules import fused
from fairseq_normplug.modules.fused import Kernel, compute_dtype, native_ops, needs_autograd, rows
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.modules.norm_registry import register_norm, zero_centered_gamma_error


def scale_norm_reference(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """``g * x / max(||x||_2, eps)`` over the last dimension, written as in the paper."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=eps)
    return g * x / norm


def _scale_norm_forward(x: torch.Tensor, g: torch.Tensor, eps: float):
    """Eq. (5) on a ``(rows, d)`` matrix: ``y = x * (g / max(||x||, eps))`` (one reduction,
    one scaled copy); also returns the unclamped row norms ``||x||`` for the backward."""
    xf = x.to(compute_dtype(x))
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    y = xf * (g.to(xf.dtype) / norm.clamp(min=eps))
    return y.to(x.dtype), norm


def _scale_norm_backward(grad: torch.Tensor, x: torch.Tensor, norm: torch.Tensor,
                         g: torch.Tensor, eps: float):
    """Hand-derived gradient of eq. (5). With n = ||x||, r = 1 / max(n, eps), s = <x, dy>:
    ``dx = g r (dy - x s r^2 [n >= eps])`` and ``dg = sum_rows s r``."""
    dtype = compute_dtype(x)
    xf, gf = x.to(dtype), grad.to(dtype)
    dot = torch.linalg.vecdot(xf, gf, dim=-1).unsqueeze(-1)
    inv = 1 / norm.clamp(min=eps)
    coef = torch.where(norm >= eps, dot * inv * inv, torch.zeros_like(dot))
    grad_x = torch.addcmul(gf, xf, coef, value=-1).mul_(g.to(dtype) * inv)
    return grad_x.to(grad.dtype), (dot * inv).sum()


scale_norm_forward_kernel = Kernel(_scale_norm_forward)
scale_norm_backward_kernel = Kernel(_scale_norm_backward)


class _ScaleNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, eps):
        x2 = rows(x)
        y, norm = scale_norm_forward_kernel(x2, g, eps)
        ctx.save_for_backward(x2, norm, g)
        ctx.eps = eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, norm, g = ctx.saved_tensors
        grad_x, grad_g = scale_norm_backward_kernel(rows(grad), x2, norm, g, ctx.eps)
        grad_g = grad_g.to(g.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.view(grad.shape), grad_g, None


def scale_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """Fast path of :func:`scale_norm_reference` (same values and gradients, statistics in
    float32 for fp16/bf16 input, output in the input dtype): the native C++ operator or
    fused kernels, see ``fused.py``."""
    ops = native_ops(x, g)
    if ops is not None:
        return ops.scale_norm(x, g, eps)
    if needs_autograd(x, g):
        return _ScaleNormFunction.apply(x, g, eps)
    return scale_norm_forward_kernel(rows(x), g, eps)[0].view(x.shape)


@register_norm("scalenorm", shorthand=True)
class ScaleNorm(FormulaNorm):
    """ScaleNorm(x) = g * x / max(||x||, eps): one learned scalar ``g`` per norm, g0 = sqrt(d).

    Statistics are computed in float32 whatever the input dtype (fp16/bf16 training), and g
    stays float32 when the model is cast to fp16/bf16 (``float32_params.py``), so its
    gradient is summed and stored in float32. ``forward`` runs the fused fast path
    :func:`scale_norm`. ``learnable=False`` freezes g (the paper's fixed-g rows of Table 7).

    No zero-centred variant (``--zero-centered-gamma --scalenorm`` is refused): zero-centred
    gamma (TransformerEngine, Megatron's LayerNorm1p) re-parametrises a per-channel *unit* gain
    (init 1) as 1 + gamma so that weight decay pulls it to 1 and its bf16/fp16 storage is fine
    near 1. g is neither: one scalar scale initialised to sqrt(d), kept in float32. ``1 + gamma``
    would start at 1 instead of sqrt(d) (a different model), and ``sqrt(d) (1 + gamma)`` is a
    reparametrisation no source defines that multiplies g's gradient by sqrt(d), changing
    how Adam moves it.
    """

    @staticmethod
    def add_args(parser):
        parser.add_argument("--scalenorm-fixed-g", action="store_true",
                            help="freeze every ScaleNorm g at sqrt(d) except the norm feeding the output "
                                 "layer (Tears Table 7, 'fixed g')")

    @classmethod
    def check_args(cls, args):
        if getattr(args, "zero_centered_gamma", False):
            raise NormplugError(zero_centered_gamma_error(
                "scalenorm", "its g is one learned scale initialised to sqrt(d), not a per-channel unit gain"))

    @classmethod
    def build(cls, dim, args, slot):
        """``--norm-eps``; with ``--scalenorm-fixed-g`` g is frozen except where it feeds the output."""
        return cls(dim, eps=args.norm_eps, learnable=slot.feeds_output or not args.scalenorm_fixed_g)

    def __init__(self, dim: int, eps: float = 1e-5, learnable: bool = True):
        super().__init__(dim)
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)), requires_grad=learnable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_norm(x, self.g, self.eps)

    def formula(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """:func:`scale_norm_reference` (``reference(x)`` runs it in float32)."""
        return scale_norm_reference(x, g, self.eps)

    def fast_path(self, x: torch.Tensor) -> str:
        """Which path ``forward(x)`` takes: native, compiled or eager (``fused.py``)."""
        return fused.path(scale_norm_forward_kernel, x, self.g)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, learnable={self.g.requires_grad}"
