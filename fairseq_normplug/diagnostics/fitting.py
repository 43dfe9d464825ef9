"""Fitting a norm-free layer to a trained LayerNorm on its real activations.

A LayerNorm maps each element of its input along an S-curve (DyT paper, Figs. 2-4); DyT,
``gamma * tanh(alpha x) + beta`` (eq. 1), draws that curve with one scalar ``alpha``. Given
the inputs ``x`` and outputs ``y = LN(x)`` of one trained LayerNorm on a calibration batch,
:func:`fit_dyt` copies gamma and beta and chooses ``alpha`` by least squares,

    alpha* = argmin_alpha || gamma * tanh(alpha x) + beta - y ||^2,

with a log-spaced 1-D grid search around 1/std(x) (where the DyT paper finds learned alphas,
section 6) refined by golden-section search. Optionally gamma is then refitted per channel in
closed form (``gamma_j = sum_i t_ij (y_ij - beta_j) / sum_i t_ij^2`` with ``t = tanh(alpha
x)``) and alpha searched again, kept only if it lowers the error. Derf (``gamma * erf(alpha x
+ s) + beta``, :func:`fit_derf`) is fitted the same way, with its shift s searched too.

Conversion targets are a table (:data:`TARGETS`): each names the ``--norm-type`` of the
converted model, its naive swap (the target's default init, gamma and beta copied) and its
fitter. A new norm-free type adds one :class:`Target` row.

A LayerNorm trained with ``--zero-centered-gamma`` (``LayerNorm1p``) is read through its
applied gain 1 + gamma (``norm_base.effective_gain``); the converted modules hold that gain
as a stock (not zero-centred) gamma.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.derf import DERF_DEFAULT_ALPHA, Derf
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.norm_base import effective_gain

#: DyT's default alpha init, the naive swap's alpha (DyT paper, section 7)
NAIVE_DYT_ALPHA = 0.5
GOLDEN = (math.sqrt(5) - 1) / 2


def is_layer_norm(module: nn.Module) -> bool:
    """torch's LayerNorm (what fairseq builds on CPU) or apex's FusedLayerNorm."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__ == "FusedLayerNorm"


def mean_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> float:
    return float(((prediction - target) ** 2).mean())


def golden_section(loss: Callable[[float], float], low: float, high: float,
                   iterations: int = 30) -> Tuple[float, float]:
    """(argmin, min) of a unimodal ``loss`` on [low, high] by golden-section search."""
    c, d = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
    fc, fd = loss(c), loss(d)
    for _ in range(iterations):
        if fc < fd:
            high, d, fd = d, c, fc
            c = high - GOLDEN * (high - low)
            fc = loss(c)
        else:
            low, c, fc = c, d, fd
            d = low + GOLDEN * (high - low)
            fd = loss(d)
    return (c, fc) if fc < fd else (d, fd)


def minimise_log_scalar(loss: Callable[[float], float], center: float, decades: float = 2.0,
                        points: int = 41, iterations: int = 30) -> Tuple[float, float]:
    """(argmin, min) of a 1-D ``loss`` over positive values: a log-spaced grid over
    ``center * 10^[-decades, decades]``, then golden-section search in log space between the
    best grid point's neighbours."""
    grid = [center * 10 ** (decades * (2 * i / (points - 1) - 1)) for i in range(points)]
    values = [loss(a) for a in grid]
    best = min(range(points), key=values.__getitem__)
    low, high = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, points - 1)])
    log_argmin, value = golden_section(lambda t: loss(math.exp(t)), low, high, iterations)
    return min((values[best], grid[best]), (value, math.exp(log_argmin)))[::-1]


@dataclass
class SquashFit:
    """``weight * squash(alpha x + shift) + bias`` fitted to one LayerNorm's outputs."""

    alpha: float
    shift: float
    weight: torch.Tensor
    bias: torch.Tensor
    info: Dict[str, float]


def fit_squash(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, squash, naive_alpha: float,
               fit_shift: bool = False, refit_gamma: bool = True) -> SquashFit:
    """Least-squares fit of ``gamma * squash(alpha x + s) + beta`` to ``y = LN(x)`` (the
    module docstring): gamma, beta copied; alpha by :func:`minimise_log_scalar`; with
    ``fit_shift`` the scalar s in [-1, 1] by golden-section search, alternating with alpha;
    with ``refit_gamma`` gamma per channel in closed form, kept only if the error drops."""
    gamma = effective_gain(layer_norm).detach().float()
    beta = layer_norm.bias.detach().float()
    x, y = x.float(), y.float()
    in_std = float(x.std())

    def error(alpha: float, shift: float = 0.0, weight: torch.Tensor = gamma) -> float:
        return mean_squared_error(weight * squash(alpha * x + shift) + beta, y)

    alpha, best = minimise_log_scalar(error, 1.0 / max(in_std, 1e-6))
    shift = 0.0
    for _ in range(2 if fit_shift else 0):
        shift, best = golden_section(lambda s: error(alpha, s), -1.0, 1.0)
        alpha, best = minimise_log_scalar(lambda a: error(a, shift), alpha, decades=0.5)
    weight, refitted = gamma, False
    if refit_gamma:
        candidate, candidate_alpha = gamma, alpha
        for _ in range(2):  # alternate closed-form gamma and the alpha search
            t = squash(candidate_alpha * x + shift)
            candidate = (t * (y - beta)).sum(0) / (t * t).sum(0).clamp_min(1e-12)
            candidate_alpha, value = minimise_log_scalar(lambda a: error(a, shift, candidate), candidate_alpha,
                                                         decades=0.5)
        if value < best:
            weight, alpha, best, refitted = candidate, candidate_alpha, value, True
    info = {"alpha": alpha, "mse": best, "naive_mse": error(naive_alpha), "in_std": in_std,
            "out_var": float(y.var()), "gamma_refitted": refitted}
    if fit_shift:
        info["shift"] = shift
    return SquashFit(alpha, shift, weight, beta, info)


def _with_affine(module: nn.Module, layer_norm: nn.Module, weight: torch.Tensor, bias: torch.Tensor):
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    return module.to(layer_norm.weight.dtype)


def naive_dyt(layer_norm: nn.Module) -> DynamicTanh:
    """DyT with the default alpha 0.5 and the LayerNorm's gamma and beta: what swapping the
    modules (as DyT's official converter does) and copying the affine parameters gives."""
    return _with_affine(DynamicTanh(layer_norm.normalized_shape[-1], alpha_init=NAIVE_DYT_ALPHA), layer_norm,
                        effective_gain(layer_norm).detach(), layer_norm.bias.detach())


def fit_dyt(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, refit_gamma: bool = True
            ) -> Tuple[DynamicTanh, Dict[str, float]]:
    """DyT matching ``layer_norm`` on its (rows, C) inputs ``x`` and outputs ``y`` (see the
    module docstring). Returns the module and the fit's numbers: fitted alpha, naive and
    fitted mean squared error, the input's std, and whether gamma was refitted."""
    fit = fit_squash(layer_norm, x, y, torch.tanh, NAIVE_DYT_ALPHA, refit_gamma=refit_gamma)
    module = DynamicTanh(layer_norm.normalized_shape[-1], alpha_init=fit.alpha)
    return _with_affine(module, layer_norm, fit.weight, fit.bias), fit.info


def naive_derf(layer_norm: nn.Module) -> Derf:
    """Derf with its default alpha 0.5 and shift 0, the LayerNorm's gamma and beta."""
    return _with_affine(Derf(layer_norm.normalized_shape[-1], alpha_init=DERF_DEFAULT_ALPHA), layer_norm,
                        effective_gain(layer_norm).detach(), layer_norm.bias.detach())


def fit_derf(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, refit_gamma: bool = True
             ) -> Tuple[Derf, Dict[str, float]]:
    """Derf, ``gamma * erf(alpha x + s) + beta``, matching ``layer_norm``: alpha and the
    shift s fitted (alternating 1-D searches), gamma as in :func:`fit_dyt`."""
    fit = fit_squash(layer_norm, x, y, torch.erf, DERF_DEFAULT_ALPHA, fit_shift=True, refit_gamma=refit_gamma)
    module = Derf(layer_norm.normalized_shape[-1], alpha_init=fit.alpha, shift_init=fit.shift)
    return _with_affine(module, layer_norm, fit.weight, fit.bias), fit.info


@dataclass(frozen=True)
class Target:
    """A conversion target: the converted model's ``--norm-type``, the naive swap of one
    LayerNorm, and the fitter ``fit(layer_norm, x, y, refit_gamma) -> (module, info)``
    (``info`` holds at least ``mse`` and ``naive_mse``)."""

    norm_type: str
    naive: Callable[[nn.Module], nn.Module]
    fit: Callable[..., Tuple[nn.Module, Dict[str, float]]]


TARGETS: Dict[str, Target] = {
    "dyt": Target("dyt", naive_dyt, fit_dyt),
    "derf": Target("derf", naive_derf, fit_derf),
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise NormplugError(f"unknown conversion target --to {name!r}; choose from {', '.join(TARGETS)}")
    return TARGETS[name]
