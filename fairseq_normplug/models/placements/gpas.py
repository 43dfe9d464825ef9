"""GPAS (Chen, Xu, Liu et al. 2025, "GPAS: Accelerating Convergence of LLM Pretraining via
Gradient-Preserving Activation Scaling", arXiv:2506.22049; authors' code dandingsky/GPAS,
``peft_pretraining/modeling_llama.py``): scale an activation down in the forward pass while
its gradient passes unscaled,

    GPAS(x) = x - SiLU(g) * sg(x),      sg: stop-gradient (``detach``),

so GPAS(x) = (1 - SiLU(g)) x in value, dGPAS/dx = I, and g gets the gradient
-SiLU'(g) <grad, x>. One learnable scalar gate g per layer, init 0 (SiLU(0) = 0: the model
starts as the one without GPAS), shared by all the sublayers of that layer (the authors'
``GPASBlock``, one per ``LlamaDecoderLayer``, lines 261-268 and 336-353). Where it sits is the
authors' per placement (``forward``, lines 491-552):

* PreNorm and Sandwich: after every residual addition, x <- GPAS(x + Dropout(F(...)));
* DeepNorm (PostNorm with ``--residual-scale deepnorm``): on the residual before the DeepNorm
  weight, x <- LN(alpha * GPAS(x) + Dropout(F(x))); F reads the unscaled x.

Both act through each layer's ``residual_connection(x, residual)`` hook (fairseq's; the
layers' class gets the :class:`GPASLayer` mixin in ``finish_model``, after ``--residual-scale``
installed its own, so GPAS wraps the DeepNorm/ReZero/LayerScale residual), so the layers keep
their forward (fairseq's own for PreNorm/DeepNorm, the placement's for Sandwich). The
authors' models are decoder-only; here the decoder's cross-attention is one more sublayer of
the layer and shares its gate. The gate is ``layer.gpas.gate`` (0-dim, kept float32 in
fp16/bf16 models; the product is computed in float32). As every learnable scalar it counts as
a gain for ``--norm-weight-decay`` (``models/norm_parameters.py`` rule 3); the authors train
with weight decay 0 (``scripts/run_*.sh``). Their optional gate-gradient clipping
(``--clip_gate_grad``, used at 1B/7B) is not built.
"""
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_normplug.modules.float32_params import Float32Params
from fairseq_normplug.modules.fused import upcast

from fairseq_normplug.models.placements.base import Modifier, register_modifier
from fairseq_normplug.modules.mixins import mix_into

#: the placements GPAS is defined on, as they are spelled on the command line
GPAS_PLACEMENTS = "PreNorm (--prenorm), Sandwich (--norm-placement sandwich) and DeepNorm (--postnorm --residual-scale deepnorm)"


def gpas(x: Tensor, gate: Tensor) -> Tensor:
    """x - SiLU(gate) * sg(x), computed in float32 for fp16/bf16 ``x`` (output in x's dtype)."""
    xf = upcast(x)
    return (xf - F.silu(upcast(gate)) * xf.detach()).to(x.dtype)


class GPASGate(Float32Params):
    """One layer's gate g (``gate``, init 0) and where GPAS acts on its residual connections:
    after the addition (``on_residual`` False: PreNorm, Sandwich) or on the residual input
    before it (True: DeepNorm)."""

    def __init__(self, on_residual: bool):
        super().__init__()
        self.on_residual = on_residual
        self.gate = nn.Parameter(torch.tensor(0.0))

    def forward(self, x: Tensor) -> Tensor:
        return gpas(x, self.gate)

    def connect(self, x: Tensor, residual: Tensor, add: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """The residual connection ``add(x, residual)`` (x: the sublayer output) with GPAS."""
        if self.on_residual:
            return add(x, self(residual))
        return self(add(x, residual))

    def extra_repr(self) -> str:
        return f"gate={float(self.gate):.4g}, " + ("on the residual" if self.on_residual else "after the addition")


class GPASLayer:
    """Mixin put in front of a Transformer layer's class: its residual connections go through
    the layer's ``gpas`` (:meth:`GPASGate.connect`)."""

    def residual_connection(self, x, residual):
        return self.gpas.connect(x, residual, super().residual_connection)


@register_modifier("gpas")
class GPAS(Modifier):
    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--gpas", action="store_true",
            help="GPAS (Chen et al. 2025): x - SiLU(g) * stopgrad(x) with one learned gate g per layer "
                 "(init 0), after every residual addition (PreNorm, Sandwich) or on the residual before "
                 "DeepNorm's alpha; on " + GPAS_PLACEMENTS)

    #: after every residual addition of one raw (PreNorm-like) stream; the other case, DeepNorm,
    #: is a ``pure_postnorm`` placement with ``--residual-scale deepnorm`` (:meth:`check_capabilities`)
    requires = {"normalizes_sublayer_input": True, "residual_stream": "raw", "single_stream": True}

    def __init__(self, args, placement):
        self.deepnorm = getattr(args, "residual_scale", "none") == "deepnorm"
        self.on_residual = placement.pure_postnorm and self.deepnorm
        super().__init__(args, placement)

    def check_capabilities(self, placement):
        if not self.on_residual:
            super().check_capabilities(placement)

    def refusal(self, placement):
        got = placement.describe() + (" without --residual-scale deepnorm" if placement.pure_postnorm else "")
        return f"--gpas is defined on {GPAS_PLACEMENTS} only; got {got}"

    def build_layer(self, layer, index, num_layers):
        layer.gpas = GPASGate(self.on_residual)

    def finish_model(self, model):
        """Route every layer's residual connections through its gate (after ``--residual-scale``
        installed its own, which GPAS then wraps)."""
        for layer in (*model.encoder.layers, *model.decoder.layers):
            mix_into(layer, GPASLayer, "GPAS")

    def logged_modules(self, model):
        """Each layer's gate (``gate:enc0.gpas``; ``in_std``: the std of what it scales)."""
        return {f"{side}{index}.gpas": layer.gpas for side, stack in (("enc", model.encoder), ("dec", model.decoder))
                for index, layer in enumerate(stack.layers)}
