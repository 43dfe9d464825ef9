"""What every norm layer of the plugin shares, so that a new norm type is one small file.

A norm subclasses :class:`FormulaNorm`, creates its parameters in ``__init__`` and writes its
paper's equation once, as ``formula(x, **parameters)`` in plain torch operations. The base
class supplies the rest:

- ``forward(x)`` = ``reference(x)``: the formula computed in float32 for fp16/bf16 input
  (float64 stays float64, for gradcheck), the output in the input's dtype; autograd derives
  the backward; it runs unchanged on CPU and GPU;
- ``fast_path(x)`` = ``"plain"`` (no hand-written kernel);
- ``extra_repr``: the width and the scalar parameters;
- scalar parameters (g, alpha, ...) that stay float32 when the model is cast to fp16/bf16.

ScaleNorm, RMSNorm and DyT override ``forward`` and ``fast_path`` with their optional fast
paths (``fused.py``, ``native.py``, ``csrc/``); ``reference`` stays the plain formula, which
their tests compare the fast paths with.

Zero-centred gamma (``--zero-centered-gamma``; NVIDIA TransformerEngine's
``zero_centered_gamma``, Megatron-LM's ``--apply-layernorm-1p``): a norm built with
``zero_centered_gamma=True`` stores its per-channel gain ``weight`` as gamma, initialised to 0,
and applies ``1 + gamma``, so weight decay pulls the applied gain towards 1 instead of 0.
:meth:`FormulaNorm.new_gain` creates that parameter, :meth:`FormulaNorm.gain` and
:func:`effective_gain` (for any norm module, also torch's LayerNorm) give the gain actually
applied, computed in float32 for fp16/bf16 parameters; ``reference`` passes it to ``formula``
as ``weight`` and the fast paths take it as their weight tensor, so neither changes.

Element-wise norms whose input scale can be chosen from data (``--dyt-alpha-init auto``, ...)
also name that parameter in ``auto_init_parameter`` and say how to set it from the moments of
their input in ``init_from_input(mean, mean_square)``; see ``auto_init.py``.
"""
import math
from typing import Dict, Optional

import torch
from torch import nn

from fairseq_normplug.modules.float32_params import Float32Params
from fairseq_normplug.modules.fused import upcast


def inverse_std(mean: float, mean_square: float) -> float:
    """1 / std of an input with the given first two moments (std floored at 1e-6)."""
    return 1.0 / max(math.sqrt(max(mean_square - mean * mean, 0.0)), 1e-6)


def effective_gain(norm: nn.Module) -> Optional[torch.Tensor]:
    """The per-channel gain ``norm`` applies: its ``weight``, or ``1 + weight`` (in float32
    for fp16/bf16, float64 stays) when it stores a zero-centred gamma (``zero_centered_gamma``
    attribute, see the module docstring); None for a norm without a per-channel ``weight``.
    With a stock gain (flag off) this is the ``weight`` tensor itself."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if getattr(norm, "zero_centered_gamma", False):
        return 1 + upcast(weight)
    return weight


class FormulaNorm(Float32Params):
    """Base of the plugin's norms: ``formula`` is the paper's equation, the rest is generic.
    Scalar parameters stay float32 in fp16/bf16 models (``float32_params.py``)."""

    #: name of the scalar parameter ``init_from_input`` sets (None: no data-driven init)
    auto_init_parameter: Optional[str] = None

    def __init__(self, dim: int, zero_centered_gamma: bool = False):
        super().__init__()
        self.dim = dim
        #: True when this norm's scale is to be chosen from the first training batch
        self.auto_init = False
        #: True when ``weight`` holds gamma and the applied gain is 1 + gamma (module docstring)
        self.zero_centered_gamma = zero_centered_gamma

    def new_gain(self) -> nn.Parameter:
        """The per-channel gain parameter (``weight``): ones, or zeros (gamma) when zero-centred."""
        return nn.Parameter(torch.zeros(self.dim) if self.zero_centered_gamma else torch.ones(self.dim))

    def gain(self) -> torch.Tensor:
        """The per-channel gain applied: ``weight``, or ``1 + weight`` (:func:`effective_gain`)."""
        return effective_gain(self)

    def formula(self, x: torch.Tensor, **parameters: torch.Tensor) -> torch.Tensor:
        """The norm's equation on ``x`` with the given parameters (by name)."""
        raise NotImplementedError

    def parameters_by_name(self) -> Dict[str, torch.Tensor]:
        return dict(self.named_parameters(recurse=False))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``formula`` with this module's parameters, computed in float32 for fp16/bf16."""
        parameters = {name: upcast(p) for name, p in self.parameters_by_name().items()}
        if self.zero_centered_gamma:
            parameters["weight"] = 1 + parameters["weight"]
        return self.formula(upcast(x), **parameters).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reference(x)

    def fast_path(self, x: torch.Tensor) -> str:
        """Which path ``forward(x)`` takes; ``plain``: the formula through autograd."""
        return "plain"

    def init_from_input(self, mean: float, mean_square: float) -> float:
        """Set ``auto_init_parameter`` from the moments of this norm's input; return it."""
        raise NotImplementedError(f"{type(self).__name__} has no data-driven init")

    def set_scalar(self, name: str, value: float) -> float:
        with torch.no_grad():
            getattr(self, name).fill_(value)
        return value

    def extra_repr(self) -> str:
        scalars = [f"{name}={float(p):.4g}" for name, p in self.parameters_by_name().items()
                   if p.dim() == 0]
        frozen = [name for name, p in self.parameters_by_name().items() if not p.requires_grad]
        return ", ".join([str(self.dim), *scalars] + ([f"frozen={','.join(frozen)}"] if frozen else [])
                         + zero_centered_repr(self))


def zero_centered_repr(norm: nn.Module) -> list:
    """``["zero_centered_gamma=True"]`` for a zero-centred norm, else ``[]`` (for ``extra_repr``)."""
    return ["zero_centered_gamma=True"] if getattr(norm, "zero_centered_gamma", False) else []
