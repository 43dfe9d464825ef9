"""BHyT with statistics computed once per block (``--bhyt-block-statistics``; arXiv 2601.09719,
2026; authors' code MLAI-Yonsei/BHyT at e170c9b, ``models/hf_src/llama/modeling_llama.py``, lines
below are of that file): the authors' ``bhyt`` norm type, on top of ``--norm-type bhyt`` (the
per-norm map, ``modules/bhyt.py``). In a PreNorm block x <- x + Attn(BHyT_1(x)), then
x' <- x' + FFN(BHyT_2(x')), only the block input's variance is measured; the second norm's is
predicted from it and from the attention's weights:

    var_x  = mean_i x_i^2                                   (measured, float32; line 258)
    BHyT_1(x)  = w_1 * tanh(lam_1 x / (kappa sqrt(var_x + eps)))
    var_x' ~ var_x + c_attn * lam_1^2 / kappa^2             (baseline prediction, lines 270-279)
    BHyT_2(x') = w_2 * tanh(lam_2 x' / (kappa sqrt(var_x' + eps)))          (lines 284, 209)
    c_attn = ||W_V W_O||_F^2 / (seq_len * d)                (``update_scaler``, lines 623-661)

with W_V, W_O the value and output projections of the block's self-attention (W_V^paper =
``v_proj.weight``^T, W_O^paper = ``o_proj.weight``^T, line 641), d the model width (line 644),
eps 1e-6. lam_1 enters the prediction detached (``self.input_layernorm.lam.detach()``, lines
1024, 1040); var_x keeps its gradient; c_attn is a constant without gradient (``@torch.no_grad``,
line 622). The authors' other prediction methods (``beta``, ``eta``, ``residual_aware``,
``use_gamma_var``, exact early layers, calibration) are off by default and not built.

seq_len: the authors' ``config.seq_len`` is ``model_max_length`` = ``cutoff_len``
(``src/llamafactory/model/loader.py:224``, ``hparams/parser.py:409``), the fixed length their
pretraining packs every sequence into (1024, ``scripts/bhyt/pt_bhyt_sweep.sh:68``); c_attn is
computed once at model construction (``precompute_c_attn``, lines 1296-1326), or at the first
forward with that batch's length when the weights were not materialised yet (lines 991-993).
Here seq_len is a constant per stack: ``--bhyt-seq-len N``, by default the stack's longest
sequence (``--max-source-positions`` / ``--max-target-positions``, fairseq's default 1024, the
role of their cutoff_len). A constant keeps c_attn the same at every decoding step, so
incremental decoding equals the full forward (a c_attn of each call's key length would differ
from step to step). With sentences much shorter than seq_len, c_attn is small and the
prediction stays close to var_x.

When c_attn is recomputed: the authors' ``UpdateScalerCallback`` (``src/llamafactory/train/
callbacks.py:433-493``) recomputes it from the current weights at the end of every
``every_n_steps``-th step, ``max(1, min(1000, max_steps // 50))`` (``max_steps`` 25000 when
unknown, lines 454-460). Here the layer's ``set_num_updates`` (fairseq calls it before every
training step with the number of updates done, and on checkpoint load) recomputes it when that
number is a multiple of ``--bhyt-scaler-interval N`` (default the authors' rule with
``--max-update``); in evaluation it is never recomputed. c_attn is a float32 buffer of the layer
(``bhyt_c_attn``, saved with the checkpoint; the authors' is not persistent and recomputed
after loading), computed at the first forward when no update or checkpoint set it. As fairseq
calls ``set_num_updates`` at the start of the next step, a validation or checkpoint right after a
due update still has the previous c_attn (the authors recompute at the end of the step).

Which norm gets which statistic (the authors' model is decoder-only, two norms per block):

* encoder layer: ``self_attn_layer_norm`` measures var_x, ``final_layer_norm`` (before the FFN)
  predicts from it with the self-attention's c_attn, as the authors' two norms;
* decoder layer: ``self_attn_layer_norm`` measures, ``encoder_attn_layer_norm`` (before the
  cross-attention, right after the self-attention) predicts with the self-attention's c_attn,
  and ``final_layer_norm`` (before the FFN, after the cross-attention) measures its own input,
  the per-norm BHyT. The prediction's term c_attn lam^2 / kappa^2 is the variance an attention
  adds when its values are the BHyT-normalised stream (variance about lam^2 / kappa^2); the
  cross-attention's values are the encoder output, so the formula does not describe it. A
  decoder layer without cross-attention is an encoder layer's case.

The stacks' final norms stay per-norm BHyT (the authors' last norm is ``BHyT_Star``, line
1290). Requires ``--norm-type bhyt`` on every norm (``--norm-types-per-layer`` refused) and a
PreNorm placement; ``--sigma-reparam`` (c_attn reads W_V and W_O, which it reparameterises) and
``--ddp-backend fully_sharded`` (they are sharded between steps) are refused. Other modifiers
that change the attention branch (gated attention, LayerNorm scaling, residual scales) keep the
plain block's prediction.
"""
import torch
from torch import Tensor, nn
from fairseq.models.transformer import DEFAULT_MAX_SOURCE_POSITIONS, DEFAULT_MAX_TARGET_POSITIONS
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from fairseq_normplug.models.placements.base import PRENORM_LIKE, Modifier, register_modifier
from fairseq_normplug.modules.bhyt import BHyT, predicted_variance
from fairseq_normplug.modules.float32_params import HALF_DTYPES
from fairseq_normplug.modules.fused import upcast
from fairseq_normplug.modules.mixins import mix_into
from fairseq_normplug.numeric_flags import number_flag

#: the authors' recompute schedule (callbacks.py:436-460): max_steps // 50, clamped to [1, 1000],
#: max_steps 25000 when unknown
SCALER_TARGET_UPDATES, SCALER_MAX_INTERVAL, SCALER_UNKNOWN_MAX_STEPS = 50, 1000, 25000


def default_scaler_interval(max_update: int) -> int:
    """The authors' ``UpdateScalerCallback`` interval for a run of ``max_update`` updates (0: unknown)."""
    return max(1, min(SCALER_MAX_INTERVAL, (max_update or SCALER_UNKNOWN_MAX_STEPS) // SCALER_TARGET_UPDATES))


@torch.no_grad()
def attention_variance_gain(attention: nn.Module, seq_len: int) -> Tensor:
    """c_attn = ||W_V W_O||_F^2 / (seq_len * d) of a fairseq ``MultiheadAttention`` (float32,
    no gradient): the authors' ``update_scaler`` (lines 623-645) with ``v_proj``/``out_proj``
    as their ``v_proj``/``o_proj`` (the biases are not in their formula: Llama has none)."""
    w_v = attention.v_proj.weight.detach().float()
    w_o = attention.out_proj.weight.detach().float()
    combined = torch.matmul(w_v.T, w_o.T)  # [d, d], line 641
    return torch.linalg.matrix_norm(combined, "fro") ** 2 / float(seq_len * attention.embed_dim)


class BlockStatistic:
    """What the norms of one layer share during its forward: c_attn, the measured variance of
    the block input, and lam (detached) and kappa of the norm that measured it."""

    def __init__(self):
        self.clear()

    def predicted(self) -> Tensor:
        """The statistic of the norm after the self-attention (:func:`predicted_variance`)."""
        if self.measured is None:
            raise RuntimeError("--bhyt-block-statistics: a predicting norm ran before its block's measuring norm")
        return predicted_variance(self.measured, self.c_attn, self.lam, self.kappa)

    def clear(self) -> None:
        self.c_attn = self.measured = self.lam = self.kappa = None


class MeasuringBHyT:
    """Put in front of a block's first BHyT: measures var_x (float32) and records it for the block."""

    def forward(self, x: Tensor) -> Tensor:
        variance = upcast(x).pow(2).mean(dim=-1, keepdim=True)
        block = self.bhyt_block
        block.measured, block.lam, block.kappa = variance, upcast(self.lam).detach(), self.kappa
        return self.from_variance(x, variance)


class PredictingBHyT:
    """Put in front of the BHyT that follows the block's self-attention: its statistic is
    predicted (``predicted_variance``), not measured."""

    def forward(self, x: Tensor) -> Tensor:
        return self.from_variance(x, self.bhyt_block.predicted())


class BHyTBlockLayer:
    """Put in front of a fairseq layer's class: keeps c_attn (``bhyt_c_attn``, float32) up to
    date and gives its norms a fresh :class:`BlockStatistic` for each forward."""

    def forward(self, *args, **kwargs):
        if not self.bhyt_c_attn_ready:
            self.update_bhyt_c_attn()
        block = self.bhyt_block
        block.clear()
        block.c_attn = self.bhyt_c_attn
        try:
            return super().forward(*args, **kwargs)
        finally:
            block.clear()

    def update_bhyt_c_attn(self) -> None:
        self.bhyt_c_attn.copy_(attention_variance_gain(self.self_attn, self.bhyt_seq_len))
        self.bhyt_c_attn_ready = True

    def set_num_updates(self, num_updates: int) -> None:
        """The authors' periodic recompute (module docstring); once per update number."""
        parent = getattr(super(), "set_num_updates", None)
        if parent is not None:
            parent(num_updates)
        if num_updates % self.bhyt_scaler_interval == 0 and num_updates != self.bhyt_c_attn_update:
            self.update_bhyt_c_attn()
            self.bhyt_c_attn_update = num_updates

    def _apply(self, fn, recurse=True):
        """``bhyt_c_attn`` stays float32 in fp16/bf16 models."""
        super()._apply(fn, recurse)
        if self.bhyt_c_attn.dtype in HALF_DTYPES:
            self.bhyt_c_attn = self.bhyt_c_attn.float()
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "bhyt_c_attn" in state_dict:
            self.bhyt_c_attn_ready = bool(self.bhyt_c_attn >= 0)


def install_block_layer(layer: nn.Module, seq_len: int, interval: int) -> None:
    """Give a freshly built layer its c_attn buffer, its schedule and the :class:`BHyTBlockLayer` mixin."""
    layer.register_buffer("bhyt_c_attn", torch.tensor(-1.0))  # < 0: not computed yet
    layer.bhyt_c_attn_ready = False
    layer.bhyt_c_attn_update = None
    layer.bhyt_seq_len, layer.bhyt_scaler_interval = seq_len, interval
    layer.bhyt_block = BlockStatistic()
    mix_into(layer, BHyTBlockLayer, "BHyTBlock")


def block_norms(layer: nn.Module):
    """(measuring, predicting) norm attribute names of a layer; a decoder layer's
    ``final_layer_norm`` after its cross-attention stays the per-norm BHyT (module docstring)."""
    if isinstance(layer, TransformerDecoderLayerBase) and layer.encoder_attn is not None:
        return "self_attn_layer_norm", "encoder_attn_layer_norm"
    return "self_attn_layer_norm", "final_layer_norm"


@register_modifier("bhyt-block-statistics")
class BHyTBlockStatistics(Modifier):
    """BHyT's statistics computed once per block (module docstring)."""

    requires = PRENORM_LIKE
    defaults = {"bhyt_seq_len": None, "bhyt_scaler_interval": None}

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--bhyt-block-statistics", action="store_true",
            help="BHyT's block form (arXiv 2601.09719, the authors' 'bhyt'): the norm after each "
                 "self-attention predicts its input's variance as var_x + c_attn lam^2/kappa^2 from the "
                 "block input's instead of measuring it, c_attn = ||W_V W_O||_F^2/(seq_len d); needs "
                 "--norm-type bhyt and --prenorm (docs/beyond.md)")
        parser.add_argument(
            "--bhyt-seq-len", metavar="N", **number_flag(int, at_least=1),
            help="--bhyt-block-statistics: seq_len of c_attn, a constant (default the stack's "
                 "--max-source-positions / --max-target-positions, the role of the authors' cutoff_len)")
        parser.add_argument(
            "--bhyt-scaler-interval", metavar="N", **number_flag(int, at_least=1),
            help="--bhyt-block-statistics: recompute c_attn every N updates (default the authors': "
                 "--max-update // 50 within [1, 1000], 500 without --max-update)")

    def refusal(self, placement):
        return (f"--bhyt-block-statistics cannot be combined with {placement.describe()}: the authors' "
                f"block statistics are defined for PreNorm blocks")

    def __init__(self, args, placement):
        super().__init__(args, placement)
        if args.norm_type != "bhyt":
            self.refuse(f"--bhyt-block-statistics needs --norm-type bhyt, got --norm-type {args.norm_type}")
        if getattr(args, "norm_types_per_layer", None):
            self.refuse(f"--bhyt-block-statistics cannot be combined with --norm-types-per-layer "
                        f"{args.norm_types_per_layer}: every sublayer norm of a block must be --norm-type bhyt")
        if getattr(args, "sigma_reparam", False):
            self.refuse("--bhyt-block-statistics cannot be combined with --sigma-reparam: c_attn reads "
                        "W_V and W_O, which sigmaReparam replaces by gamma / sigma(W) W")
        if getattr(args, "ddp_backend", None) == "fully_sharded":
            self.refuse("--bhyt-block-statistics cannot be combined with --ddp-backend fully_sharded: c_attn "
                        "reads whole W_V and W_O between steps, which FSDP keeps sharded there")
        given = args.bhyt_seq_len
        self.seq_lens = {
            "encoder": given or getattr(args, "max_source_positions", None) or DEFAULT_MAX_SOURCE_POSITIONS,
            "decoder": given or getattr(args, "max_target_positions", None) or DEFAULT_MAX_TARGET_POSITIONS,
        }
        self.interval = args.bhyt_scaler_interval or default_scaler_interval(getattr(args, "max_update", 0))

    def build_layer(self, layer, index, num_layers):
        stack = "decoder" if isinstance(layer, TransformerDecoderLayerBase) else "encoder"
        install_block_layer(layer, self.seq_lens[stack], self.interval)

    def finish_model(self, model):
        """Mix the measuring / predicting forms into each layer's BHyT norms (their type is installed now)."""
        for stack in (model.encoder, model.decoder):
            for layer in stack.layers:
                measuring, predicting = block_norms(layer)
                for name, mixin in ((measuring, MeasuringBHyT), (predicting, PredictingBHyT)):
                    norm = getattr(layer, name)
                    if not isinstance(norm, BHyT):
                        self.refuse(f"--bhyt-block-statistics needs BHyT norms, got {type(norm).__name__} "
                                    f"at {name}")
                    norm.bhyt_block = layer.bhyt_block
                    mix_into(norm, mixin, "Block")
