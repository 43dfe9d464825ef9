"""Data-driven init of the element-wise norms' input scale: ``--dyt-alpha-init auto``,
``--derf-alpha-init auto``, ``--dyisru-beta-init auto``.

The DyT paper (section 6) finds that the learned alpha tracks 1/std of the norm's input.
With ``auto``, before the first update each marked norm (``module.auto_init``) sets its scale
from its own input on the first training batch: DyT and Derf alpha0 = 1/std, DyISRU
beta0 = (C - 1) * mean(x^2) (``init_from_input`` of each module). The norms are initialised in
forward order, each in a forward pre-hook, so a later norm sees the input that the already
initialised earlier norms produce. The moments are taken over every element of the input
(padding positions included) and summed over all data-parallel ranks (one all-reduce of three
numbers per norm), so every rank chooses the same values. One log line records them.

The init runs only on a training forward of a freshly built model: loading any state dict
(resume, ``--restore-file``, fairseq-generate, the hub) cancels it, and evaluation forwards
never trigger it.
"""
import logging
from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

#: how each auto-initialised parameter is chosen (for the log line)
AUTO_RULES = {"alpha": "1/std of the norm's input", "beta": "(d-1)*mean(x^2) of the norm's input"}


def _sum_over_ranks(t: torch.Tensor) -> int:
    """Sum ``t`` in place over the data-parallel ranks; return their number."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    from fairseq.distributed import utils as dist_utils

    world = dist_utils.get_data_parallel_world_size()
    if world > 1:
        dist_utils.all_reduce(t, group=dist_utils.get_data_parallel_group())
    return world


def input_moments(x: torch.Tensor):
    """(mean, mean of squares, number of ranks) of ``x`` over every element on every rank."""
    xd = x.detach().to(torch.float64)
    sums = torch.stack([xd.sum(), xd.square().sum(), torch.tensor(float(xd.numel()), dtype=torch.float64,
                                                                device=xd.device)])
    ranks = _sum_over_ranks(sums)
    total, total_sq, count = sums.tolist()
    return total / max(count, 1.0), total_sq / max(count, 1.0), ranks


class AutoScaleInit:
    """Installs the one-shot init hooks on the marked norms of ``named_norms``."""

    def __init__(self, named_norms: Dict[str, nn.Module]):
        self.pending = {name: norm for name, norm in named_norms.items()
                        if getattr(norm, "auto_init", False)}
        self.chosen: Dict[str, float] = {}
        self.ranks = 1
        self.handles = {name: norm.register_forward_pre_hook(self._hook(name))
                        for name, norm in self.pending.items()}

    @property
    def waiting(self) -> bool:
        """True until every marked norm is initialised (or the init is cancelled)."""
        return bool(self.handles)

    def cancel(self) -> None:
        """Drop the hooks: the model's values come from a loaded state dict."""
        for handle in self.handles.values():
            handle.remove()
        self.handles = {}

    def _hook(self, name: str):
        def init(module, inputs):
            if not (module.training and torch.is_grad_enabled()) or name not in self.handles:
                return
            mean, mean_square, self.ranks = input_moments(inputs[0])
            self.chosen[name] = module.init_from_input(mean, mean_square)
            self.handles.pop(name).remove()
            if not self.handles:
                self._log()

        return init

    def _log(self) -> None:
        values = " ".join(f"{name}={value:.4g}" for name, value in self.chosen.items())
        params = sorted({norm.auto_init_parameter for norm in self.pending.values()})
        rules = ", ".join(f"{param} = {AUTO_RULES.get(param, 'set from the input')}" for param in params)
        logger.info("auto init of %s from the first training batch (%s; %d data-parallel rank%s): %s",
                    "/".join(params), rules, self.ranks, "" if self.ranks == 1 else "s", values)
