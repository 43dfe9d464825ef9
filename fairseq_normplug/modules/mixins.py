"""A behaviour added to one existing module in place: :func:`mix_into` gives the module the class
``(mixin, its own class)``, one such class per (mixin, class) pair, named ``prefix + its class's
name``. The module keeps its parameters, buffers and names; the mixin's methods run first and
reach the original ones with ``super()``. Used by the designs that change what a fairseq layer,
attention or linear does (residual scaling, GPAS, gated attention, value residual, sigma-reparam)
without replacing it."""
from typing import Dict, Tuple

from torch import nn

_MIXED_CLASSES: Dict[Tuple[type, type], type] = {}


def mix_into(module: nn.Module, mixin: type, prefix: str) -> nn.Module:
    """``module`` with ``mixin`` in front of its class (see the module docstring); returns it."""
    cls = type(module)
    key = (mixin, cls)
    if key not in _MIXED_CLASSES:
        _MIXED_CLASSES[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MIXED_CLASSES[key]
    return module
