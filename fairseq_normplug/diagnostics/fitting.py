"""Fitting a norm-free layer to a trained LayerNorm on its real activations.

A LayerNorm maps each element of its input along an S-curve (DyT paper, Figs. 2-4); DyT,
``gamma * tanh(alpha x) + beta`` (eq. 1), draws that curve with one scalar ``alpha``. Given
the inputs ``x`` and outputs ``y = LN(x)`` of one trained LayerNorm on a calibration batch,
:func:`fit_dyt` copies gamma and beta and chooses ``alpha`` by least squares,

    alpha* = argmin_alpha || gamma * tanh(alpha x) + beta - y ||^2,

with a log-spaced 1-D grid search around 1/std(x) (where the DyT paper finds learned alphas,
section 6) refined by golden-section search.

Three ways to treat the per-channel affine parameters (``affine``, :data:`AFFINE_FITS`):

* ``"joint"`` (the default): gamma and beta are fitted per channel together with alpha. For a
  fixed alpha the output ``gamma_c t_c + beta_c`` (``t = tanh(alpha x)``) is linear in
  ``(gamma_c, beta_c)``, so the least-squares pair is the simple regression of ``y_c`` on
  ``[t_c, 1]`` (the 2x2 normal equations, :func:`closed_form_affine`)::

      gamma_c = Cov(t_c, y_c) / Var(t_c),   beta_c = mean(y_c) - gamma_c mean(t_c),

  and the remaining error is ``sum_c n (Var(y_c) - Cov(t_c, y_c)^2 / Var(t_c))``
  (:func:`profiled_error`). Alpha minimises that profiled error (the 1-D search above, with
  the closed-form gamma/beta inside). A channel whose regressor has (numerically) no
  variance keeps the LayerNorm's gamma and gets ``beta_c = mean(y_c) - gamma_c mean(t_c)``
  (every gamma fits it equally well), so no NaN can arise.
* ``"gamma"`` (the earlier method): gamma and beta copied, alpha searched; then gamma alone
  refitted per channel in closed form (``gamma_j = sum_i t_ij (y_ij - beta_j) / sum_i
  t_ij^2``) and alpha searched again, kept only if it lowers the error.
* ``"keep"`` (``--keep-gamma``): gamma and beta copied, alpha fitted alone.

Derf (``gamma * erf(alpha x + s) + beta``, :func:`fit_derf`) is fitted the same way with its
scalar shift s in [-1, 1] too: alpha is searched at s = 0, then twice in turn s by
golden-section search at fixed alpha and alpha by a narrower log search at fixed s (with the
closed-form gamma/beta inside every evaluation under ``"joint"``).

The scalar searches run on at most :data:`SEARCH_ROWS` rows (a fixed-seed subsample, so the
result is deterministic); the closed-form gamma/beta and the reported errors use every row.

Conversion targets are a table (:data:`TARGETS`): each names the ``--norm-type`` of the
converted model, its naive swap (the target's default init, gamma and beta copied) and its
fitter. A new norm-free type adds one :class:`Target` row.

A LayerNorm trained with ``--zero-centered-gamma`` (``LayerNorm1p``) is read through its
applied gain 1 + gamma (``norm_base.effective_gain``); the converted modules hold that gain
as a stock (not zero-centred) gamma.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.derf import DERF_DEFAULT_ALPHA, Derf
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.norm_base import effective_gain

#: DyT's default alpha init, the naive swap's alpha (DyT paper, section 7)
NAIVE_DYT_ALPHA = 0.5
GOLDEN = (math.sqrt(5) - 1) / 2
#: how gamma and beta are obtained (module docstring): fitted jointly with alpha, gamma alone
#: refitted (the earlier method), or both copied from the LayerNorm
AFFINE_FITS = ("joint", "gamma", "keep")
#: a channel whose regressor variance is below this (relative to 1) counts as degenerate
DEGENERATE_VARIANCE = 1e-10
#: the scalar searches (alpha, shift) run on at most this many rows (a fixed-seed subsample);
#: the closed-form gamma/beta and the reported errors use every row
SEARCH_ROWS = 8192


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


def affine_choice(affine: Optional[str] = None, refit_gamma: bool = True) -> str:
    """The ``affine`` mode; without one, ``refit_gamma`` picks ``"joint"`` or ``"keep"``."""
    affine = affine if affine is not None else ("joint" if refit_gamma else "keep")
    if affine not in AFFINE_FITS:
        raise NormplugError(f"unknown --affine {affine!r}; choose from {', '.join(AFFINE_FITS)}")
    return affine


def _moments(t: torch.Tensor, y: torch.Tensor):
    """Per-channel means of t and y, Var(t), Cov(t, y), Var(y) (population, float64)."""
    t, y = t.double(), y.double()
    mean_t, mean_y = t.mean(0), y.mean(0)
    dt, dy = t - mean_t, y - mean_y
    return mean_t, mean_y, (dt * dt).mean(0), (dt * dy).mean(0), (dy * dy).mean(0)


def closed_form_affine(t: torch.Tensor, y: torch.Tensor, fallback_gamma: Optional[torch.Tensor] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel least-squares ``(gamma_c, beta_c)`` of ``y_c ~ gamma_c t_c + beta_c`` for
    (rows, C) ``t`` and ``y``: ``gamma = Cov(t, y) / Var(t)``, ``beta = mean(y) - gamma
    mean(t)``. A channel with ``Var(t) <= DEGENERATE_VARIANCE`` takes ``fallback_gamma``
    (default 0) and the beta that is optimal for it. float32 results."""
    mean_t, mean_y, var_t, cov, _ = _moments(t, y)
    degenerate = var_t <= DEGENERATE_VARIANCE
    fallback = (torch.zeros_like(mean_t) if fallback_gamma is None
                else fallback_gamma.detach().double().expand_as(mean_t))
    gamma = torch.where(degenerate, fallback, cov / torch.where(degenerate, torch.ones_like(var_t), var_t))
    beta = mean_y - gamma * mean_t
    return gamma.float(), beta.float()


def profiled_error(t: torch.Tensor, y: torch.Tensor, centered_y: Optional[torch.Tensor] = None) -> float:
    """The mean squared error of the closed-form fit (:func:`closed_form_affine`), without
    forming it: ``mean_c (Var(y_c) - Cov(t_c, y_c)^2 / Var(t_c))``; ``Var(y_c)`` for a
    degenerate channel. ``centered_y``: ``y - mean(y)`` in float64, when the caller has it."""
    dy = centered_y if centered_y is not None else y.double() - y.double().mean(0)
    t = t.double()
    mean_t = t.mean(0)
    var_t = (t * t).mean(0) - mean_t * mean_t
    cov = (t * dy).mean(0)  # dy is centred: Cov(t, y) = mean(t dy)
    var_y = (dy * dy).mean(0)
    explained = torch.where(var_t > DEGENERATE_VARIANCE, cov * cov / var_t.clamp_min(DEGENERATE_VARIANCE),
                            torch.zeros_like(cov))
    return float((var_y - explained).clamp_min(0).mean())


@dataclass
class SquashFit:
    """``weight * squash(alpha x + shift) + bias`` fitted to one LayerNorm's outputs."""

    alpha: float
    shift: float
    weight: torch.Tensor
    bias: torch.Tensor
    info: Dict[str, float]


def fit_squash(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, squash, naive_alpha: float,
               fit_shift: bool = False, refit_gamma: bool = True, affine: Optional[str] = None) -> SquashFit:
    """Least-squares fit of ``gamma * squash(alpha x + s) + beta`` to ``y = LN(x)`` (the
    module docstring): alpha by :func:`minimise_log_scalar`; with ``fit_shift`` the scalar s
    in [-1, 1] by golden-section search, alternating with alpha; gamma and beta as ``affine``
    says (:data:`AFFINE_FITS`; without it ``refit_gamma`` picks ``"joint"`` or ``"keep"``)."""
    affine = affine_choice(affine, refit_gamma)
    gamma = effective_gain(layer_norm).detach().float()
    beta = layer_norm.bias.detach().float()
    x, y = x.float(), y.float()
    in_std = float(x.std())

    if x.shape[0] > SEARCH_ROWS:
        rows = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:SEARCH_ROWS]
        xs, ys = x[rows], y[rows]
    else:
        xs, ys = x, y
    centered = ys.double() - ys.double().mean(0)

    def error(alpha: float, shift: float = 0.0, weight: torch.Tensor = gamma, x=xs, y=ys) -> float:
        return mean_squared_error(weight * squash(alpha * x + shift) + beta, y)

    def joint_error(alpha: float, shift: float = 0.0) -> float:
        return profiled_error(squash(alpha * xs + shift), ys, centered)

    search = joint_error if affine == "joint" else error
    alpha, best = minimise_log_scalar(search, 1.0 / max(in_std, 1e-6))
    shift = 0.0
    for _ in range(2 if fit_shift else 0):
        shift, best = golden_section(lambda s: search(alpha, s), -1.0, 1.0)
        alpha, best = minimise_log_scalar(lambda a: search(a, shift), alpha, decades=0.5)
    weight, bias, refitted = gamma, beta, False
    if affine == "joint":
        weight, bias = closed_form_affine(squash(alpha * x + shift), y, fallback_gamma=gamma)
        best, refitted = mean_squared_error(weight * squash(alpha * x + shift) + bias, y), True
    elif affine == "gamma":
        candidate, candidate_alpha = gamma, alpha
        for _ in range(2):  # alternate closed-form gamma and the alpha search
            t = squash(candidate_alpha * xs + shift)
            candidate = (t * (ys - beta)).sum(0) / (t * t).sum(0).clamp_min(1e-12)
            candidate_alpha, value = minimise_log_scalar(lambda a: error(a, shift, candidate), candidate_alpha,
                                                         decades=0.5)
        if value < best:
            weight, alpha, refitted = candidate, candidate_alpha, True
    if affine != "joint":  # the error on every row, not on the search subsample
        best = error(alpha, shift, weight, x, y)
    info = {"alpha": alpha, "mse": best, "naive_mse": error(naive_alpha, x=x, y=y), "in_std": in_std,
            "out_var": float(y.var()), "gamma_refitted": refitted, "beta_refitted": affine == "joint",
            "affine": affine, "rows": int(x.shape[0])}
    if fit_shift:
        info["shift"] = shift
    return SquashFit(alpha, shift, weight, bias, info)


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


def fit_dyt(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, refit_gamma: bool = True,
            affine: Optional[str] = None) -> Tuple[DynamicTanh, Dict[str, float]]:
    """DyT matching ``layer_norm`` on its (rows, C) inputs ``x`` and outputs ``y`` (see the
    module docstring; ``affine`` as in :func:`fit_squash`). Returns the module and the fit's
    numbers: fitted alpha, naive and fitted mean squared error, the input's std, and whether
    gamma (and beta) were refitted."""
    fit = fit_squash(layer_norm, x, y, torch.tanh, NAIVE_DYT_ALPHA, refit_gamma=refit_gamma, affine=affine)
    module = DynamicTanh(layer_norm.normalized_shape[-1], alpha_init=fit.alpha)
    return _with_affine(module, layer_norm, fit.weight, fit.bias), fit.info


def naive_derf(layer_norm: nn.Module) -> Derf:
    """Derf with its default alpha 0.5 and shift 0, the LayerNorm's gamma and beta."""
    return _with_affine(Derf(layer_norm.normalized_shape[-1], alpha_init=DERF_DEFAULT_ALPHA), layer_norm,
                        effective_gain(layer_norm).detach(), layer_norm.bias.detach())


def fit_derf(layer_norm: nn.Module, x: torch.Tensor, y: torch.Tensor, refit_gamma: bool = True,
             affine: Optional[str] = None) -> Tuple[Derf, Dict[str, float]]:
    """Derf, ``gamma * erf(alpha x + s) + beta``, matching ``layer_norm``: alpha and the
    shift s fitted (alternating 1-D searches), gamma and beta as in :func:`fit_dyt`."""
    fit = fit_squash(layer_norm, x, y, torch.erf, DERF_DEFAULT_ALPHA, fit_shift=True, refit_gamma=refit_gamma,
                     affine=affine)
    module = Derf(layer_norm.normalized_shape[-1], alpha_init=fit.alpha, shift_init=fit.shift)
    return _with_affine(module, layer_norm, fit.weight, fit.bias), fit.info


@dataclass(frozen=True)
class Target:
    """A conversion target: the converted model's ``--norm-type``, the naive swap of one
    LayerNorm, and the fitter ``fit(layer_norm, x, y, affine=...) -> (module, info)``
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
