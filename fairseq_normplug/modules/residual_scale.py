"""Scaled residual connections, installed through fairseq's ``residual_connection(x, residual)``
hook of every Transformer layer (x is the sublayer output F(.) after dropout):

* ``rezero`` (Bachlechner et al. 2020, "ReZero is All You Need", section 3):
  residual + a * F, a learnable scalar per sublayer initialised to 0, so every layer is the
  identity at initialisation (the authors' Transformer code shares one a between the
  sublayers of a layer; here each sublayer has its own, like LayerScale's diag).
* ``layerscale`` (Touvron et al. 2021, "Going deeper with Image Transformers" (CaiT), section 2.1):
  residual + diag(lambda) F, a learnable per-channel vector per sublayer initialised to
  eps = 0.1 for depth <= 18, 1e-5 up to depth 24 and 1e-6 deeper (section 2.1).
* ``deepnorm`` (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers", Fig. 2 and
  Table 1, encoder-decoder column): PostNorm(residual * alpha + F), with
  encoder alpha = 0.81 (N^4 M)^(1/16), decoder alpha = (3M)^(1/4); its beta-scaled init is
  :func:`fairseq_normplug.modules.weight_init.apply_deepnorm_init`.
* ``admin`` (Liu et al. 2020, "Understanding the Difficulty of Training Transformers", eq. 7
  and section 4.2; authors' code LiyuanLucasLiu/Transformer-Clinic,
  ``fairseq/modules/transformer_layer.py``, ``--init-type adaptive-profiling``/``adaptive``):
  PostNorm(residual * omega + F), omega a learnable per-channel vector per sublayer, set by
  the profiling pass of :class:`AdminProfile` on the first training batch.
"""
import logging
import math
from typing import Dict, List

import torch
from torch import nn

from fairseq_normplug.modules.auto_init import input_moments
from fairseq_normplug.modules.mixins import mix_into

RESIDUAL_SCALES = ("none", "rezero", "layerscale", "deepnorm", "admin")
logger = logging.getLogger(__name__)


def layerscale_init(depth: int) -> float:
    """CaiT's initial diag value for a stack of ``depth`` layers (Touvron et al. 2021, 2.1)."""
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


def deepnorm_constants(encoder_layers: int, decoder_layers: int) -> Dict[str, float]:
    """DeepNet's encoder-decoder constants (Wang et al. 2022, Table 1) for N encoder and M
    decoder layers: residual weights alpha and init gains beta."""
    n, m = encoder_layers, decoder_layers
    return {
        "encoder_alpha": 0.81 * (n ** 4 * m) ** (1 / 16),
        "encoder_beta": 0.87 * (n ** 4 * m) ** (-1 / 16),
        "decoder_alpha": (3 * m) ** (1 / 4),
        "decoder_beta": (12 * m) ** (-1 / 4),
    }


class AdminProfile:
    """Admin's profiling of one stack (encoder or decoder): before the first training
    forward of a freshly built model, one extra forward of that batch without gradients
    (training mode, like the authors' separate ``adaptive-profiling`` run). Sublayer by
    sublayer in forward order: omega_i is set to the running ratio
    r (r = 1 before the first sublayer), the sublayer's output is computed with it, and then
    ``r = sqrt(Var[x_{i-1} * omega_i] + Var[F_i(x_{i-1})])``, so that
    omega_i^2 = 1 + sum_{j<i} Var[F_j] when the norms give unit variance (the paper's
    omega_i = sqrt(sum_{j<i} Var[F_j]), with the embedding counted as the first term).

    As in the authors' code, each variance is over every element of the batch, padding
    included, and F_i is the sublayer output after dropout. Here the moments are summed over
    all data-parallel ranks (``input_moments``), so every rank sets the same omegas; the
    authors profile on one GPU. Loading a state dict (resume, fairseq-generate) cancels it."""

    def __init__(self, stack: str):
        self.stack = stack
        self.ratio = 1.0
        self.pending: List["ResidualScale"] = []
        self.chosen: List[float] = []
        self.ranks = 1
        #: True during the profiling forward
        self.active = False

    @property
    def waiting(self) -> bool:
        """True until the stack is profiled (or its omegas are loaded)."""
        return any(scale.profile is self for scale in self.pending)

    def profile(self, scale: "ResidualScale", index: int, x: torch.Tensor, residual: torch.Tensor) -> None:
        with torch.no_grad():
            scale.gains[index].fill_(self.ratio)
            self.chosen.append(self.ratio)
            mean_in, square_in, _ = input_moments(residual * scale.gains[index])
            mean_out, square_out, self.ranks = input_moments(x)
            self.ratio = math.sqrt(max(square_in - mean_in ** 2, 0.0) + max(square_out - mean_out ** 2, 0.0))
        if index == scale.num_sublayers - 1:
            scale.profile = None
            self.pending.remove(scale)
            if not self.pending:
                logger.info("Admin: omega of the %s's %d residuals from the first training batch "
                            "(%d data-parallel rank%s): %s", self.stack, len(self.chosen), self.ranks,
                            "" if self.ranks == 1 else "s", " ".join(f"{v:.4g}" for v in self.chosen))


class ResidualScale(nn.Module):
    """``forward(x, residual)`` of one Transformer layer with ``num_sublayers`` residual
    connections, called once per sublayer in order (self-attention, [cross-attention], FFN)."""

    def __init__(self, kind: str, num_sublayers: int, dim: int, alpha: float = 1.0,
                 layerscale_eps: float = 0.1):
        super().__init__()
        if kind not in RESIDUAL_SCALES[1:]:
            raise ValueError(f"unknown residual scale {kind!r}; choose from {', '.join(RESIDUAL_SCALES[1:])}")
        self.kind = kind
        self.num_sublayers = num_sublayers
        self.alpha = alpha
        self.gains = None
        if kind == "rezero":
            self.gains = nn.Parameter(torch.zeros(num_sublayers))
        elif kind == "layerscale":
            self.gains = nn.Parameter(torch.full((num_sublayers, dim), float(layerscale_eps)))
        elif kind == "admin":  # omega, set by the profiling pass
            self.gains = nn.Parameter(torch.ones(num_sublayers, dim))
        #: the stack's Admin profiling, until this module's sublayers are profiled
        self.profile = None
        self.calls = 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.gains is None:
            return residual * self.alpha + x
        # modulo: layers wrapped by --checkpoint-activations re-run forward in backward
        index = self.calls % self.num_sublayers
        self.calls += 1
        if self.kind != "admin":
            return residual + self.gains[index] * x
        if self.profile is not None and self.profile.active:
            self.profile.profile(self, index, x, residual)
        return residual * self.gains[index] + x

    def _load_from_state_dict(self, *args, **kwargs):
        self.profile = None  # loaded omegas are already profiled
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        detail = f"alpha={self.alpha:.4f}" if self.kind == "deepnorm" else f"sublayers={self.num_sublayers}"
        return f"{self.kind}, {detail}"


class ResidualScaledLayer:
    """Mixin put in front of a fairseq Transformer layer class: its residual connections go
    through the layer's ``residual_scale`` module."""

    def residual_connection(self, x, residual):
        return self.residual_scale(x, residual)

    def forward(self, *args, **kwargs):
        self.residual_scale.calls = 0
        return super().forward(*args, **kwargs)


def install_residual_scale(model, kind: str) -> None:
    """Give every encoder/decoder layer of ``model`` a ``residual_scale`` of ``kind``."""
    if kind == "none":
        return
    n, m = len(model.encoder.layers), len(model.decoder.layers)
    constants = deepnorm_constants(n, m)
    profiles = []
    for name, stack, alpha, depth in (("encoder", model.encoder, constants["encoder_alpha"], n),
                                      ("decoder", model.decoder, constants["decoder_alpha"], m)):
        profile = AdminProfile(name) if kind == "admin" else None
        for layer in stack.layers:
            sublayers = 2 + (getattr(layer, "encoder_attn", None) is not None)
            layer.residual_scale = ResidualScale(kind, sublayers, layer.embed_dim, alpha=alpha,
                                                 layerscale_eps=layerscale_init(depth))
            if profile is not None:
                layer.residual_scale.profile = profile
                profile.pending.append(layer.residual_scale)
            mix_into(layer, ResidualScaledLayer, "ResidualScaled")
        if profile is not None:
            profiles.append(profile)
    if profiles:
        profile_before_first_training_forward(model, profiles)


def profile_before_first_training_forward(model: nn.Module, profiles: List[AdminProfile]) -> None:
    """Run Admin's profiling (:class:`AdminProfile`) as a forward of the first training batch
    without gradients, just before the model's first training forward (a pre-hook, removed
    after it ran; nothing happens when the omegas were loaded from a state dict)."""

    def profile(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return
        handle.remove()
        waiting = [p for p in profiles if p.waiting]
        if not waiting:
            return
        for p in waiting:
            p.active = True
        try:
            with torch.no_grad():
                module(*args, **kwargs)
        finally:
            for p in waiting:
                p.active = False

    handle = model.register_forward_pre_hook(profile, with_kwargs=True)
