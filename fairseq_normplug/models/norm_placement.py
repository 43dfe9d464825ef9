"""Where the norms of fairseq's Transformer live, and how the plugin swaps them.

fairseq builds its LayerNorms inline (no build hook), so the plugin replaces them on the
built encoder/decoder: per layer fairseq's ``self_attn_layer_norm``, ``encoder_attn_layer_norm``
(decoder) and ``final_layer_norm`` (the FFN block's norm), then the norms every registered
placement and modifier lists in its ``norm_slots`` (``models/placements/``: e.g. Sandwich's
``*_out_layer_norm``, HybridNorm's ``self_attn.q_proj.norm``, NormFormer's ``attn_ln``), and
per stack the final ``layer_norm`` (present only with PreNorm) and ``layernorm_embedding``.
With the layernorm type nothing is replaced, so the model is exactly fairseq's.

**Placeholders.** Every slot is first filled as fairseq fills its own: with the module fairseq's
``LayerNorm()`` builds (:data:`PLACEHOLDER_CLASSES`: torch's ``nn.LayerNorm``, or apex's
``FusedLayerNorm`` on a GPU with apex), by fairseq inline or by a design's ``new_norm``. Where
the slot's site keeps fairseq's layernorm (:func:`keeps_built_norm`) that module *is* the norm;
everywhere else it is a placeholder, which ``install_norms`` replaces. :func:`refuse_placeholders`
checks, after the whole build, that none is left (e.g. a design that fills a slot it lists only
after ``install_norms`` ran).
"""
from typing import Dict, Iterator, List, Sequence, Tuple

from fairseq.modules import layer_norm as fairseq_layer_norm
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_types_per_layer import norm_choice, parse_norm_types_per_layer, site_args
from fairseq_normplug.models.placements import layer_norm_slots
from fairseq_normplug.modules.norm_registry import FFN, FINAL, NormSlot, build_norm

STACK_NORM_SLOTS = (("layer_norm", FINAL, "final"), ("layernorm_embedding", FFN, "embed"))
Slot = Tuple[nn.Module, str, str, str]
#: the classes of the module fairseq's ``LayerNorm()`` builds: what a norm slot holds until
#: ``install_norms`` replaces it (a placeholder, where the site's norm is not fairseq's own; see
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


def install_norms(model, args) -> List[nn.Module]:
    """Replace every norm of ``model`` by one of the registered type ``args.norm_type``
    (``modules/norm_registry.py``; fairseq's own layernorm, built already, is kept), or the
    type (and scale init) ``--norm-types-per-layer`` names for that norm
    (``models/norm_types_per_layer.py``); an entry that selects no norm of the model is refused.
    Returns the norms it built (for :func:`refuse_placeholders`)."""
    entries = parse_norm_types_per_layer(getattr(args, "norm_types_per_layer", None))
    if keeps_built_norm(args, args) and not entries:  # else LayerNorm1p
        return []
    feeding_output = output_norm(model)
    used, built = set(), []
    for owner, attr, role, name in list(norm_slots(model)):
        entry = norm_choice(entries, name)
        used.add(entry)
        site = args if entry is None else site_args(args, entry.norm_type, entry.scale_init)
        if keeps_built_norm(args, site):
            continue  # fairseq's own LayerNorm, as built
        old = getattr(owner, attr)
        dim = old.normalized_shape[-1]
        built.append(build_norm(site, dim, NormSlot(role, old is feeding_output, name)))
        setattr(owner, attr, built[-1])
    unused = [entry.text for entry in entries if entry not in used]
    if unused:
        raise NormplugError(f"--norm-types-per-layer entry {unused[0]!r} selects no norm of this model "
                            f"(its norms: {', '.join(named_norms(model))})")
    return built


def keeps_built_norm(args, site) -> bool:
    """Whether a slot whose site resolves to ``site`` (``args`` itself, or its
    ``--norm-types-per-layer`` entry) keeps the LayerNorm it was built with: fairseq's own
    layernorm, without ``--zero-centered-gamma`` (which asks for LayerNorm1p)."""
    return site.norm_type == "layernorm" and not args.zero_centered_gamma


def refuse_placeholders(model, args, installed: Sequence[nn.Module]) -> None:
    """Refuse, in one line naming its module path, a built ``model`` whose norm slot still holds
    a placeholder: a module of exactly a :data:`PLACEHOLDER_CLASSES` class at a slot whose site
    does not keep fairseq's layernorm (:func:`keeps_built_norm`), and not one of the norms
    ``install_norms`` built (``installed``: a registered norm type may build a plain LayerNorm)."""
    entries = parse_norm_types_per_layer(getattr(args, "norm_types_per_layer", None))
    if keeps_built_norm(args, args) and not entries:
        return  # every slot keeps the LayerNorm it was built with: no placeholder exists
    installed_ids = {id(norm) for norm in installed}
    paths = {id(module): path for path, module in model.named_modules()}
    for owner, attr, _, name in norm_slots(model):
        entry = norm_choice(entries, name)
        site = args if entry is None else site_args(args, entry.norm_type, entry.scale_init)
        norm = getattr(owner, attr)
        if not keeps_built_norm(args, site) and type(norm) in PLACEHOLDER_CLASSES and id(norm) not in installed_ids:
            raise NormplugError(
                f"the built model still holds a placeholder LayerNorm at {paths[id(owner)]}.{attr} ({name}), "
                f"where the norm type {site.norm_type} was asked for: the design that adds this slot must "
                f"fill it (new_norm) before install_norms runs, in build_layer or build_stack")


def named_norms(model) -> Dict[str, nn.Module]:
    """{short name: norm module}, e.g. ``dec2.ffn``, ``enc.final``."""
    return {name: getattr(owner, attr) for owner, attr, _, name in norm_slots(model)}
