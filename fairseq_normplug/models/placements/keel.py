"""Keel (Chen & Wei 2026, "Post-LayerNorm Is Back: Stable, ExpressivE, and Deep",
arXiv:2601.19895, Eq. (8) / (16) and section 3.1; no official code: the paper's equation is the
reference, and x-transformers' ``pre_and_post_norm`` with ``scale_residual_constant = alpha``
computes the same block, docs/beyond.md gives the lines): a PostNorm Transformer whose residual
path becomes a Highway-style scaled connection, with a second norm on the sublayer's input. For
every sublayer F (self-attention, cross-attention, FFN) of layers 1, 2, ... of a stack

    x_{l+1} = LN_1( alpha x_l + Dropout(F(LN_2(x_l))) ),      alpha = L,

L the number of sublayers of the stack, the first layer's included (encoder: 2 per layer;
decoder: 3 per layer with cross-attention), or ``--keel-alpha A``. The first layer (index 0) of
each stack follows section 3.1, "for the very first attention and FFN layers, we remove the final
Post-LN and the scaling factor alpha": each of its sublayers is the PreNorm block

    x_{l+1} = x_l + Dropout(F(LN_2(x_l)))

(``--keel-first-layer pre``, the default); ``--keel-first-layer keel`` makes it the Keel block
like every other layer (x-transformers' ``pre_and_post_norm`` has no first-layer rule). LN_1 is
fairseq's own PostNorm norm of the sublayer (``self_attn_layer_norm``,
``encoder_attn_layer_norm``, ``final_layer_norm``), removed (None) in a PreNorm first layer;
LN_2 is a new norm on the sublayer's input (``keel_attn_input_norm``, ``keel_cross_input_norm``,
``keel_ffn_input_norm``). Each stack ends with LN_1 of its last sublayer, so there is no extra
final norm (as PostNorm; a one-layer stack under ``--keel-first-layer pre`` therefore ends
without a norm). The paper's norms are RMSNorm (``--norm-type rmsnorm``); any
``--norm-type`` fills every norm that exists. Keel needs no special init: fairseq's (or
``--weight-init``) is kept.

The paper's model is decoder-only; here the encoder gets the same blocks, and the decoder's
cross-attention is a sublayer like the others (its query LN_2(x), its keys and values the
encoder output; in the first layer a PreNorm sublayer like its neighbours: our reading).
Everything is position-wise but the attentions, so incremental decoding goes through fairseq's
attention caches unchanged. Refused: any ``--residual-scale`` (alpha is the residual's scale)
and ``--weight-init tfixup`` (derived for single x + F(x) residuals).
"""
from fairseq_normplug.modules.norm_registry import ATTENTION, FFN
from fairseq_normplug.numeric_flags import number_flag

from fairseq_normplug.models.placements.base import SUBLAYER_NORMS, Placement, register_placement, slot_norm

#: LN_2 of each sublayer kind: the norm of the sublayer's input
INPUT_NORMS = {"attn": "keel_attn_input_norm", "cross": "keel_cross_input_norm", "ffn": "keel_ffn_input_norm"}
#: ``--keel-first-layer``: the first layer of a stack as a PreNorm layer (section 3.1), or a Keel layer
FIRST_LAYERS = ("pre", "keel")


@register_placement("keel")
class Keel(Placement):
    defaults = {"keel_alpha": None, "keel_first_layer": None}
    norm_slots = ((INPUT_NORMS["attn"], ATTENTION, "keel_attn_in"),
                  (INPUT_NORMS["cross"], ATTENTION, "keel_cross_in"),
                  (INPUT_NORMS["ffn"], FFN, "keel_ffn_in"))
    normalizes_sublayer_input = True  # LN_2
    residual_stream = "normalized"  # LN_1 after every addition

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--keel-alpha", metavar="A", **number_flag(float, above=0, note="the scale of the residual x_l"),
            help="--norm-placement keel: the residual scale alpha of LN_1(alpha x + F(LN_2(x))) (default: "
                 "L, the number of sublayers of the stack, the paper's)")
        parser.add_argument(
            "--keel-first-layer", choices=FIRST_LAYERS,
            help="--norm-placement keel: the first layer of each stack; pre (default, the paper's section "
                 "3.1): x + F(LN_2(x)), no alpha and no LN_1; keel: LN_1(alpha x + F(LN_2(x))) like the others")

    def __init__(self, args):
        super().__init__(args)
        self.refuse_residual_scale(args, "Keel's alpha is the scale of its residual")
        self.refuse_tfixup(args)
        self.alpha = args.keel_alpha
        self.first_layer = args.keel_first_layer or "pre"
        if self.first_layer not in FIRST_LAYERS:
            self.refuse(f"unknown --keel-first-layer {self.first_layer!r}; choose from {', '.join(FIRST_LAYERS)}")

    def build_layer(self, layer, index, num_layers):
        kinds = ["attn", "cross", "ffn"] if getattr(layer, "encoder_attn", None) is not None else ["attn", "ffn"]
        for kind in kinds:
            setattr(layer, INPUT_NORMS[kind], slot_norm(layer, INPUT_NORMS[kind]))
        layer.keel_alpha = float(self.alpha if self.alpha is not None else num_layers * len(kinds))
        if index == 0 and self.first_layer == "pre":
            layer.keel_alpha = None  # a PreNorm layer: no alpha, and no LN_1
            for kind in kinds:
                setattr(layer, SUBLAYER_NORMS[kind], None)

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            branch = layer.dropout_module(sublayer(getattr(layer, INPUT_NORMS[kind])(x)))
            if layer.keel_alpha is None:
                x = layer.residual_connection(branch, x)
            else:
                x = layer.norm(kind)(layer.keel_alpha * x + branch)
        return x
