"""Dynamic Tanh of Zhu et al. (2025), "Transformers without Normalization", eq. (1):
DyT(x) = gamma * tanh(alpha * x) + beta, a drop-in replacement for a norm layer.
With ``zero_centered_gamma`` (``--zero-centered-gamma``) the gain applied is 1 + gamma,
gamma init 0 (``norm_base.py``).

Two ablations users of the authors' code ask for: ``alpha_per_channel``
(``--dyt-alpha-per-channel``, erogol/BlaGPT issue 4) makes alpha a d-vector, every channel
starting at the same alpha0; ``affine=False`` (``--dyt-no-affine``, jiachenzhu/DyT issues 2
and 10) drops gamma and beta, DyT(x) = tanh(alpha x), as the authors' DiT module does with
``elementwise_affine=False`` (jiachenzhu/DyT ``other_tasks/DiT/dynamic_tanh.py:12-20``).

The authors' modules store alpha with shape (1,) (``dynamic_tanh.py:13``); ours is a 0-dim
scalar (a d-vector when per channel). Their state dicts load as they are: torch's
``Module._load_from_state_dict`` copies a (1,) entry into a 0-dim parameter (its "loading
1-dim tensor from 0.3.*" rule), and this project's own 0-dim checkpoints keep loading."""
import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.modules import fused, native
from fairseq_normplug.modules.fused import Kernel, compute_dtype, native_ops, needs_autograd, rows
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.norm_base import FormulaNorm, inverse_std, zero_centered_repr
from fairseq_normplug.modules.norm_registry import ATTENTION, register_norm, scale_init, scale_init_flag

#: the paper's default alpha0 (section 7, "alpha0 = 0.5 for non-LLM models")
DYT_DEFAULT_ALPHA = 0.5

#: |alpha x| above this is the flat part of tanh (tanh(2) = 0.96): the DyT paper's
#: extreme inputs it squashes (sections 3-4)
SATURATION_THRESHOLD = 2.0

SQUASH_FUNCTIONS = {
    "tanh": torch.tanh,
    "hardtanh": F.hardtanh,
    "sigmoid": torch.sigmoid,
}


def dynamic_tanh_reference(x, alpha, weight=None, bias=None, squash: str = "tanh"):
    """``weight * squash(alpha * x) + bias`` elementwise (section 4 of the DyT paper);
    ``squash(alpha * x)`` without ``weight`` and ``bias`` (no affine)."""
    squashed = SQUASH_FUNCTIONS[squash](alpha * x)
    return squashed if weight is None else weight * squashed + bias


def _squash_and_slope(z: torch.Tensor, squash: str):
    """``squash(z)`` and its derivative ``squash'(z)``."""
    if squash == "tanh":
        t = fused.tanh(z)
        return t, 1 - t * t
    if squash == "hardtanh":
        return z.clamp(-1, 1), ((z > -1) & (z < 1)).to(z.dtype)
    t = torch.sigmoid(z)
    return t, t * (1 - t)


def _dynamic_tanh_forward(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor, squash: str):
    """Eq. (1) on a ``(rows, d)`` matrix in one elementwise pass: ``y = g squash(a x) + b``."""
    dtype = compute_dtype(x)
    t = _squash_and_slope(x.to(dtype) * alpha.to(dtype), squash)[0]
    return torch.addcmul(bias.to(dtype), t, weight.to(dtype)).to(x.dtype)


def _dynamic_tanh_backward(grad: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor,
                           weight: torch.Tensor, squash: str):
    """Hand-derived gradient of eq. (1), squash recomputed from x (nothing but x is saved).
    With z = a x and e = dy g squash'(z): ``dx = a e``, ``da = sum e x`` (summed over rows
    only for a per-channel alpha), ``dg = sum_rows dy squash(z)``, ``db = sum_rows dy``."""
    dtype = compute_dtype(x)
    xf, gf = x.to(dtype), grad.to(dtype)
    a = alpha.to(dtype)
    t, slope = _squash_and_slope(xf * a, squash)
    e = gf * weight.to(dtype) * slope
    grad_alpha = (e * xf).sum(0) if alpha.dim() else (e * xf).sum()
    return (e * a).to(grad.dtype), grad_alpha, (gf * t).sum(0), gf.sum(0)


dynamic_tanh_forward_kernel = Kernel(_dynamic_tanh_forward)
dynamic_tanh_backward_kernel = Kernel(_dynamic_tanh_backward)


class _DynamicTanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, weight, bias, squash):
        x2 = rows(x)
        y = dynamic_tanh_forward_kernel(x2, alpha, weight, bias,
                                        squash)
        ctx.save_for_backward(x2, alpha, weight, bias)
        ctx.squash = squash
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, alpha, weight, bias = ctx.saved_tensors
        grad_x, grad_alpha, grad_weight, grad_bias = dynamic_tanh_backward_kernel(
            rows(grad), x2, alpha, weight, ctx.squash)
        needs = ctx.needs_input_grad
        return (
            grad_x.view(grad.shape),
            grad_alpha.to(alpha.dtype) if needs[1] else None,
            grad_weight.to(weight.dtype) if needs[2] else None,
            grad_bias.to(bias.dtype) if needs[3] else None,
            None,
        )


def _native_ops(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor):
    """``torch.ops.normplug`` when this call runs natively: the C++ operator takes one alpha,
    so a per-channel alpha runs the fused kernels (whose backward sums its gradient per channel)."""
    return native_ops(x, weight) if alpha.numel() == 1 else None


def dynamic_tanh(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor, squash: str = "tanh") -> torch.Tensor:
    """Fast path of :func:`dynamic_tanh_reference` (same values and gradients, computed in
    float32 for fp16/bf16 input, output in the input dtype): the native C++ operator, or one
    fused elementwise kernel each way, with a rational tanh when compiled on CPU; see
    ``fused.py``. ``alpha``: one value, or one per channel (fused kernels only)."""
    ops = _native_ops(x, alpha, weight)
    if ops is not None:
        return ops.dynamic_tanh(x, alpha, weight, bias, native.SQUASH_CODES[squash])
    if needs_autograd(x, alpha, weight, bias):
        return _DynamicTanhFunction.apply(x, alpha, weight, bias, squash)
    return dynamic_tanh_forward_kernel(
        rows(x), alpha, weight, bias, squash).view(x.shape)


@register_norm("dyt", shorthand=True, per_channel_gain=True)
class DynamicTanh(FormulaNorm):
    """DyT: one learnable scalar ``alpha`` (init ``alpha_init``, default 0.5), a per-channel
    gain ``weight`` (gamma, init 1) and shift ``bias`` (beta, init 0).

    ``squash`` selects tanh (the paper's choice), hardtanh or sigmoid (its ablation,
    Table 9); ``learnable_alpha=False`` freezes alpha at ``alpha_init`` (with alpha_init=1
    that is the paper's "without alpha" ablation, squash(x)). ``init_from_input`` sets
    alpha0 = 1/std of the input (``--dyt-alpha-init auto``; the paper's section 6: learned
    alpha tracks 1/std). Computed in float32 whatever the input dtype; alpha stays float32
    when the model is cast to fp16/bf16 (``float32_params.py``), so its gradient is summed
    and stored in float32. ``forward`` runs the fused fast path :func:`dynamic_tanh`.
    ``zero_centered_gamma=True``: ``weight`` holds a zero-initialised gamma and the gain is
    1 + gamma, passed to the fast path as its weight (``norm_base.py``).

    Ablations (module docstring): ``alpha_per_channel=True`` makes ``alpha`` a d-vector, every
    channel initialised to ``alpha_init`` (``auto``: to the one 1/std of the whole input); it
    takes the fused kernels, not the native operator, and is cast with the model like the gain.
    ``affine=False`` creates no ``weight`` and ``bias``: ``squash(alpha x)``, computed by
    ``reference`` (the plain path).
    """

    auto_init_parameter = "alpha"
    #: its flags that take a number or ``auto`` (checked by the registry)
    scale_init_flags = ("dyt_alpha_init", "dyt_attn_alpha_init")

    @staticmethod
    def add_args(parser):
        add = parser.add_argument
        add("--dyt-alpha-init", metavar="A|auto", **scale_init_flag(),
            help=f"DyT alpha initial value (default {DYT_DEFAULT_ALPHA}); auto: 1/std of each norm's "
                 "input on the first training batch (all ranks), logged")
        add("--dyt-attn-alpha-init", metavar="A|auto", **scale_init_flag(),
            help="DyT alpha initial value (or auto) for the norms of attention blocks, overriding "
                 "--dyt-alpha-init there (default: --dyt-alpha-init)")
        add("--dyt-squash", choices=tuple(SQUASH_FUNCTIONS),
            help="DyT squashing function (default tanh; DyT paper's ablation: hardtanh, sigmoid)")
        add("--dyt-freeze-alpha", action="store_true",
            help="keep DyT alpha fixed at its initial value (--dyt-alpha-init, or the auto value); "
                 "the DyT paper's 'without alpha' ablation is alpha fixed at 1: --dyt-no-alpha")
        add("--dyt-no-alpha", action="store_true",
            help="the DyT paper's 'without alpha' ablation (section 6): squash(x), i.e. alpha fixed "
                 "at 1 (= --dyt-freeze-alpha --dyt-alpha-init 1)")
        add("--dyt-alpha-per-channel", action="store_true",
            help="ablation: one DyT alpha per channel (a d-vector) instead of one scalar, every "
                 "channel starting at the alpha init (auto: the one 1/std of the whole input)")
        add("--dyt-no-affine", action="store_true",
            help="ablation: DyT without its per-channel gain and bias, tanh(alpha x) (the DyT "
                 "authors' elementwise_affine=False)")

    @classmethod
    def check_args(cls, args):
        if args.dyt_no_alpha:
            clash = [n for n in cls.scale_init_flags if getattr(args, n) not in (None, 1.0)]
            if clash:
                raise NormplugError(f"--dyt-no-alpha fixes alpha at 1; it contradicts "
                                    f"--{clash[0].replace('_', '-')} {getattr(args, clash[0])}")
        squash = args.dyt_squash or "tanh"
        if squash not in SQUASH_FUNCTIONS:
            raise NormplugError(f"unknown --dyt-squash {squash!r}; choose from {', '.join(SQUASH_FUNCTIONS)}")
        if args.dyt_no_affine and getattr(args, "zero_centered_gamma", False):
            raise NormplugError("--dyt-no-affine cannot be combined with --zero-centered-gamma: without "
                                "the affine there is no gamma to store zero-centred")

    @classmethod
    def build(cls, dim, args, slot):
        """alpha0: ``--dyt-alpha-init`` (``--dyt-attn-alpha-init`` in attention blocks), 1 with
        ``--dyt-no-alpha``, or ``auto``; ``--dyt-squash``, ``--dyt-freeze-alpha``,
        ``--dyt-alpha-per-channel``, ``--dyt-no-affine``."""
        alpha = DYT_DEFAULT_ALPHA if args.dyt_alpha_init is None else args.dyt_alpha_init
        if slot.role == ATTENTION and args.dyt_attn_alpha_init is not None:
            alpha = args.dyt_attn_alpha_init
        if args.dyt_no_alpha:
            alpha = 1.0
        return scale_init(alpha, lambda a: cls(dim, alpha_init=a, squash=args.dyt_squash or "tanh",
                                               learnable_alpha=not (args.dyt_freeze_alpha or args.dyt_no_alpha),
                                               zero_centered_gamma=args.zero_centered_gamma,
                                               alpha_per_channel=args.dyt_alpha_per_channel,
                                               affine=not args.dyt_no_affine),
                          DYT_DEFAULT_ALPHA)

    def __init__(
        self,
        dim: int,
        alpha_init: float = DYT_DEFAULT_ALPHA,
        squash: str = "tanh",
        learnable_alpha: bool = True,
        zero_centered_gamma: bool = False,
        alpha_per_channel: bool = False,
        affine: bool = True,
    ):
        super().__init__(dim, zero_centered_gamma)
        if squash not in SQUASH_FUNCTIONS:
            raise ValueError(
                f"unknown DyT squash function {squash!r}; choose from {sorted(SQUASH_FUNCTIONS)}"
            )
        if not alpha_init > 0:
            raise ValueError(f"DyT alpha init must be positive, got {alpha_init}")
        if zero_centered_gamma and not affine:
            raise ValueError("a DyT without affine has no gamma to zero-centre")
        self.squash = squash
        self.affine = affine
        self.alpha = nn.Parameter(torch.full((dim,) if alpha_per_channel else (), float(alpha_init)),
                                  requires_grad=learnable_alpha)
        if affine:
            self.weight = self.new_gain()
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.affine:
            return self.reference(x)
        return dynamic_tanh(x, self.alpha, self.gain(), self.bias, self.squash)

    def formula(self, x, alpha, weight=None, bias=None):
        """:func:`dynamic_tanh_reference` (``reference(x)`` runs it in float32)."""
        return dynamic_tanh_reference(x, alpha, weight, bias, self.squash)

    def init_from_input(self, mean: float, mean_square: float) -> float:
        return self.set_scalar("alpha", inverse_std(mean, mean_square))

    def saturated_fraction(self, x: torch.Tensor) -> float:
        """Fraction of the elements of ``x`` in the squash's flat part, ``|alpha x| >
        SATURATION_THRESHOLD`` (logged by ``--norm-stats-interval``, plotted by plot_norms)."""
        with torch.no_grad():
            return float(((x.float() * self.alpha.float()).abs() > SATURATION_THRESHOLD).float().mean())

    def fast_path(self, x: torch.Tensor) -> str:
        """Which path ``forward(x)`` takes: native, compiled or eager (``fused.py``); a
        per-channel alpha never runs native; ``plain`` without affine."""
        if not self.affine:
            return "plain"
        if _native_ops(x, self.alpha, self.weight) is not None:
            return "native"
        return dynamic_tanh_forward_kernel.path(rows(x))

    def extra_repr(self) -> str:
        alpha = (f"alpha={self.alpha.item():.3g}" if self.alpha.dim() == 0
                 else f"alpha=per-channel (mean {self.alpha.float().mean().item():.3g})")
        return (
            f"{self.dim}, {alpha}, squash={self.squash}, learnable_alpha={self.alpha.requires_grad}"
        ) + ("" if self.affine else ", affine=False") + "".join(", " + item for item in zero_centered_repr(self))
