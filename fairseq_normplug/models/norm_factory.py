"""The norm factory: every norm slot gets its module where its layer or stack is built.

:class:`NormFactory` is made once per model build (``TransformerNormplugModel._build_model``) from
the resolved configuration (``models/resolved_config.py``: the norm type and its flags,
``--norm-types-per-layer``, ``--zero-centered-gamma``) and passed down fairseq's build hooks:
``build_encoder`` / ``build_decoder`` -> :class:`~fairseq_normplug.models.placements.layers.PlacedEncoder`
/ ``PlacedDecoder`` -> ``build_encoder_layer`` / ``build_decoder_layer`` ->
:meth:`LayerPlan.build_layer <fairseq_normplug.models.placements.layers.LayerPlan.build_layer>`.
For one slot (its short name ``enc0.attn`` / ``dec.final``, role, width, and whether it feeds the
output layer) it returns the module of the slot's norm type (``build_norm``,
``modules/norm_registry.py``), or None where the slot keeps the LayerNorm fairseq built
(:meth:`NormFactory.keeps_built_norm`: the layernorm type without ``--zero-centered-gamma``).

Where each slot gets its module:

* a slot a design adds (its ``norm_slots``) is built by the design through the factory:
  ``slot_norm(layer, path)`` (``models/placements/base.py``) during its ``build_layer``;
* fairseq builds its own norms inline, with no hook: ``self_attn_layer_norm``,
  ``encoder_attn_layer_norm``, ``final_layer_norm`` of a layer, ``layer_norm`` and
  ``layernorm_embedding`` of a stack. These stock attributes are the only ones the factory
  replaces by attribute (:meth:`LayerNorms.fill`, :meth:`StackNorms.fill_stack`): a layer's
  before ``LayerPlan.build_layer`` wraps it (so it leaves its build hook with its final norms), a
  stack's once its designs' ``build_stack`` ran. Without a layer plan (fairseq's own stacks with
  a non-stock norm type; FixNorm's decoder) the layers are fairseq's, built by fairseq's own
  ``build_*_layer``: their stock attributes are filled as each stack is built (the decoder's in
  its ``build_decoder_layer``, fairseq's legacy stacks right after ``build_encoder`` /
  ``build_decoder`` built them);
* a design written against ``new_norm(dim, role)`` (a LayerNorm placeholder) has each listed slot
  that still holds its placeholder built the same way, when its layer leaves ``build_layer``.

Whether a slot feeds the output layer (ScaleNorm's fixed g, TaperNorm's untapered norm) is decided
as it is built, with :func:`~fairseq_normplug.models.norm_placement.output_norm`'s rule: the last
decoder layer's FINAL-role design slot (ResiDual's); else the decoder's final norm ``layer_norm``,
which the stack has when a design asks for it (``final_norm``) or its last layer is PreNorm
without ``--no-decoder-final-norm``; else the last decoder layer's ``final_layer_norm``.
:meth:`NormFactory.check_built_model` checks the decision against the built model (a design's
``build_stack`` could change it) and refuses an ``--norm-types-per-layer`` entry that selects no
norm of the model; ``norm_placement.refuse_placeholders`` then refuses a slot left with a placeholder.
"""
from typing import Dict, List, Optional, Set, Tuple

from fairseq.modules import LayerNorm
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import (PLACEHOLDER_CLASSES, STACK_NORM_SLOTS, named_norms,
                                                    output_norm)
from fairseq_normplug.models.norm_types_per_layer import norm_choice, parse_norm_types_per_layer, site_args
from fairseq_normplug.models.placements.base import STOCK_LAYER_SLOTS, layer_norm_slots
from fairseq_normplug.modules.norm_registry import FINAL, NormSlot, build_norm


class NormFactory:
    """The norms of one model build (module docstring): ``args`` the build's arguments, ``config``
    their :class:`~fairseq_normplug.models.resolved_config.ResolvedConfig`."""

    def __init__(self, args, config):
        self.args = args
        self.norm_type = config.norm_type
        self.entries = parse_norm_types_per_layer(config.norm_types_per_layer)
        self.zero_centered_gamma = bool(getattr(args, "zero_centered_gamma", False))
        self.built_ids: Set[int] = set()
        #: the slots (short names) built as the one that feeds the output layer (one, in a sound build)
        self.output_norm_names: List[str] = []

    @property
    def keeps_every_built_norm(self) -> bool:
        """fairseq's layernorm everywhere: every slot keeps the LayerNorm it was built with."""
        return self.norm_type == "layernorm" and not self.zero_centered_gamma and not self.entries

    def site(self, name: str):
        """The arguments the norm logged as ``name`` is built from: ``args``, or its
        ``--norm-types-per-layer`` entry's type and scale init."""
        entry = norm_choice(self.entries, name)
        return self.args if entry is None else site_args(self.args, entry.norm_type, entry.scale_init)

    def keeps_built_norm(self, site) -> bool:
        """Whether a slot whose site resolves to ``site`` keeps the LayerNorm it was built with:
        fairseq's own layernorm, without ``--zero-centered-gamma`` (which asks for LayerNorm1p)."""
        return site.norm_type == "layernorm" and not self.zero_centered_gamma

    def norm(self, name: str, role: str, dim: int, feeds_output: bool = False) -> Optional[nn.Module]:
        """The module of slot ``name`` (role, width ``dim``), or None where it keeps fairseq's LayerNorm."""
        if feeds_output and name not in self.output_norm_names:
            self.output_norm_names.append(name)
        site = self.site(name)
        if self.keeps_built_norm(site):
            return None
        module = build_norm(site, dim, NormSlot(role, feeds_output, name))
        self.built_ids.add(id(module))
        return module

    def is_placeholder(self, name: str, module: Optional[nn.Module]) -> bool:
        """Whether ``module``, at slot ``name``, is a placeholder: a LayerNorm as fairseq builds
        it, at a site that does not keep it, and not a norm this factory built."""
        return (module is not None and type(module) in PLACEHOLDER_CLASSES and id(module) not in self.built_ids
                and not self.keeps_built_norm(self.site(name)))

    def fill(self, owner: nn.Module, attr: str, name: str, role: str, feeds_output: bool) -> None:
        """Replace the placeholder at ``owner.attr`` (slot ``name``) by the slot's norm."""
        old = getattr(owner, attr, None)
        if old is not None and feeds_output and name not in self.output_norm_names:
            self.output_norm_names.append(name)
        if self.is_placeholder(name, old):
            setattr(owner, attr, self.norm(name, role, old.normalized_shape[-1], feeds_output))

    def stack(self, cfg, decoder: bool, layer_plan=None) -> "StackNorms":
        """The factory for one stack built from ``cfg`` (its TransformerConfig) with ``layer_plan``."""
        return StackNorms(self, cfg, decoder, layer_plan)

    def fill_fairseq_stack(self, stack: nn.Module, cfg, decoder: bool) -> None:
        """Fill the stock attributes of a stack fairseq built with its own layers (no layer plan)."""
        if self.keeps_every_built_norm:
            return
        norms = self.stack(cfg, decoder)
        for index, layer in enumerate(stack.layers):
            norms.layer(index, len(stack.layers)).fill(layer)
        norms.fill_stack(stack)

    def check_built_model(self, model: nn.Module) -> None:
        """After the build: refuse an ``--norm-types-per-layer`` entry that selects no norm of
        ``model``, and a model whose output layer reads another norm than the one built for it."""
        norms = named_norms(model)
        used = {norm_choice(self.entries, name) for name in norms}
        unused = [entry.text for entry in self.entries if entry not in used]
        if unused:
            raise NormplugError(f"--norm-types-per-layer entry {unused[0]!r} selects no norm of this model "
                                f"(its norms: {', '.join(norms)})")
        if self.keeps_every_built_norm:
            return
        feeding = output_norm(model)
        name = next((name for name, norm in norms.items() if norm is feeding and norm is not None), None)
        decided = [norms.get(built) for built in self.output_norm_names]
        as_built = all(id(norm) not in self.built_ids for norm in (feeding, *decided))  # fairseq's LayerNorms
        if name is not None and self.output_norm_names != [name] and not as_built:
            raise NormplugError(f"the norm feeding the output layer is {name}, but the norms built as that norm "
                                f"are {', '.join(self.output_norm_names) or 'none'}: a design's build_stack changed "
                                f"the decoder's final norm (declare final_norm = True on the design instead)")


class StackNorms:
    """The factory for one stack (encoder or decoder) being built."""

    def __init__(self, factory: NormFactory, cfg, decoder: bool, layer_plan=None):
        self.factory, self.decoder = factory, decoder
        self.prefix = "dec" if decoder else "enc"
        designs = layer_plan.designs if layer_plan is not None else ()
        self.design_slots = tuple(dict.fromkeys(slot for design in designs for slot in design.norm_slots))
        #: the designs' FINAL-role layer slots: the last, in the last decoder layer, feeds the output layer
        self.final_paths = [path for path, role, _ in self.design_slots if role == FINAL]
        self.design_final_norm = any(design.final_norm for design in designs)
        self.no_final_norm = bool(getattr(cfg, "no_decoder_final_norm", False))
        #: {path: (role, short name)} of every layer slot the registry knows (``slot_norm``'s lookup)
        self.slots: Dict[str, Tuple[str, str]] = {path: (role, short) for path, role, short in layer_norm_slots()}

    def layer(self, index: int, num_layers: int) -> "LayerNorms":
        return LayerNorms(self, index, num_layers)

    def ends_with_final_norm(self, last_layer: nn.Module) -> bool:
        """Whether the stack will have PreNorm's final norm ``layer_norm``: a design asks for it,
        or (fairseq's rule, and MixLN's) its last layer is PreNorm and the flags keep it."""
        return self.design_final_norm or (bool(getattr(last_layer, "normalize_before", False))
                                          and not self.no_final_norm)

    def fill_stack(self, stack: nn.Module) -> None:
        """Fill the stack's own norms (fairseq's attributes), once its designs' ``build_stack`` ran."""
        if self.factory.keeps_every_built_norm:
            return
        for attr, role, short in STACK_NORM_SLOTS:
            feeds_output = self.decoder and attr == "layer_norm" and not self.final_paths
            self.factory.fill(stack, attr, f"{self.prefix}.{short}", role, feeds_output)


class LayerNorms:
    """The factory for layer ``index`` of a stack of ``num_layers`` being built."""

    def __init__(self, stack: StackNorms, index: int, num_layers: int):
        self.stack, self.index, self.num_layers = stack, index, num_layers
        self.last_decoder_layer = stack.decoder and index == num_layers - 1

    def name(self, short: str) -> str:
        return f"{self.stack.prefix}{self.index}.{short}"

    def feeds_output(self, layer: nn.Module, path: str) -> bool:
        """Whether the slot at ``path`` of ``layer`` feeds the output layer (module docstring)."""
        if not self.last_decoder_layer:
            return False
        if self.stack.final_paths:
            return path == self.stack.final_paths[-1]
        return path == "final_layer_norm" and not self.stack.ends_with_final_norm(layer)

    def new(self, layer: nn.Module, path: str, dim: int) -> nn.Module:
        """The norm of the design slot at ``path`` (as its design lists it) of ``layer``, ``dim`` wide:
        the slot's norm type, or fairseq's LayerNorm where the site keeps it."""
        slots = self.stack.slots
        if path not in slots:
            raise NormplugError(f"no registered design lists the norm slot {path!r}; list it in the design's "
                                f"norm_slots (known slots: {', '.join(slots)})")
        role, short = slots[path]
        norm = self.stack.factory.norm(self.name(short), role, dim, self.feeds_output(layer, path))
        return LayerNorm(dim) if norm is None else norm

    def fill(self, layer: nn.Module) -> None:
        """Fill fairseq's own norms of ``layer`` and the design slots that still hold a placeholder
        (designs written against ``new_norm(dim, role)``)."""
        if self.stack.factory.keeps_every_built_norm:
            return
        for path, role, short in STOCK_LAYER_SLOTS + self.stack.design_slots:
            *owners, attr = path.split(".")
            owner = layer
            for step in owners:
                owner = getattr(owner, step, None)
            if owner is not None:
                self.stack.factory.fill(owner, attr, self.name(short), role, self.feeds_output(layer, path))
