"""Where the norms of fairseq's Transformer live, and how the plugin swaps them.

fairseq builds its LayerNorms inline (no build hook), so the plugin replaces them on the
built encoder/decoder: per layer ``self_attn_layer_norm``, ``encoder_attn_layer_norm``
(decoder) and ``final_layer_norm`` (the FFN block's norm), the stacks' final ``layer_norm``
(present only with PreNorm) and, when enabled, ``layernorm_embedding`` and NormFormer's
``attn_ln``/``ffn_layernorm``. With the layernorm type nothing is replaced, so the model
is exactly fairseq's.
"""
from typing import Dict, Iterator, Tuple

from torch import nn

from fairseq_normplug.modules.norm_registry import ATTENTION, FFN, FINAL, NormSpec, build_norm

LAYER_NORM_SLOTS = (
    ("self_attn_layer_norm", ATTENTION, "attn"),
    ("encoder_attn_layer_norm", ATTENTION, "cross"),
    ("attn_ln", ATTENTION, "attn_inner"),
    ("final_layer_norm", FFN, "ffn"),
    ("ffn_layernorm", FFN, "ffn_inner"),
)
STACK_NORM_SLOTS = (("layer_norm", FINAL, "final"), ("layernorm_embedding", FFN, "embed"))


def norm_slots(model) -> Iterator[Tuple[nn.Module, str, str, str]]:
    """Yield (owner module, attribute, role, short name) for every norm of the model."""
    for prefix, stack in (("enc", model.encoder), ("dec", model.decoder)):
        for index, layer in enumerate(stack.layers):
            for attr, role, short in LAYER_NORM_SLOTS:
                if getattr(layer, attr, None) is not None:
                    yield layer, attr, role, f"{prefix}{index}.{short}"
        for attr, role, short in STACK_NORM_SLOTS:
            if getattr(stack, attr, None) is not None:
                yield stack, attr, role, f"{prefix}.{short}"


def output_norm(model) -> nn.Module:
    """The norm whose output feeds the output layer: the decoder's final norm with PreNorm,
    the last layer's FFN norm with PostNorm."""
    decoder = model.decoder
    if getattr(decoder, "layer_norm", None) is not None:
        return decoder.layer_norm
    return decoder.layers[-1].final_layer_norm


def install_norms(model, spec: NormSpec) -> None:
    """Replace every norm of ``model`` by one of type ``spec.norm_type`` (no-op for layernorm)."""
    if spec.norm_type == "layernorm":
        return
    feeding_output = output_norm(model)
    for owner, attr, role, _ in list(norm_slots(model)):
        old = getattr(owner, attr)
        dim = old.normalized_shape[-1]
        setattr(owner, attr, build_norm(spec, dim, role, feeds_output=old is feeding_output))


def named_norms(model) -> Dict[str, nn.Module]:
    """{short name: norm module}, e.g. ``dec2.ffn``, ``enc.final``."""
    return {name: getattr(owner, attr) for owner, attr, _, name in norm_slots(model)}
