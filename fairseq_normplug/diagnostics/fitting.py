"""Fitting a norm-free layer to a trained LayerNorm on its real activations.

A LayerNorm maps each element of its input along an S-curve (DyT paper, Figs. 2-4); DyT,
``gamma * tanh(alpha x) + beta`` (eq. 1), draws that curve with one scalar ``alpha``. Given
the inputs ``x`` and outputs ``y = LN(x)`` of one trained LayerNorm on a calibration batch,
:func:`fit_dyt` copies gamma and beta and chooses ``alpha`` by least squares,

    alpha* = argmin_alpha || gamma * tanh(alpha x) + beta - y ||^2,

with a log-spaced 1-D grid search around 1/std(x) (where the DyT paper finds learned alphas,
section 6) refined by golden-section search. Optionally gamma is then refitted per channel in
closed form (``gamma_j = sum_i t_ij (y_ij - beta_j) / sum_i t_ij^2`` with ``t = tanh(alpha
x)``) and alpha searched again, kept only if it lowers the error.

Conversion targets are a table (:data:`TARGETS`): each names the ``--norm-type`` of the
converted model, its naive swap (the target's default init, gamma and beta copied) and its
fitter. A new norm-free type adds one :class:`Target` row.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh

#: DyT's default alpha init, the naive swap's alpha (DyT paper, section 7)
NAIVE_DYT_ALPHA = 0.5
GOLDEN = (math.sqrt(5) - 1) / 2


def is_layer_norm(module: nn.Module) -> bool:
    """torch's LayerNorm (what fairseq builds on CPU) or apex's FusedLayerNorm."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__ == "FusedLayerNorm"


def mean_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> float:
    return float(((prediction - target) ** 2).mean())


def minimise_log_scalar(loss: Callable[[float], float], center: float, decades: float = 2.0,
                        points: int = 41, iterations: int = 30) -> Tuple[float, float]:
    """(argmin, min) of a 1-D ``loss`` over positive values: a log-spaced grid over
    ``center * 10^[-decades, decades]``, then golden-section search in log space between the
    best grid point's neighbours."""
    grid = [center * 10 ** (decades * (2 * i / (points - 1) - 1)) for i in range(points)]
    values = [loss(a) for a in grid]
    best = min(range(points), key=values.__getitem__)
    low, high = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, points - 1)])
    c, d = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
    fc, fd = loss(math.exp(c)), loss(math.exp(d))
    for _ in range(iterations):
        if fc < fd:
            high, d, fd = d, c, fc
            c = high - GOLDEN * (high - low)
            fc = loss(math.exp(c))
        else:
            low, c, fc = c, d, fd
            d = low + GOLDEN * (high - low)
            fd = loss(math.exp(d))
    candidates = [(values[best], grid[best]), (fc, math.exp(c)), (fd, math.exp(d))]
    value, argmin = min(candidates)
    return argmin, value


def naive_dyt(layer_norm: nn.Module) -> DynamicTanh:
    """DyT with the default alpha 0.5 and the LayerNorm's gamma and beta: what swapping the
    modules (as DyT's official converter does) and copying the affine parameters gives."""
    return _dyt_like(layer_norm, NAIVE_DYT_ALPHA, layer_norm.weight.detach(), layer_norm.bias.detach())


def _dyt_like(layer_norm: nn.Module, alpha: float, weight: torch.Tensor, bias: torch.Tensor) -> DynamicTanh:
    dyt = DynamicTanh(layer_norm.normalized_shape[-1], alpha_init=alpha)
    with torch.no_grad():
        dyt.weight.copy_(weight)
        dyt.bias.copy_(bias)
    return dyt.to(layer_norm.weight.dtype)


def fit_dyt(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, refit_gamma: bool = True
            ) -> Tuple[DynamicTanh, Dict[str, float]]:
    """DyT matching ``layer_norm`` on its (rows, C) inputs ``x`` and outputs ``y`` (see the
    module docstring). Returns the module and the fit's numbers: fitted alpha, naive and
    fitted mean squared error, the input's std, and whether gamma was refitted."""
    gamma = layer_norm.weight.detach().float()
    beta = layer_norm.bias.detach().float()
    x, y = x.float(), y.float()
    in_std = float(x.std())

    def error(alpha: float, weight: torch.Tensor = gamma) -> float:
        return mean_squared_error(weight * torch.tanh(alpha * x) + beta, y)

    alpha, best = minimise_log_scalar(error, 1.0 / max(in_std, 1e-6))
    weight, refitted = gamma, False
    if refit_gamma:
        candidate, candidate_alpha = gamma, alpha
        for _ in range(2):  # alternate closed-form gamma and the alpha search
            t = torch.tanh(candidate_alpha * x)
            candidate = (t * (y - beta)).sum(0) / (t * t).sum(0).clamp_min(1e-12)
            candidate_alpha, value = minimise_log_scalar(lambda a: error(a, candidate), candidate_alpha,
                                                         decades=0.5)
        if value < best:
            weight, alpha, best, refitted = candidate, candidate_alpha, value, True
    info = {"alpha": alpha, "mse": best, "naive_mse": error(NAIVE_DYT_ALPHA), "in_std": in_std,
            "out_var": float(y.var()), "gamma_refitted": refitted}
    return _dyt_like(layer_norm, alpha, weight, beta), info


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
    # "derf": Target("derf", naive_derf, fit_derf) once modules/derf.py exists (docs/diagnostics.md)
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise NormplugError(f"unknown conversion target --to {name!r}; choose from {', '.join(TARGETS)}")
    return TARGETS[name]
