"""Cheap training-time records of every norm layer, for the papers' figures: ScaleNorm g
("Transformers without Tears", Fig. 3-4), DyT alpha against 1/std of its input (DyT paper,
section 6), the other norms' scalars (Derf alpha and shift, DyISRU beta), the mean gain
of LayerNorm/RMSNorm/DyT/Derf/DyISRU and, for DyT, the saturated fraction of its input
(``|alpha x| > 2``, the flat part of tanh).

Forward pre-hooks read each norm's input only on sampled updates (every ``interval``
updates, training mode only) and log into fairseq's metrics, so the values land in the
``train_inner`` records of the training log under keys such as ``g:dec2.ffn``,
``alpha:enc0.attn``, ``gain:enc1.ffn``, ``in_std:dec0.cross`` and ``sat:enc0.ffn``
(any norm with a ``saturated_fraction(x)`` method: DyT), plus what a module's
``logged_stats()`` returns (TaperNorm's gate, SeeDNorm's alpha and beta). The modules are the
norms and what a placement or modifier's ``logged_modules`` adds (GPAS's gates). With interval 0
no hook is installed at all.
"""
from typing import Dict

import torch
from fairseq.logging import metrics
from torch import nn

from fairseq_normplug.modules.norm_base import effective_gain


def norm_scale_stats(norm: nn.Module) -> Dict[str, float]:
    """The scalar(s) that describe a norm's learned scale: each scalar parameter (ScaleNorm g,
    DyT/Derf alpha, Derf shift, DyISRU beta; the mean of a per-channel alpha,
    ``--dyt-alpha-per-channel``) and the mean |gain| of the gain applied (1 + gamma with
    ``--zero-centered-gamma``, ``norm_base.effective_gain``)."""
    scale = getattr(norm, "auto_init_parameter", None)
    stats = {name: float(p.detach().float().mean()) for name, p in norm.named_parameters(recurse=False)
             if p.dim() == 0 or name == scale}
    gain = effective_gain(norm)
    if gain is not None:
        stats["gain"] = float(gain.detach().abs().mean())
    return stats


class NormStatsRecorder:
    """Installs the sampling hooks on ``named_norms`` ({short name: norm module})."""

    def __init__(self, named_norms: Dict[str, nn.Module], interval: int):
        self.interval = interval
        self.active = False
        # the hooks stay for the model's life: no handles are kept (a torch RemovableHandle of a
        # module later replaced, as convert_norms.sh replaces norms, breaks copy.deepcopy of the model)
        if interval > 0:
            for name, norm in named_norms.items():
                norm.register_forward_pre_hook(self._hook(name))

    def set_num_updates(self, num_updates: int) -> None:
        self.active = self.interval > 0 and num_updates % self.interval == 0

    def _hook(self, name: str):
        def record(module, inputs):
            if not (self.active and module.training):
                return
            with torch.no_grad():
                metrics.log_scalar(f"in_std:{name}", float(inputs[0].float().std()), round=4)
                if hasattr(module, "saturated_fraction"):
                    metrics.log_scalar(f"sat:{name}", module.saturated_fraction(inputs[0]), round=4)
                logged = getattr(module, "logged_stats", None)
                for stat, value in {**norm_scale_stats(module), **(logged() if logged else {})}.items():
                    metrics.log_scalar(f"{stat}:{name}", value, round=4)

        return record
