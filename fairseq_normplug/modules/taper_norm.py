"""TaperNorm (Kanavalau, Amo Alonso & Lall 2026, "Gated Removal of Normalization in
Transformers", arXiv 2602.10408; no public code): a norm that starts as LayerNorm and tapers
to a fixed, sample-independent affine map,

    TaperNorm(x) = g * LN(x) + (1 - g) * (gamma * (s * x) + beta),

with LN's own gamma and beta (shared by both branches), ``s`` a scalar scaling calibrated as an
exponential moving average of 1 / std(x) while the gate is 1, then frozen, and one global gate
``g`` that follows the update number (:func:`taper_gate`): 1 until START, a cosine from 1 to 0
between START and END, 0 from END on (``--taper-updates START END``). At g = 0 no per-token
statistic is computed and the map folds into the next linear layer
(``diagnostics/fold.py``, ``scripts/convert_norms.sh ... --to folded``).

The final norm: the paper tapers the internal norms and keeps the output norm, which anchors
the scale of the pre-logit representation (without it cross-entropy grows the logits, "logit
chasing"; its norm-free ablation needs an extra scale loss that this plugin does not build).
So the norm that feeds the output layer is a TaperNorm that never tapers (``tapers=False``:
its gate stays 1, it is exactly LayerNorm); every other norm, the encoder's final norm included
(it feeds the cross-attention's linear k/v), tapers.

The gate is a buffer set by ``set_num_updates`` (fairseq calls ``model.set_num_updates`` at
every training step and on checkpoint load; ``BaseFairseqModel`` forwards it to every
submodule), so a checkpoint stores it and validation and decoding use the training gate.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.auto_init import sum_over_ranks
from fairseq_normplug.modules.float32_params import HALF_DTYPES
from fairseq_normplug.modules.fused import upcast
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.modules.norm_registry import register_norm

#: decay of the moving average of 1/std that calibrates ``s`` (this project's choice: the
#: paper's value was not available to us)
TAPER_EMA_DECAY = 0.99
#: LayerNorm's eps (torch and fairseq default)
TAPER_EPS = 1e-5


def taper_gate(num_updates: int, start: int, end: int) -> float:
    """The gate g after ``num_updates`` updates: 1 until ``start``, 0 from ``end``, and
    (1 + cos(pi (n - start) / (end - start))) / 2 in between (0.5 at the midpoint)."""
    if num_updates <= start:
        return 1.0
    if num_updates >= end:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * (num_updates - start) / (end - start)))


@register_norm("tapernorm")
class TaperNorm(FormulaNorm):
    """LayerNorm tapered to ``gamma * (s x) + beta`` by the gate ``g`` (module docstring):
    parameters ``weight`` (gamma) and ``bias`` (beta), buffers ``gate`` (g) and
    ``inv_std`` (s; 0 until the first calibration batch). Computed in float32 for fp16/bf16.
    ``tapers=False`` (the output norm): the gate stays 1."""

    @staticmethod
    def add_args(parser):
        parser.add_argument("--taper-updates", type=int, nargs=2, metavar=("START", "END"),
                            help="TaperNorm gate: 1 until update START (its scaling is calibrated "
                                 "meanwhile), cosine to 0 at update END, 0 after")
        parser.add_argument("--taper-folded", action="store_true",
                            help="the tapered norms are folded into the linear layers (set in the "
                                 "checkpoint by convert_norms.sh --to folded, not by hand)")

    @classmethod
    def check_args(cls, args):
        updates = getattr(args, "taper_updates", None)
        if updates is None:
            raise NormplugError("--norm-type tapernorm needs --taper-updates START END (the gate is 1 "
                                "until update START and 0 from update END)")
        start, end = updates
        if start < 1 or end < start:
            raise NormplugError(f"--taper-updates START END needs 1 <= START <= END (at least one update "
                                f"at gate 1 calibrates the scaling), got {start} {end}")

    @classmethod
    def build(cls, dim, args, slot):
        """The output norm never tapers (the paper's scale anchor); in a folded checkpoint
        (``taper_folded``) the other norms are parameter-free placeholders."""
        if getattr(args, "taper_folded", False) and not slot.feeds_output:
            return IdentityNorm(dim)
        return cls(dim, *args.taper_updates, tapers=not slot.feeds_output)

    def __init__(self, dim: int, start: int, end: int, tapers: bool = True):
        super().__init__(dim)
        self.start, self.end, self.tapers = start, end, tapers
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("gate", torch.tensor(1.0))
        self.register_buffer("inv_std", torch.tensor(0.0))
        #: the python mirror of ``gate``: forward branches on it without a device sync
        self.gate_value = 1.0

    def _apply(self, fn, recurse=True):
        """``gate`` and ``inv_std`` stay float32 in fp16/bf16 models, as the scalars do."""
        super()._apply(fn, recurse)
        for name in ("gate", "inv_std"):
            if getattr(self, name).dtype in HALF_DTYPES:
                setattr(self, name, getattr(self, name).float())
        return self

    def set_num_updates(self, num_updates: int) -> None:
        if self.tapers:
            self.gate.fill_(taper_gate(num_updates, self.start, self.end))
            self.gate_value = float(self.gate)  # float32-rounded, as after a checkpoint load

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.gate_value = float(self.gate)

    def formula(self, x, weight, bias):
        """g LN(x) + (1 - g) (gamma s x + beta), in the dtype of ``x``; at g = 1 only LN(x),
        at g = 0 only the affine map (no per-token statistic), the same values."""
        g = self.gate_value
        normed = F.layer_norm(x, (self.dim,), weight, bias, TAPER_EPS) if g > 0 else None
        fixed = torch.addcmul(bias, x * self.inv_std.to(x.dtype), weight) if g < 1 else None
        if fixed is None:
            return normed
        if normed is None:
            return fixed
        return g * normed + (1 - g) * fixed

    def calibrate(self, x: torch.Tensor) -> None:
        """One EMA step of ``s`` towards 1 / (mean std of the tokens of ``x``, averaged over
        the data-parallel ranks, so that every rank keeps the same ``s``); the first batch sets it."""
        with torch.no_grad():
            std = torch.sqrt(x.var(-1, unbiased=False) + TAPER_EPS).mean()
            ranks = sum_over_ranks(std)
            value = ranks / std
            ema = TAPER_EMA_DECAY * self.inv_std + (1 - TAPER_EMA_DECAY) * value
            self.inv_std.copy_(torch.where(self.inv_std > 0, ema, value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        if self.training and self.tapers and self.gate_value >= 1:
            self.calibrate(xf)
        return self.formula(xf, upcast(self.weight), upcast(self.bias)).to(x.dtype)

    def logged_stats(self):
        """``--norm-stats-interval``: the gate g (``taper_gate:<norm>``) and s (``taper_s:<norm>``)."""
        return {"taper_gate": float(self.gate), "taper_s": float(self.inv_std)}

    def affine_map(self):
        """(scale, shift) of the fixed branch, per channel: ``x -> scale * x + shift``."""
        return self.weight * self.inv_std, self.bias

    def extra_repr(self) -> str:
        if not self.tapers:
            return f"{self.dim}, tapers=False"
        return (f"{self.dim}, taper_updates=({self.start}, {self.end}), gate={float(self.gate):.4g}, "
                f"inv_std={float(self.inv_std):.4g}")
