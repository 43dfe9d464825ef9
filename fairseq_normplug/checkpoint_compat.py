"""Loading fairseq checkpoints under torch >= 2.6, whose ``torch.load`` defaults to
``weights_only=True``. Instead of switching safe loading off, the few non-tensor classes a
fairseq checkpoint holds are allow-listed with ``torch.serialization.add_safe_globals``.

What a fairseq checkpoint pickles besides tensors and builtin containers: the legacy
``args`` (an ``argparse.Namespace``) and numpy arrays and scalars (the data iterator's
state, scores), i.e. numpy's array reconstructor, ``ndarray``, ``dtype`` and its concrete
dtype classes (``numpy.dtypes.Int64DType``, ...). The config itself is stored as a plain dict.

In a data-parallel resume, fairseq's trainer reads the checkpoint on rank 0 and sends the
loaded state to the other ranks (``fairseq.distributed.utils.broadcast_object``: pickled with
a ``_TensorPlaceholder`` for each tensor, and ``torch.load``-ed on arrival). By then the config
is an omegaconf ``DictConfig``, so its classes are allow-listed too: the containers, their
metadata and value nodes, and what that metadata names (``typing.Any``, ``dict``, ``list``,
``int``, ``collections.defaultdict``).
"""
import collections
import typing
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


def _omegaconf_classes():
    """What a pickled omegaconf ``DictConfig`` (a loaded checkpoint's config) refers to."""
    try:
        from omegaconf import DictConfig, ListConfig, base, nodes
    except ImportError:  # fairseq requires omegaconf; without it there is nothing to allow
        return []
    value_nodes = [getattr(nodes, name) for name in ("AnyNode", "StringNode", "IntegerNode", "FloatNode",
                                                     "BooleanNode", "BytesNode", "PathNode")
                   if hasattr(nodes, name)]
    return [DictConfig, ListConfig, base.ContainerMetadata, base.Metadata, *value_nodes, typing.Any,
            dict, list, int, collections.defaultdict]


def _broadcast_classes():
    """fairseq's stand-in for each tensor of an object it broadcasts (tensors travel apart)."""
    try:
        from fairseq.distributed.utils import _TensorPlaceholder
    except ImportError:  # another fairseq version: nothing known to allow
        return []
    return [_TensorPlaceholder]


def fairseq_checkpoint_classes():
    """The non-tensor classes found inside fairseq checkpoints (and in the loaded state that
    fairseq's trainer sends to the other data-parallel ranks)."""
    dtype_classes = [getattr(np.dtypes, name) for name in dir(getattr(np, "dtypes", object))
                     if name.endswith("DType")]
    return [argparse.Namespace, np.ndarray, np.dtype, *dtype_classes, *_numpy_pickle_helpers(),
            *_omegaconf_classes(), *_broadcast_classes()]


def allow_fairseq_checkpoint_classes() -> None:
    """Allow-list :func:`fairseq_checkpoint_classes` for ``torch.load(weights_only=True)``.
    A no-op on torch versions without ``add_safe_globals`` (< 2.4), which load unsafely anyway."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(fairseq_checkpoint_classes())


def safe_load(path: str, map_location="cpu", mmap: bool = False):
    """Read a fairseq checkpoint with ``torch.load(weights_only=True)``: no code runs while
    unpickling, only tensors, builtin containers and :func:`fairseq_checkpoint_classes`.
    torch < 2.4 has no allow-list; there it loads as fairseq itself does (torch's default).
    ``mmap``: map the tensors instead of reading them (a whole zip-format file only)."""
    if getattr(torch.serialization, "add_safe_globals", None) is None:
        return torch.load(path, map_location=map_location)
    allow_fairseq_checkpoint_classes()
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
