"""Where the norms of fairseq's Transformer live: the norm slots, by attribute path and short name.

Per layer fairseq's ``self_attn_layer_norm``, ``encoder_attn_layer_norm`` (decoder) and
``final_layer_norm`` (the FFN block's norm), then the norms every registered placement and
modifier lists in its ``norm_slots`` (``models/placements/``: e.g. Sandwich's
``*_out_layer_norm``, HybridNorm's ``self_attn.q_proj.norm``, NormFormer's ``attn_ln``), and per
stack the final ``layer_norm`` (present only with PreNorm) and ``layernorm_embedding``.
:func:`norm_slots` / :func:`named_norms` list them on a built model (the norm statistics,
``auto`` inits, norm weight decay, the diagnostics read them); :func:`output_norm` is the one
that feeds the output layer.

**Built, not patched.** Each slot gets its module where its layer or stack is built, from the
build's norm factory (``models/norm_factory.py``); with the layernorm type every slot keeps the
LayerNorm fairseq built, so the model is exactly fairseq's. Until the factory fills it, a slot
holds what fairseq's ``LayerNorm()`` builds (:data:`PLACEHOLDER_CLASSES`: torch's
``nn.LayerNorm``, or apex's ``FusedLayerNorm`` on a GPU with apex), put there by fairseq inline
or by a design's ``new_norm``: a placeholder, where the slot's site does not keep fairseq's
layernorm. :func:`refuse_placeholders` checks, after the whole build, that none is left (e.g. a
design that fills a slot it lists only in ``finish_model``, after its layer was built).
"""
from typing import Dict, Iterator, Tuple

from fairseq.modules import layer_norm as fairseq_layer_norm
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements import layer_norm_slots
from fairseq_normplug.modules.norm_registry import FFN, FINAL

STACK_NORM_SLOTS = (("layer_norm", FINAL, "final"), ("layernorm_embedding", FFN, "embed"))
Slot = Tuple[nn.Module, str, str, str]
#: the classes of the module fairseq's ``LayerNorm()`` builds: what a norm slot holds until
#: the norm factory fills it (a placeholder, where the site's norm is not fairseq's own; see
#: the module docstring). Exact classes: a subclass (LayerNorm1p) is a norm the plugin built.
PLACEHOLDER_CLASSES = (nn.LayerNorm,) + ((fairseq_layer_norm.FusedLayerNorm,)
                                         if fairseq_layer_norm.has_fused_layernorm else ())


def layer_norms(layer: nn.Module) -> Iterator[Slot]:
    """Yield (owner module, attribute, role, short name) for every norm of one layer: the
    registry's layer slots (``placements.layer_norm_slots``) that the layer has."""
    for path, role, short in layer_norm_slots():
        *owners, attr = path.split(".")
        owner = layer
        for name in owners:
            owner = getattr(owner, name, None)
        if owner is not None and getattr(owner, attr, None) is not None:
            yield owner, attr, role, short


def norm_slots(model) -> Iterator[Slot]:
    """Yield (owner module, attribute, role, short name) for every norm of the model; short
    names are ``enc0.attn``, ``dec1.cross_out``, ``enc.final``."""
    for prefix, stack in (("enc", model.encoder), ("dec", model.decoder)):
        for index, layer in enumerate(stack.layers):
            for owner, attr, role, short in layer_norms(layer):
                yield owner, attr, role, f"{prefix}{index}.{short}"
        for attr, role, short in STACK_NORM_SLOTS:
            if getattr(stack, attr, None) is not None:
                yield stack, attr, role, f"{prefix}.{short}"


def norm_short_names() -> Tuple[str, ...]:
    """Every short name a norm can log under (after ``encN.``/``decN.``/``enc.``/``dec.``), in
    forward order within a layer as far as the registry knows it; for figures and tables."""
    return tuple(short for _, _, short in layer_norm_slots()) + tuple(short for _, _, short in STACK_NORM_SLOTS)


def output_norm(model) -> nn.Module:
    """The norm whose output feeds the output layer: the decoder's final norm with PreNorm,
    the last layer's FFN norm with PostNorm, or a final norm inside the last layer (a
    placement slot of role FINAL: ResiDual's final norm of the PreNorm stream)."""
    decoder = model.decoder
    inside = [getattr(owner, attr) for owner, attr, role, _ in layer_norms(decoder.layers[-1]) if role == FINAL]
    if inside:
        return inside[-1]
    if getattr(decoder, "layer_norm", None) is not None:
        return decoder.layer_norm
    return decoder.layers[-1].final_layer_norm


def refuse_placeholders(model, norms) -> None:
    """Refuse, in one line naming its module path, a built ``model`` whose norm slot still holds
    a placeholder (``norms``, the build's ``NormFactory``, tells: a module of exactly a
    :data:`PLACEHOLDER_CLASSES` class, at a slot whose site does not keep fairseq's layernorm,
    and not a norm the factory built: a registered norm type may build a plain LayerNorm)."""
    if norms.keeps_every_built_norm:
        return  # every slot keeps the LayerNorm it was built with: no placeholder exists
    paths = {id(module): path for path, module in model.named_modules()}
    for owner, attr, _, name in norm_slots(model):
        if norms.is_placeholder(name, getattr(owner, attr)):
            raise NormplugError(
                f"the built model still holds a placeholder LayerNorm at {paths[id(owner)]}.{attr} ({name}), "
                f"where the norm type {norms.site(name).norm_type} was asked for: the design that adds this "
                f"slot must build it while its layer is built (slot_norm, or new_norm in build_layer), or in "
                f"build_stack for the stack's own norms")


def named_norms(model) -> Dict[str, nn.Module]:
    """{short name: norm module}, e.g. ``dec2.ffn``, ``enc.final``."""
    return {name: getattr(owner, attr) for owner, attr, _, name in norm_slots(model)}
