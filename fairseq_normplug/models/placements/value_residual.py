"""Value residual learning, ResFormer (Zhou, Wu, Jiang, Obeid, Lan, "Value Residual Learning",
ACL 2025, arXiv:2410.17897; authors' code Zcchill/Value-Residual-Learning at 95652f6,
``src/modeling/modeling_llama_resformer.py``): the values of every self-attention after the
first are mixed with the first layer's values of the same positions,

    V_1 = h_1 W_v^1,        V'_n = lambda_1 V_1 + lambda_2 V_n   (n = 2..N),   V_n = h_n W_v^n,
    Attn_n = softmax(q_n k_n^T / sqrt(d_h)) V'_n,

h_n the attention input of layer n (after the placement's norm, where it has one), V the output
of the value projection with its bias, before the heads are split. The authors' ResFormer fixes
lambda_1 = lambda_2 = 0.5 (``modeling_llama_resformer.py:377-381``: ``value_states =
self.v_proj(hidden_states)``; layer 0 appends it to ``formal_layer_values``, every other layer
computes ``value_states = 0.5*formal_layer_values[0] + 0.5*value_states``; the same at
lines 481-485 for flash attention); ``--value-residual-lambdas L1 L2`` sets other constants.
The list is made afresh by every forward of the model (line 876) and the mix comes before
the key/value cache update (line 403), so a cache holds mixed values.

Here, per stack (each its own first layer): encoder self-attention (V_1 of encoder layer 0)
and decoder self-attention (V_1 of decoder layer 0). Decoder cross-attention is left as it is:
its values are projections of the same encoder output in every layer, so lambda_1 E W_v^1 +
lambda_2 E W_v^n = E (lambda_1 W_v^1 + lambda_2 W_v^n) would only tie the layers' weights (a
reparametrisation, not a residual of token-level information), and the paper (decoder-only
models) defines none.

How: a forward hook on each self-attention's ``v_proj`` records V_1 (layer 0) or returns the
mix (layers 2..N), so fairseq's attention (and its ``prev_value`` cache) sees mixed values,
exactly as the authors' cache does. V_1 travels from layer to layer appended to the layer
output along the feature axis ([x; V_1], d more channels; ``return_all_hiddens`` states of
inner layers are that wide too), so no state lives outside the tensors: activation
checkpointing recomputes a layer from its own inputs and V_1 receives every layer's gradient.
Incremental decoding: each step, layer 0 computes V_1 of the new positions only, every later
layer mixes its new positions' values with it before fairseq appends them to its cached
(already mixed) values; nothing else needs caching, and reordering the beams reorders only
fairseq's own caches. Every call takes fairseq's own attention path
(``_set_skip_embed_dim_check``: the fast path ``F.multi_head_attention_forward`` reads
``v_proj``'s weight itself).

Composes with every placement (their own streams stay in front of V_1), norm type and modifier
(with HybridNorm the values are its normalised ones; with nGPT its bias-free projections).
Refused, one line: ``--encoder-layerdrop`` / ``--decoder-layerdrop`` (a skipped layer would
drop V_1 or its mix), ``--cross-self-attention`` (the decoder's self-attention values then
include the encoder positions) and fairseq's xFormers attention configs. Not built: the
learnable-lambda variants and SVFormer (V'_n = V_1).
"""
import torch
from torch import Tensor, nn

from fairseq_normplug.models.placements.base import Modifier, register_modifier
from fairseq_normplug.numeric_flags import number_flag
from fairseq_normplug.modules.mixins import mix_into

#: the authors' lambda_1, lambda_2 (modeling_llama_resformer.py:381)
DEFAULT_LAMBDAS = (0.5, 0.5)


def value_residual(first_values: Tensor, values: Tensor, lambdas) -> Tensor:
    """The ResFormer mix V'_n = lambda_1 V_1 + lambda_2 V_n."""
    return lambdas[0] * first_values + lambdas[1] * values


def mix_values(v_proj: nn.Module, inputs, values: Tensor):
    """Forward hook of a self-attention's ``v_proj``: layer 0 records its values (V_1) for the
    layers above, every other layer returns them mixed with the V_1 its layer was given."""
    if v_proj.value_residual_first_layer:
        v_proj.recorded_values = values
        return None
    if v_proj.first_values is None:
        raise RuntimeError("value residual: v_proj called outside its layer's forward")
    return value_residual(v_proj.first_values, values, v_proj.value_residual_lambdas)


class ValueResidualLayerMixin:
    """Put in front of a fairseq layer's class: the layer takes [x; V_1] (all layers but the
    first), hands V_1 to its self-attention's ``v_proj`` and returns [x'; V_1] (all but the last)."""

    def forward(self, x, *args, **kwargs):
        v_proj = self.self_attn.v_proj
        width = self.self_attn.embed_dim
        first = None
        if not v_proj.value_residual_first_layer:
            x, first = x[..., :-width], x[..., -width:]
        v_proj.first_values = first
        try:
            out = super().forward(x, *args, **kwargs)
            if v_proj.value_residual_first_layer:
                first = v_proj.recorded_values
                if first is None:
                    raise RuntimeError("value residual: the first layer's self-attention was not called")
        finally:
            v_proj.first_values = v_proj.recorded_values = None
        if self.value_residual_last_layer:
            return out
        if isinstance(out, tuple):
            return (torch.cat([out[0], first.to(out[0].dtype)], dim=-1), *out[1:])
        return torch.cat([out, first.to(out.dtype)], dim=-1)


def install_value_residual(layer: nn.Module, index: int, num_layers: int, lambdas) -> None:
    """Make layer ``index`` of a stack of ``num_layers`` take part in the value residual."""
    attention = layer.self_attn
    v_proj = attention.v_proj
    v_proj.value_residual_first_layer = index == 0
    v_proj.value_residual_lambdas = tuple(lambdas)
    v_proj.first_values = v_proj.recorded_values = None
    v_proj.register_forward_hook(mix_values)
    attention._set_skip_embed_dim_check()
    layer.value_residual_last_layer = index == num_layers - 1
    mix_into(layer, ValueResidualLayerMixin, "ValueResidual")


@register_modifier("value-residual")
class ValueResidual(Modifier):
    """ResFormer's value residual on the encoder's and the decoder's self-attention (module docstring)."""

    defaults = {"value_residual_lambdas": None}

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--value-residual", action="store_true",
            help="value residual learning (ResFormer, Zhou et al. 2024): every self-attention's values "
                 "after the first layer's are lambda1 V_1 + lambda2 V_n, V_1 the first layer's values "
                 "(encoder and decoder, each its own); cross-attention unchanged; every placement and norm type")
        parser.add_argument(
            "--value-residual-lambdas", nargs=2, metavar=("L1", "L2"),
            **number_flag(float, note="lambda_1 and lambda_2 of V'_n = lambda_1 V_1 + lambda_2 V_n"),
            help=f"--value-residual: lambda_1 (first layer's values) and lambda_2 (the layer's own) "
                 f"(default {DEFAULT_LAMBDAS[0]} {DEFAULT_LAMBDAS[1]}, the authors')")

    def __init__(self, args, placement):
        super().__init__(args, placement)
        given = args.value_residual_lambdas
        self.lambdas = tuple(float(v) for v in given) if given is not None else DEFAULT_LAMBDAS
        for name in ("encoder_layerdrop", "decoder_layerdrop"):
            if getattr(args, name, 0):
                self.refuse(f"--{name.replace('_', '-')} {getattr(args, name)} cannot be combined with "
                            f"--value-residual: a skipped layer would drop the first layer's values or their mix")
        if getattr(args, "cross_self_attention", False):
            self.refuse("--cross-self-attention cannot be combined with --value-residual: the decoder's "
                        "self-attention values would include the encoder positions, which ResFormer does not define")
        self.refuse_xformers(args, "the value mix needs fairseq's own attention path")

    def resolved_fields(self):
        return {"value_residual_lambdas": list(self.lambdas)}

    def build_layer(self, layer, index, num_layers):
        install_value_residual(layer, index, num_layers, self.lambdas)
