"""Loading fairseq checkpoints under torch >= 2.6, whose ``torch.load`` defaults to
``weights_only=True``. Instead of switching safe loading off, the few non-tensor classes a
fairseq checkpoint holds are allow-listed with ``torch.serialization.add_safe_globals``."""
import torch


def fairseq_checkpoint_classes():
    """The classes pickled inside fairseq checkpoints (config, args, meters, numpy scalars)."""
    import argparse
    import collections
    import typing

    import numpy as np
    from omegaconf import DictConfig, ListConfig, nodes
    from omegaconf.base import ContainerMetadata, Metadata

    classes = [
        argparse.Namespace,
        collections.OrderedDict,
        collections.defaultdict,
        typing.Any,
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        nodes.AnyNode,
        nodes.BooleanNode,
        nodes.FloatNode,
        nodes.IntegerNode,
        nodes.StringNode,
        nodes.EnumNode,
        nodes.ValueNode,
        dict,
        list,
        set,
        tuple,
        int,
        float,
        bool,
        str,
        np.dtype,
        np.ndarray,
    ]
    classes += [getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType")]
    for module, name in (("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                         ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")):
        try:
            classes.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    from fairseq.logging import meters

    classes += [
        meters.AverageMeter,
        meters.SumMeter,
        meters.TimeMeter,
        meters.StopwatchMeter,
        meters.MetersDict,
    ]
    from fairseq.dataclass import constants

    classes += [
        value
        for value in vars(constants).values()
        if isinstance(value, type) and issubclass(value, __import__("enum").Enum)
    ]
    return classes


def allow_fairseq_checkpoint_classes() -> None:
    """Allow-list :func:`fairseq_checkpoint_classes` for ``torch.load(weights_only=True)``.
    A no-op on torch versions without ``add_safe_globals`` (< 2.4), which load unsafely anyway."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(fairseq_checkpoint_classes())
