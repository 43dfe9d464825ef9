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

A file the safe loader refuses, or cannot read, is one line naming the file (:func:`load_error`):
``refused to load PATH: it holds os.makedirs (Unsupported global), ...`` for a class outside the
allow-list (the safe loader ran nothing in the file), ``cannot read PATH as a fairseq checkpoint (RuntimeError:
...)`` for a file that is not a whole torch checkpoint. torch's own message advises re-running
with safe loading switched off; it is never passed on. :func:`safe_load` raises these, and so do
fairseq's doors (fairseq-generate, fairseq-interactive, fairseq-train's resume, the hub) through
the wrapper of ``fairseq.checkpoint_utils.load_checkpoint_to_cpu``
(:mod:`fairseq_normplug.fairseq_patches`).
"""
import collections
import os
import pickle
import re
import traceback
import typing
import argparse
import importlib
from typing import Optional

import numpy as np
import torch

from fairseq_normplug.errors import NormplugError

#: torch's name of a class its safe unpickler refuses (``GLOBAL os.makedirs``)
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")
#: lines of torch's message that advise switching safe loading off, or other steps: never repeated
_ADVICE = ("weights_only", "weights only load failed", "trust", "documentation", "please file an issue",
           "safe_globals", "alternatively")


class UntrustedCheckpoint(NormplugError):
    """A whole checkpoint file that holds a class the safe loader refuses (nothing in it ran)."""


class UnreadableCheckpoint(NormplugError):
    """A file that is not a whole torch checkpoint (cut short, damaged, another format)."""


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


def refused_class(error: BaseException) -> Optional[str]:
    """The class (``module.name``) torch's safe unpickler refused in ``error``, or None."""
    if not isinstance(error, pickle.UnpicklingError) or "weights only load failed" not in str(error).lower():
        return None
    found = _REFUSED_GLOBAL.search(str(error))
    return found.group(1) if found else None


def _detail(error: BaseException) -> str:
    """``Type: first sentence`` of ``error`` without torch's advice."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not any(phrase in line.lower() for phrase in _ADVICE)]
    sentence = lines[0].split(". ")[0].rstrip(".")[:200] if lines else "the file ends early or is empty"
    return f"{type(error).__name__}: {sentence}"


def load_error(path: str, error: BaseException) -> NormplugError:
    """The one-line error of a failure to read the checkpoint ``path``: :class:`UntrustedCheckpoint`
    naming the refused class, else :class:`UnreadableCheckpoint` with the cause."""
    name = refused_class(error)
    if name is not None:
        return UntrustedCheckpoint(
            f"refused to load {path}: it holds {name} (Unsupported global), which is not a tensor, a "
            f"builtin container or a class of fairseq checkpoints; the safe loader ran nothing in the file. "
            f"Load only checkpoints you made or trust")
    return UnreadableCheckpoint(f"cannot read {path} as a fairseq checkpoint ({_detail(error)})")


def _raised_by_torch_load(error: BaseException) -> bool:
    """``error`` was raised inside ``torch.load`` (torch's serialization or its safe unpickler)."""
    folder = os.path.dirname(torch.__file__)
    return any(os.path.dirname(frame.f_code.co_filename) == folder
               and os.path.basename(frame.f_code.co_filename) in ("serialization.py", "_weights_only_unpickler.py")
               for frame, _ in traceback.walk_tb(error.__traceback__))


def torch_load_error(path: str, error: BaseException) -> Optional[NormplugError]:
    """:func:`load_error` for an ``error`` torch.load raised reading ``path``; None for any other
    error, and for an error of the file system itself (OSError: permissions, a missing file)."""
    if isinstance(error, (NormplugError, OSError)) or not _raised_by_torch_load(error):
        return None
    return load_error(path, error)


def safe_load(path: str, map_location="cpu", mmap: bool = False):
    """Read a fairseq checkpoint with ``torch.load(weights_only=True)``: no code runs while
    unpickling, only tensors, builtin containers and :func:`fairseq_checkpoint_classes`.
    torch < 2.4 has no allow-list; there it loads as fairseq itself does (torch's default).
    ``mmap``: map the tensors instead of reading them (a whole zip-format file only).
    A refused or unreadable file raises :func:`load_error`'s one line."""
    try:
        if getattr(torch.serialization, "add_safe_globals", None) is None:
            return torch.load(path, map_location=map_location)
        allow_fairseq_checkpoint_classes()
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as error:
        refusal = torch_load_error(path, error)
        if refusal is None:
            raise
        raise refusal from None
