"""LayerNorm whose per-token std becomes a frozen constant: the ``layernorm-fixed-std`` norm type
of ``convert_norms.sh --to none`` (Heimersheim 2024, "You can remove GPT2's LayerNorm by
fine-tuning", arXiv 2409.13710; the authors' ``FakeLayerNorm``, ApolloResearch/gpt2_noLN
``model.py:20-58``):

    until its removal:  gamma * (x - mean(x)) / sqrt(var(x) + eps) + beta     (LayerNorm)
    after it:           gamma * (x - mean(x)) / c + beta                       (model.py:50)

``c`` (buffer ``fixed_std``) is the average per-token std of the norm's input, measured on data
by the converter (the authors' ``std_dicts.py`` constants). ``removal_update`` (buffer) is the
number of completed updates after which the norm switches to ``c``: fairseq's trainer calls
``set_num_updates`` on every model submodule after each update (the authors switch one norm
at a time in ``train.py:274-310``); -1 (the default) never switches, so a model trained from
scratch with this type is LayerNorm. ``removed`` (buffer) records the switch, so a saved model
decodes with ``c`` without a trainer. After the switch the norm is a fixed affine map of x.

``--fixed-std-folded``: the model was folded by ``convert_norms.sh --to none`` (PreNorm only):
every sublayer norm (``encN.attn``, ``decN.attn``, ``decN.cross``, ``*.ffn``) and the encoder's
final norm are the identity, their maps folded into the linear layers they feed
(``diagnostics/remove_norms.py``); the decoder's final norm (and an embedding norm) stays this
fixed affine map, as the authors' ``ln_f`` keeps its gamma/beta beside the tied embedding.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.modules.fused import upcast
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.norm_base import FormulaNorm
from fairseq_normplug.modules.norm_registry import register_norm

#: ``removal_update`` of a norm that is never switched to its fixed std
NEVER = -1
#: the short names (after ``encN.``/``decN.``) of the PreNorm sites whose norm feeds only linear
#: layers, and the stack norm that does (the encoder output feeds cross-attention's k/v only)
FOLDED_LAYER_SITES = ("attn", "cross", "ffn")
FOLDED_STACK_SITES = ("enc.final",)


def is_folded_site(name: str) -> bool:
    """Whether ``--fixed-std-folded`` folds the norm at site ``name`` (module docstring)."""
    stack, _, short = name.partition(".")
    return name in FOLDED_STACK_SITES or (stack[3:].isdigit() and stack[:3] in ("enc", "dec")
                                          and short in FOLDED_LAYER_SITES)


@register_norm("layernorm-fixed-std")
class FixedStdLayerNorm(FormulaNorm):
    """LayerNorm until ``removal_update`` updates, then gamma (x - mean x) / c + beta with a
    frozen c (module docstring; Heimersheim 2024, gpt2_noLN ``model.py:50``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("fixed_std", torch.tensor(1.0))
        self.register_buffer("removal_update", torch.tensor(NEVER))
        self.register_buffer("removed", torch.tensor(False))
        #: the python mirror of ``removed`` (no device sync in forward)
        self.uses_fixed_std = False

    @staticmethod
    def add_args(parser):
        parser.add_argument("--fixed-std-folded", action="store_true",
                            help="(written by convert_norms.sh --to none) the PreNorm sublayer norms "
                                 "and the encoder's final norm are folded into the linear layers they "
                                 "feed: identity modules")

    @classmethod
    def prenorm_requirement(cls, args) -> Optional[str]:
        """Why these flags need a PreNorm-like placement (its capabilities, checked where the
        placement is resolved: ``models/normplug_args.py``), or None: the folded norms feed only
        linear layers there."""
        if getattr(args, "fixed_std_folded", False):
            return "--fixed-std-folded needs PreNorm (the folded norms feed only linear layers there)"
        return None

    @classmethod
    def build(cls, dim, args, slot):
        if getattr(args, "fixed_std_folded", False) and is_folded_site(slot.name):
            return IdentityNorm(dim)
        return cls(dim, eps=getattr(args, "norm_eps", None) or 1e-5)

    @classmethod
    def from_layer_norm(cls, layer_norm: nn.Module, gain: torch.Tensor, fixed_std: float,
                        removal_update: int = 0) -> "FixedStdLayerNorm":
        """This norm with ``layer_norm``'s applied ``gain`` (gamma), bias and eps, ``c =
        fixed_std``; removed now when ``removal_update`` is 0, else after that many updates."""
        norm = cls(gain.numel(), eps=layer_norm.eps).to(gain.device)
        with torch.no_grad():
            norm.weight.copy_(gain)
            norm.bias.copy_(layer_norm.bias)
            norm.fixed_std.fill_(fixed_std)
            norm.removal_update.fill_(removal_update)
        norm.set_num_updates(0)
        return norm

    def set_num_updates(self, num_updates: int) -> None:
        """fairseq's per-update hook: switch to the fixed std once ``removal_update`` is reached."""
        if not self.uses_fixed_std and 0 <= int(self.removal_update) <= num_updates:
            self.removed.fill_(True)
            self.uses_fixed_std = True

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.uses_fixed_std = bool(self.removed)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fixed_std.data = self.fixed_std.data.float()  # c stays float32 in fp16/bf16 models
        return self

    def formula(self, x, weight, bias):
        if not self.uses_fixed_std:
            return F.layer_norm(x, (self.dim,), weight, bias, self.eps)
        return (x - x.mean(-1, keepdim=True)) / self.fixed_std.to(x.dtype) * weight + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        return self.formula(xf, self.weight.to(xf.dtype), self.bias.to(xf.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        state = f"c={float(self.fixed_std):.4g}" if self.uses_fixed_std else \
            f"LayerNorm until update {int(self.removal_update)}" if int(self.removal_update) >= 0 else "LayerNorm"
        return f"{self.dim}, eps={self.eps:g}, {state}"
