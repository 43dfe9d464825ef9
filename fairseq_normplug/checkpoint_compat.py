"""Loading fairseq checkpoints under torch >= 2.6, whose ``torch.load`` defaults to
``weights_only=True``. Instead of switching safe loading off, the few non-tensor classes a
fairseq checkpoint holds are allow-listed with ``torch.serialization.add_safe_globals``.

What a fairseq checkpoint pickles besides tensors and builtin containers: the legacy
``args`` (an ``argparse.Namespace``) and numpy arrays and scalars (the data iterator's
state, scores), i.e. numpy's array reconstructor, ``ndarray``, ``dtype`` and its concrete
dtype classes (``numpy.dtypes.Int64DType``, ...). The config itself is stored as a plain dict.
"""
import argparse
import importlib

import numpy as np
import torch


def _numpy_pickle_helpers():
    """numpy's pickle helpers, under numpy 1.x (numpy.core) or 2.x (numpy._core) names."""
    found = []
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        for name in ("_reconstruct", "scalar"):
            try:
                found.append(getattr(importlib.import_module(module), name))
            except (ImportError, AttributeError):
                pass
    return found


def fairseq_checkpoint_classes():
    """The non-tensor classes found inside fairseq checkpoints."""
    dtype_classes = [getattr(np.dtypes, name) for name in dir(getattr(np, "dtypes", object))
                     if name.endswith("DType")]
    return [argparse.Namespace, np.ndarray, np.dtype, *dtype_classes, *_numpy_pickle_helpers()]


def allow_fairseq_checkpoint_classes() -> None:
    """Allow-list :func:`fairseq_checkpoint_classes` for ``torch.load(weights_only=True)``.
    A no-op on torch versions without ``add_safe_globals`` (< 2.4), which load unsafely anyway."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(fairseq_checkpoint_classes())
