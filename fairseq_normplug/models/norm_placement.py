"""Where the norms of fairseq's Transformer live, and how the plugin swaps them.

fairseq builds its LayerNorms inline (no build hook), so the plugin replaces them on the
built encoder/decoder: per layer ``self_attn_layer_norm``, ``encoder_attn_layer_norm``
(decoder) and ``final_layer_norm`` (the FFN block's norm), the stacks' final ``layer_norm``
(present only with PreNorm) and, when enabled, ``layernorm_embedding`` and NormFormer's
``attn_ln``/``ffn_layernorm``; the norms that ``--norm-placement`` adds (``models/placements/``):
Sandwich's ``*_out_layer_norm`` after each sublayer, ResiDual's ``resi_dual_layer_norm`` (its
stack's extra final norm, on the last layer) and HybridNorm's ``q_proj.norm`` / ``k_proj.norm``
/ ``v_proj.norm`` inside each attention. With the layernorm type nothing is replaced, so the
model is exactly fairseq's.
"""
from typing import Dict, Iterator, Tuple

from torch import nn

from fairseq_normplug.modules.norm_registry import ATTENTION, FFN, FINAL, NormSlot, build_norm

LAYER_NORM_SLOTS = (
    ("self_attn_layer_norm", ATTENTION, "attn"),
    ("encoder_attn_layer_norm", ATTENTION, "cross"),
    ("attn_ln", ATTENTION, "attn_inner"),
    ("final_layer_norm", FFN, "ffn"),
    ("ffn_layernorm", FFN, "ffn_inner"),
    ("self_attn_out_layer_norm", ATTENTION, "attn_out"),  # sandwich
    ("encoder_attn_out_layer_norm", ATTENTION, "cross_out"),  # sandwich
    ("final_out_layer_norm", FFN, "ffn_out"),  # sandwich
    ("resi_dual_layer_norm", FINAL, "resi_final"),  # resi-dual: the stack's extra final norm
)
STACK_NORM_SLOTS = (("layer_norm", FINAL, "final"), ("layernorm_embedding", FFN, "embed"))
#: hybrid's QKV norms: ``<attention>.<projection>.norm``, named e.g. ``enc0.attn_q``, ``dec1.cross_v``
ATTENTION_NORM_SLOTS = (("self_attn", "attn"), ("encoder_attn", "cross"))
PROJECTION_NORM_SLOTS = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"))


def norm_slots(model) -> Iterator[Tuple[nn.Module, str, str, str]]:
    """Yield (owner module, attribute, role, short name) for every norm of the model."""
    for prefix, stack in (("enc", model.encoder), ("dec", model.decoder)):
        for index, layer in enumerate(stack.layers):
            for attr, role, short in LAYER_NORM_SLOTS:
                if getattr(layer, attr, None) is not None:
                    yield layer, attr, role, f"{prefix}{index}.{short}"
            for attn_attr, attn_short in ATTENTION_NORM_SLOTS:
                attn = getattr(layer, attn_attr, None)
                for proj_attr, proj_short in PROJECTION_NORM_SLOTS:
                    proj = getattr(attn, proj_attr, None) if attn is not None else None
                    if getattr(proj, "norm", None) is not None:
                        yield proj, "norm", ATTENTION, f"{prefix}{index}.{attn_short}_{proj_short}"
        for attr, role, short in STACK_NORM_SLOTS:
            if getattr(stack, attr, None) is not None:
                yield stack, attr, role, f"{prefix}.{short}"


def output_norm(model) -> nn.Module:
    """The norm whose output feeds the output layer: the decoder's final norm with PreNorm,
    the last layer's FFN norm with PostNorm (ResiDual: its final norm of the PreNorm stream)."""
    decoder = model.decoder
    if getattr(decoder.layers[-1], "resi_dual_layer_norm", None) is not None:
        return decoder.layers[-1].resi_dual_layer_norm
    if getattr(decoder, "layer_norm", None) is not None:
        return decoder.layer_norm
    return decoder.layers[-1].final_layer_norm


def install_norms(model, args) -> None:
    """Replace every norm of ``model`` by one of the registered type ``args.norm_type``
    (``modules/norm_registry.py``; no-op for fairseq's own layernorm, which is built already)."""
    if args.norm_type == "layernorm" and not args.zero_centered_gamma:  # else LayerNorm1p
        return
    feeding_output = output_norm(model)
    for owner, attr, role, name in list(norm_slots(model)):
        old = getattr(owner, attr)
        dim = old.normalized_shape[-1]
        setattr(owner, attr, build_norm(args, dim, NormSlot(role, old is feeding_output, name)))


def named_norms(model) -> Dict[str, nn.Module]:
    """{short name: norm module}, e.g. ``dec2.ffn``, ``enc.final``."""
    return {name: getattr(owner, attr) for owner, attr, _, name in norm_slots(model)}
