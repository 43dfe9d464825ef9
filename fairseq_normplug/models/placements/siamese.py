"""SiameseNorm (Li et al. 2026, "SiameseNorm: Breaking the Barrier to Reconciling Pre/Post-Norm",
arXiv:2602.08064, ICML 2026; code: Qwen-Applications/SiameseNorm at 70efa00,
``deit-model-siamesenorm.py`` ``Block.forward`` lines 216-226 and ``forward_features`` lines
352-356, the same rule in ``dit-model-siamesenorm.py`` lines 123-133 and 267 and in
``OLMo_model_hybrid_pre.py`` lines 706-790 and 1420-1422). Two streams share every sublayer
F: x, normalised PostNorm-style, and y, PreNorm's raw residual stream, both starting from the
embedding (y_0 = x_0). In layer i (0-based, counted per stack) each sublayer k does

    x' = LN_post_k(x)                         (the PostNorm-like stream, normalised first)
    z  = Dropout(F_k(LN_in_k(x' + LN_pre_k(y))))
    x <- x' + z / c_i,   y <- y + z,          c_i = sqrt(2 (i + 1))

and the stack's output is LN_f(LN_post_f(x) + LN_pre_f(y)). LN_in are fairseq's own
``self_attn_layer_norm`` / ``encoder_attn_layer_norm`` / ``final_layer_norm`` (PreNorm's
place: right before F); LN_post_k / LN_pre_k are the new ``<sublayer>_post_stream_norm`` /
``<sublayer>_pre_stream_norm``; LN_post_f / LN_pre_f the last layer's
``post_stream_final_norm`` / ``pre_stream_final_norm``, and LN_f is the stack's final
``layer_norm`` (PreNorm's), so ``--no-decoder-final-norm`` is refused. No init of the
authors' is specific to SiameseNorm (timm's and OLMo's own inits), so fairseq's is kept.
The authors' models have no cross-attention (ViT, DiT, decoder-only OLMo): the decoder's
cross-attention follows the same rule, with its own three norms (this project's choice).

As in ResiDual (``resi_dual.py``), the two streams travel between layers concatenated along
the feature axis, [x; y] (2d wide; so are ``return_all_hiddens`` states): the first layer
takes the d-wide embedding, the last returns LN_post_f(x) + LN_pre_f(y), d wide. No state
lives outside the tensors, so incremental decoding and activation checkpointing see an
ordinary layer function. Refused: LayerDrop (the streams and c_i run through every layer),
residual scalings (the x stream's 1 / c_i is SiameseNorm's own) and T-Fixup (derived for
single x + F(x) residuals).
"""
import math

import torch

from fairseq_normplug.modules.norm_registry import ATTENTION, FFN

from fairseq_normplug.models.placements.base import SUBLAYER_NORMS, Placement, register_placement, slot_norm

#: the sublayer kinds and the prefix of their stream norms
PREFIXES = {"attn": "self_attn", "cross": "encoder_attn", "ffn": "ffn"}
ROLES = {"attn": ATTENTION, "cross": ATTENTION, "ffn": FFN}
STREAMS = ("post", "pre")
#: the stream norms of the stack's output, in the last layer; role FFN (not FINAL): the stack's
#: ``layer_norm`` is the norm that feeds the output layer (``norm_placement.output_norm``)
FINAL_STREAM_NORMS = tuple((f"{stream}_stream_final_norm", FFN, f"{stream}_final") for stream in STREAMS)


def stream_norm(kind: str, stream: str) -> str:
    """The name of sublayer ``kind``'s norm of the ``post`` or ``pre`` stream."""
    return f"{PREFIXES[kind]}_{stream}_stream_norm"


@register_placement("siamese")
class SiameseNorm(Placement):
    norm_slots = tuple((stream_norm(kind, stream), ROLES[kind], f"{kind}_{stream}")
                       for kind in PREFIXES for stream in STREAMS) + FINAL_STREAM_NORMS
    final_norm = True
    single_stream = False  # its PostNorm and PreNorm streams, concatenated

    def __init__(self, args):
        super().__init__(args)
        self.refuse_residual_scale(args, "its post stream adds each sublayer output scaled by 1/sqrt(2(i+1)), "
                                         "its pre stream unscaled")
        self.refuse_tfixup(args)
        self.refuse_layerdrop(args)

    def build_layer(self, layer, index, num_layers):
        layer.siamese_first, layer.siamese_last = index == 0, index == num_layers - 1
        layer.siamese_c = math.sqrt(2 * (index + 1))  # the post stream's branch divisor c_i
        for kind in PREFIXES:
            if getattr(layer, SUBLAYER_NORMS[kind], None) is not None:  # the sublayer exists
                for stream in STREAMS:
                    setattr(layer, stream_norm(kind, stream), slot_norm(layer, stream_norm(kind, stream)))
        if layer.siamese_last:
            for attr, _, _ in FINAL_STREAM_NORMS:
                setattr(layer, attr, slot_norm(layer, attr))

    def sublayers(self, layer, x, sublayers):
        x, y = (x, x) if layer.siamese_first else x.chunk(2, dim=-1)  # y_0 = x_0
        for kind, sublayer in sublayers:
            x = getattr(layer, stream_norm(kind, "post"))(x)
            h = layer.norm(kind)(x + getattr(layer, stream_norm(kind, "pre"))(y))
            branch = layer.dropout_module(sublayer(h))
            x, y = x + branch / layer.siamese_c, y + branch
        if layer.siamese_last:
            return layer.post_stream_final_norm(x) + layer.pre_stream_final_norm(y)
        return torch.cat([x, y], dim=-1)
