"""σReparam (Zhai, Likhomanenko, Littwin et al., "Stabilizing Transformer Training by Preventing
Attention Entropy Collapse", ICML 2023, arXiv:2303.06296; authors' code apple/ml-sigma-reparam at fea4e35,
``vision/layers.py``, the PyTorch implementation the paper also used for its MT models): every
linear weight W is reparameterised as

    W_hat = gamma / sigma(W) * W,

sigma(W) the spectral norm of W (its largest singular value) estimated by one step of power
iteration per training forward, gamma a learned scalar.

* Power iteration (``SpectralNormedWeight.get_sigma``, ``vision/layers.py:34-43``), without
  gradient through u and v: v = normalize(W u), u <- normalize(W^T v), sigma = v^T W u, the
  gradient flowing through W only. u is stored (a buffer) in training mode only (line 40-41), so
  evaluation repeats the step from the stored u without storing anything: eval and incremental
  decoding are deterministic.
* Init (``SpectralNormedWeight.__init__``, lines 28-32, and ``SNLinear.__init__``, lines 115-125):
  u = the first right singular vector of W from an SVD, gamma = sigma_1(W) (so W_hat = W at
  init). The authors draw W ~ trunc_normal(0.02) first (line 112); here W keeps fairseq's init
  (or ``--weight-init``), and the SVD is taken once every init has run.
* Which weights: the authors' ``convert_to_sn`` (lines 254-286) turns every ``nn.Linear`` into an
  ``SNLinear``; ``nn.Embedding`` is left. Here: every ``nn.Linear`` of the encoder and decoder
  (attention q/k/v/out projections of self- and cross-attention, FFN fc1/fc2, the linears other
  designs add to a layer, fairseq's ``project_in_dim``/``project_out_dim``, and the output
  projection when it has its own weight). A projection tied to an embedding table (the presets'
  shared output projection) is the embedding and stays plain.

How: each such linear gets a child ``sigma_reparam`` (:class:`SpectralScale`: gamma, float32 in
fp16/bf16 models, and the float32 buffers u, v), and its class a mixin whose forward runs the
linear's own forward with W_hat = gamma / sigma(W) * W in place of W (computed in float32, cast to
W's dtype, put back after the call, also on an exception). So any linear variant that reads its
``weight`` in its forward sees W_hat (NormFormer's head-scaled ``out_proj``, HybridNorm's
QKV-normed projections, the gated ``out_proj``, fairseq's quant-noise hooks see W), nothing is
rebuilt, every parameter keeps its name, and the activations are those of the plain model (only a
weight-sized W_hat is added). The power iteration of a training forward runs once per stack call,
in a forward pre-hook of the encoder and of the decoder (outside fairseq's
``--checkpoint-activations`` wrappers), and stores u and v; inside the layers sigma = v^T W u is
then read from the stored vectors, so a checkpointed layer's recomputation sees the same sigma as
its forward. It depends on W only, so data-parallel ranks agree. Every attention takes fairseq's
own path (``_set_skip_embed_dim_check``: the fast paths read ``q_proj.weight`` themselves).

Refused: ``--ngpt`` (nGPT renormalises every matrix after each step and scales it itself),
``--qknorm`` (it rebuilds q_proj/k_proj after the model is built and normalises each head's q
and k, which cancels gamma / sigma) and fairseq's xFormers attention configs.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_normplug.modules.float32_params import HALF_DTYPES, Float32Params
from fairseq_normplug.models.placements.base import Modifier, register_modifier
from fairseq_normplug.modules.mixins import mix_into


class SpectralScale(Float32Params):
    """gamma / sigma(W) of one linear weight W (out x in), with the power-iteration vectors u (in)
    and v (out). gamma (0-dim) and u, v stay float32 in fp16/bf16 models; sigma is computed in
    float32. Built from W's current value: u, v its first singular vectors, gamma = sigma_1(W)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        with torch.no_grad():
            left, singular, right = torch.linalg.svd(weight.detach().float(), full_matrices=False)
        self.register_buffer("u", right[0].clone())  # the authors' u (vh[0], in_features)
        self.register_buffer("v", left[:, 0].clone())  # v = normalize(W u) at the SVD's fixed point
        self.gamma = nn.Parameter(singular[0].clone())

    @staticmethod
    def computed(tensor: Tensor) -> Tensor:
        """``tensor`` in the dtype sigma is computed in: float32, or float64 for a float64 model."""
        return tensor if tensor.dtype == torch.float64 else tensor.float()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in ("u", "v"):
            if self._buffers[name].dtype in HALF_DTYPES:
                self._buffers[name] = self._buffers[name].float()
        return self

    @torch.no_grad()
    def power_iteration(self, weight: Tensor) -> None:
        """One step from the stored u, stored: v = normalize(W u), u = normalize(W^T v) (training)."""
        w = self.computed(weight.detach())
        v = F.normalize(w.mv(self.u), dim=0)
        self.u.copy_(F.normalize(w.t().mv(v), dim=0))
        self.v.copy_(v)

    def sigma(self, weight: Tensor) -> Tensor:
        """sigma(W) = v^T W u, with gradient through W. Training: u, v as the last
        :meth:`power_iteration` stored them; eval: one step from the stored u, nothing stored."""
        u, v = self.u, self.v
        if not self.training:
            with torch.no_grad():
                w = self.computed(weight.detach())
                v = F.normalize(w.mv(u), dim=0)
                u = F.normalize(w.t().mv(v), dim=0)
        return torch.einsum("c,cd,d->", v, self.computed(weight), u)

    def forward(self, weight: Tensor) -> Tensor:
        """gamma / sigma(W), float32 (0-dim)."""
        return self.computed(self.gamma) / self.sigma(weight)

    def extra_repr(self) -> str:
        return f"in={self.u.numel()}, out={self.v.numel()}"


class SigmaReparamLinearMixin:
    """Put in front of a linear's class: its forward sees W_hat = gamma / sigma(W) W as ``weight``.
    Without gradients in eval mode (decoding: every step calls every linear) W_hat is computed
    once and kept until W, gamma or u change (their in-place versions, their storage, the dtype)."""

    def reparameterized_weight(self, weight: Tensor) -> Tensor:
        scale = self.sigma_reparam
        if self.training or torch.is_grad_enabled():
            self.__dict__.pop("_sigma_reparam_cache", None)
            return (scale.computed(weight) * scale(weight)).to(weight.dtype)
        key = tuple((t._version, t.data_ptr(), t.dtype) for t in (weight, scale.gamma, scale.u))
        cached = self.__dict__.get("_sigma_reparam_cache")
        if cached is None or cached[0] != key:
            cached = (key, (scale.computed(weight) * scale(weight)).to(weight.dtype))
            self.__dict__["_sigma_reparam_cache"] = cached
        return cached[1]

    def forward(self, *args, **kwargs):
        weight = self._parameters["weight"]
        self._parameters["weight"] = self.reparameterized_weight(weight)
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters["weight"] = weight


def update_spectral_estimates(stack: nn.Module, inputs) -> None:
    """Forward pre-hook of the encoder and the decoder: in training mode, one power-iteration step
    for every reparameterised linear of the stack (once per stack call, outside the layers'
    activation checkpointing)."""
    if stack.training:
        for module in stack.modules():
            if isinstance(module, nn.Linear) and isinstance(getattr(module, "sigma_reparam", None), SpectralScale):
                module.sigma_reparam.power_iteration(module.weight)


def install_sigma_reparam(linear: nn.Linear) -> None:
    """Reparameterise one linear: W_hat = gamma / sigma(W) W from W's current value (W_hat = W)."""
    linear.sigma_reparam = SpectralScale(linear.weight)
    mix_into(linear, SigmaReparamLinearMixin, "SigmaReparam")


def reparameterized_linears(model: nn.Module):
    """Every ``nn.Linear`` of the encoder and the decoder whose weight is not an embedding table's."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    return [module for stack in (model.encoder, model.decoder) for module in stack.modules()
            if isinstance(module, nn.Linear) and id(module.weight) not in embeddings]


@register_modifier("sigma-reparam")
class SigmaReparam(Modifier):
    """Every linear weight as gamma / sigma(W) W (module docstring)."""

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--sigma-reparam", action="store_true",
            help="sigmaReparam (Zhai et al. 2023): every linear weight W (attention projections, FFN, an "
                 "untied output projection) reparameterised as gamma/sigma(W)*W, sigma the spectral norm by "
                 "one power-iteration step per training forward, gamma learned (init sigma(W)); every "
                 "placement and norm type")

    def __init__(self, args, placement):
        super().__init__(args, placement)
        if getattr(args, "ngpt", False):
            self.refuse("--sigma-reparam cannot be combined with --ngpt: nGPT renormalises every matrix after "
                        "each step and scales it itself")
        if getattr(args, "qknorm", False):
            self.refuse("--sigma-reparam cannot be combined with --qknorm: QKNorm rebuilds q_proj/k_proj after "
                        "the model is built and normalises each head's q and k, which cancels gamma/sigma(W)")
        self.refuse_xformers(args, "xFormers attention reads the projection weights itself and would skip "
                                   "the reparameterisation")

    def finish_model(self, model):
        """After every init (``--weight-init``, DeepNorm's, the placements'): each linear gets its
        gamma and u, v from an SVD of its weight, each stack its power-iteration hook."""
        for linear in reparameterized_linears(model):
            install_sigma_reparam(linear)
        for stack in (model.encoder, model.decoder):
            for module in stack.modules():
                if hasattr(module, "_set_skip_embed_dim_check"):  # fairseq's MultiheadAttention
                    module._set_skip_embed_dim_check()
            stack.register_forward_pre_hook(update_spectral_estimates)
