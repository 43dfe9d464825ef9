"""Data-driven init of the element-wise norms' input scale: ``--dyt-alpha-init auto``,
``--derf-alpha-init auto``, ``--dyisru-beta-init auto``.

The DyT paper (section 6) finds that the learned alpha tracks 1/std of the norm's input.
With ``auto``, before the first update each marked norm (``module.auto_init``) sets its scale
from its own input on the first training batch: DyT and Derf alpha0 = 1/std, DyISRU
beta0 = (C - 1) * mean(x^2) (``init_from_input`` of each module). The norms are initialised in
forward order, each in a forward pre-hook, so a later norm sees the input that the already
initialised earlier norms produce. The moments are taken over the input's real tokens only:
padding positions (``<pad>`` in the encoder's ``src_tokens`` or the decoder's
``prev_output_tokens``, recorded by a pre-hook on each stack) are left out, so a padded batch
gives the same values as its sentences unpadded (fairseq zeroes padded embeddings, which would
pull the std down). Each norm's tokens come from its own stack (``enc*`` norms: the source,
``dec*``: the decoder input), laid out time-first (T, B, C), or batch-first (B, T, C) for the
embedding norms (``enc.embed``, ``dec.embed``). The sums are then added over all data-parallel
ranks (one all-reduce of three numbers per norm: sum, sum of squares, count), so every rank
chooses the same values. One log line records them.

The init runs only on a training forward of a freshly built model: loading any state dict
(resume, ``--restore-file``, fairseq-generate, the hub) cancels it, and evaluation forwards
never trigger it.
"""
import logging
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

#: how each auto-initialised parameter is chosen (for the log line)
AUTO_RULES = {"alpha": "1/std of the norm's input at non-pad tokens",
              "beta": "(d-1)*mean(x^2) of the norm's input at non-pad tokens"}


def sum_over_ranks(t: torch.Tensor) -> int:
    """Sum ``t`` in place over the data-parallel ranks; return their number."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    from fairseq.distributed import utils as dist_utils

    world = dist_utils.get_data_parallel_world_size()
    if world > 1:
        dist_utils.all_reduce(t, group=dist_utils.get_data_parallel_group())
    return world


#: norms whose input is batch-first (B, T, C): the embedding norms; all others are (T, B, C)
BATCH_FIRST_NORMS = (".embed",)


def real_token_rows(x: torch.Tensor, padding: Optional[torch.Tensor], batch_first: bool) -> torch.Tensor:
    """The rows of ``x`` at real tokens: ``padding`` is the stack's (B, T) pad mask; ``x`` is
    (T, B, C), or (B, T, C) if ``batch_first``. Without a mask of the matching shape, all of ``x``."""
    if padding is None:
        return x
    keep = ~padding if batch_first else ~padding.t()
    if x.dim() < 3 or tuple(x.shape[:2]) != tuple(keep.shape):
        logger.warning("auto init: a norm input of shape %s does not match the %s pad mask of shape %s; "
                       "its moments include every position", tuple(x.shape),
                       "batch-first" if batch_first else "time-first", tuple(keep.shape))
        return x
    return x[keep.to(x.device)]


def input_moments(x: torch.Tensor):
    """(mean, mean of squares, number of ranks) of ``x`` over every element on every rank."""
    xd = x.detach().to(torch.float64)
    sums = torch.stack([xd.sum(), xd.square().sum(), torch.tensor(float(xd.numel()), dtype=torch.float64,
                                                                device=xd.device)])
    ranks = sum_over_ranks(sums)
    total, total_sq, count = sums.tolist()
    return total / max(count, 1.0), total_sq / max(count, 1.0), ranks


class AutoScaleInit:
    """Installs the one-shot init hooks on the marked norms of ``named_norms``; ``stacks``
    ({"enc": encoder, "dec": decoder}) get a pre-hook recording their batch's padding."""

    def __init__(self, named_norms: Dict[str, nn.Module], stacks: Optional[Dict[str, nn.Module]] = None):
        self.pending = {name: norm for name, norm in named_norms.items()
                        if getattr(norm, "auto_init", False)}
        self.chosen: Dict[str, float] = {}
        self.ranks = 1
        self.padding: Dict[str, torch.Tensor] = {}
        self.handles = {name: norm.register_forward_pre_hook(self._hook(name))
                        for name, norm in self.pending.items()}
        self.stack_handles = [stack.register_forward_pre_hook(self._padding_hook(prefix, stack), with_kwargs=True)
                              for prefix, stack in (stacks or {}).items() if self.handles]

    @property
    def waiting(self) -> bool:
        """True until every marked norm is initialised (or the init is cancelled)."""
        return bool(self.handles)

    def cancel(self) -> None:
        """Drop the hooks: the model's values come from a loaded state dict."""
        for handle in self.handles.values():
            handle.remove()
        self.handles = {}
        self._drop_stack_hooks()

    def _drop_stack_hooks(self) -> None:
        for handle in self.stack_handles:
            handle.remove()
        self.stack_handles, self.padding = [], {}

    def _padding_hook(self, prefix: str, stack: nn.Module):
        def record(module, args, kwargs):
            tokens = args[0] if args else kwargs.get("src_tokens", kwargs.get("prev_output_tokens"))
            pad = getattr(stack, "padding_idx", None)
            if torch.is_tensor(tokens) and tokens.dim() == 2 and pad is not None:
                self.padding[prefix] = tokens.eq(pad)

        return record

    def _hook(self, name: str):
        prefix = name.split(".")[0].rstrip("0123456789")  # enc0.attn -> enc, dec.final -> dec

        def init(module, inputs):
            if not (module.training and torch.is_grad_enabled()) or name not in self.handles:
                return
            rows = real_token_rows(inputs[0], self.padding.get(prefix), name.endswith(BATCH_FIRST_NORMS))
            mean, mean_square, self.ranks = input_moments(rows)
            self.chosen[name] = module.init_from_input(mean, mean_square)
            self.handles.pop(name).remove()
            if not self.handles:
                self._drop_stack_hooks()
                self._log()

        return init

    def _log(self) -> None:
        values = " ".join(f"{name}={value:.4g}" for name, value in self.chosen.items())
        params = sorted({norm.auto_init_parameter for norm in self.pending.values()})
        rules = ", ".join(f"{param} = {AUTO_RULES.get(param, 'set from the input')}" for param in params)
        logger.info("auto init of %s from the first training batch (%s; %d data-parallel rank%s): %s",
                    "/".join(params), rules, self.ranks, "" if self.ranks == 1 else "s", values)
