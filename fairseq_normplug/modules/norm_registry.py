"""The norm layers the plugin offers, registered in one place: ``NORM_BUILDERS`` maps each
``--norm-type`` name to a small builder ``(spec, dim, role, feeds_output) -> module``.

Adding a norm type: one small file under ``modules/`` with a :class:`FormulaNorm` subclass
holding the paper's formula (see ``norm_base.py``; ``derf.py`` and ``dyisru.py`` are
examples), one builder line here, and, if it has its own settings, their flags in
``models/normplug_args.py``. It then works on CPU and GPU, in fp16/bf16 (computed in float32)
and with every residual placement; fast paths are optional extras.

``NormSpec.zero_centered_gamma`` (``--zero-centered-gamma``) builds every norm with a
per-channel gain (:data:`ZERO_CENTERED_GAMMA_TYPES`) with that gain stored as gamma, init 0,
and applied as 1 + gamma (``norm_base.py``; the layernorm type becomes ``LayerNorm1p``,
``layer_norm_1p.py``). scalenorm (one scale g0 = sqrt(d), not a unit gain; ``scale_norm.py``)
and identity (no gain) are refused.
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

from fairseq.modules import LayerNorm
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.derf import DERF_DEFAULT_ALPHA, Derf
from fairseq_normplug.modules.dyisru import DyISRU
from fairseq_normplug.modules.dynamic_tanh import SQUASH_FUNCTIONS, DynamicTanh
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.layer_norm_1p import LayerNorm1p
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm

DYT_SQUASH_CHOICES = tuple(SQUASH_FUNCTIONS)
#: an init value meaning "choose from the first training batch" (``auto_init.py``)
AUTO = "auto"

#: where a norm sits; DyT takes a separate alpha init for the attention blocks' norms
ATTENTION, FFN, FINAL = "attention", "ffn", "final"

ScaleInit = Union[float, str]


@dataclass(frozen=True)
class NormSpec:
    """Everything needed to build any norm of a model (resolved from the flags)."""

    norm_type: str = "layernorm"
    eps: float = 1e-5
    scalenorm_fixed_g: bool = False
    dyt_alpha_init: ScaleInit = 0.5
    dyt_attn_alpha_init: Optional[ScaleInit] = None
    dyt_squash: str = "tanh"
    dyt_freeze_alpha: bool = False
    derf_alpha_init: ScaleInit = DERF_DEFAULT_ALPHA
    dyisru_beta_init: Optional[ScaleInit] = None  # None: C - 1 per norm (``dyisru.py``)
    zero_centered_gamma: bool = False  # gain stored as gamma (init 0), applied as 1 + gamma


def scale_init(value: Optional[ScaleInit], make: Callable[[Optional[float]], nn.Module],
               default: Optional[float]) -> nn.Module:
    """``make(value)``, or for ``value == AUTO`` ``make(default)`` marked for the
    data-driven init of ``auto_init.py``."""
    if value != AUTO:
        return make(value)
    module = make(default)
    module.auto_init = True
    return module


def _dyt(spec: NormSpec, dim: int, role: str, feeds_output: bool) -> nn.Module:
    alpha = spec.dyt_alpha_init
    if role == ATTENTION and spec.dyt_attn_alpha_init is not None:
        alpha = spec.dyt_attn_alpha_init
    return scale_init(alpha, lambda a: DynamicTanh(dim, alpha_init=a, squash=spec.dyt_squash,
                                                   learnable_alpha=not spec.dyt_freeze_alpha,
                                                   zero_centered_gamma=spec.zero_centered_gamma), 0.5)


#: the norm types with a per-channel gain, which ``--zero-centered-gamma`` applies to
ZERO_CENTERED_GAMMA_TYPES = ("layernorm", "rmsnorm", "dyt", "derf", "dyisru")
#: why the others are refused
ZERO_CENTERED_GAMMA_REFUSED = {
    "scalenorm": "its g is one learned scale initialised to sqrt(d), not a per-channel unit gain",
    "identity": "it has no gain",
}


def zero_centered_gamma_error(norm_type: str) -> str:
    """The one-line refusal of ``--zero-centered-gamma`` with ``norm_type`` ('' if it is supported)."""
    if norm_type in ZERO_CENTERED_GAMMA_TYPES:
        return ""
    return (f"--zero-centered-gamma cannot be used with --norm-type {norm_type} "
            f"({ZERO_CENTERED_GAMMA_REFUSED.get(norm_type, 'no per-channel gain')}); "
            f"it applies to {', '.join(ZERO_CENTERED_GAMMA_TYPES)}")


NORM_BUILDERS: Dict[str, Callable[[NormSpec, int, str, bool], nn.Module]] = {
    "layernorm": lambda spec, dim, role, feeds_output: (
        LayerNorm1p(dim) if spec.zero_centered_gamma else LayerNorm(dim)),
    "scalenorm": lambda spec, dim, role, feeds_output: ScaleNorm(
        dim, eps=spec.eps, learnable=feeds_output or not spec.scalenorm_fixed_g),
    "rmsnorm": lambda spec, dim, role, feeds_output: RMSNorm(
        dim, eps=spec.eps, zero_centered_gamma=spec.zero_centered_gamma),
    "dyt": _dyt,
    "derf": lambda spec, dim, role, feeds_output: scale_init(
        spec.derf_alpha_init, lambda a: Derf(dim, alpha_init=a, zero_centered_gamma=spec.zero_centered_gamma),
        DERF_DEFAULT_ALPHA),
    "dyisru": lambda spec, dim, role, feeds_output: scale_init(
        spec.dyisru_beta_init, lambda b: DyISRU(dim, beta_init=b, eps=spec.eps,
                                                zero_centered_gamma=spec.zero_centered_gamma), None),
    "identity": lambda spec, dim, role, feeds_output: IdentityNorm(dim),
}
NORM_TYPES = tuple(NORM_BUILDERS)


def build_norm(spec: NormSpec, dim: int, role: str, feeds_output: bool = False) -> nn.Module:
    """One norm layer of type ``spec.norm_type`` for a ``dim``-wide input.

    ``role`` is ATTENTION, FFN or FINAL; ``feeds_output`` marks the norm whose output goes
    to the output layer (its ScaleNorm g stays learnable in the fixed-g variant).
    """
    if spec.norm_type not in NORM_BUILDERS:
        raise ValueError(f"unknown norm type {spec.norm_type!r}; choose from {', '.join(NORM_TYPES)}")
    if spec.zero_centered_gamma and zero_centered_gamma_error(spec.norm_type):
        raise NormplugError(zero_centered_gamma_error(spec.norm_type))
    return NORM_BUILDERS[spec.norm_type](spec, dim, role, feeds_output)
