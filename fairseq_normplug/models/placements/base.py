"""The extension interface of ``--norm-placement``: a placement is one class, registered by
name with :func:`register_placement`, that owns everything about itself. A modifier (a switch
on top of a placement, such as ``--normformer``) is the same kind of object, registered with
:func:`register_modifier`. Both are stable, public interfaces: a researcher's own module
outside the package uses them exactly as the built-ins do (docs/placements.md).

A :class:`Placement` subclass may define (every member is optional):

* ``add_args(parser)`` (classmethod): its own flags, on the argument group ``parser``; their
  defaults in ``defaults`` ({dest: value}, filled in when a flag is absent, e.g. in an old
  checkpoint's args); a flag in ``defaults`` given while the placement is not chosen is refused;
* ``__init__(self, args)``: read its resolved flags from fairseq's parsed ``args`` and refuse,
  with :meth:`refuse` (one line), every combination its paper does not define;
* ``norm_slots``: the norms it adds to a layer, ``(path, role, short)``: ``path`` relative to
  the layer (dots for submodules: ``self_attn.q_proj.norm``), ``role`` ATTENTION/FFN/FINAL,
  ``short`` the name it logs under (``enc0.<short>``); listed norms get the chosen
  ``--norm-type`` (from the build's norm factory, ``models/norm_factory.py``), norm statistics,
  ``auto`` inits and norm weight decay;
* ``build_layer(layer, index, num_layers)``: change a freshly built fairseq layer (before
  fairseq's ``--checkpoint-activations`` / FSDP wrappers): add its norms with
  :func:`slot_norm` (the slot's final norm, from the norm factory), or :func:`new_norm`;
* ``final_norm``: True gives every stack PreNorm's final norm (``layer_norm``), or
  ``build_stack(stack)`` for anything else once a stack is built;
* ``sublayers(layer, x, sublayers)``: the forward wiring. ``sublayers`` is the list
  ``[(kind, F), ...]`` of the layer's sublayers (kind ``attn``, ``cross`` when the decoder
  layer has cross-attention, ``ffn``); F(h) is fairseq's own sublayer without dropout. It
  returns the layer's output; ``layer.norm(kind)`` is fairseq's norm of that sublayer,
  ``layer.dropout_module`` and ``layer.residual_connection`` fairseq's dropout and residual
  hook. With ``stock_forward = True`` the layers keep fairseq's own forward instead;
* ``finish_model(model)``: a last step once every norm has its type, ``--weight-init`` was
  applied (the authors' own init, hooks on the final norm modules);
* ``keeps_final_norm`` (refuse ``--no-decoder-final-norm``), ``label`` (the results tables'
  label; default the name);
* its capabilities (:data:`CAPABILITIES`: ``normalizes_sublayer_input``,
  ``normalizes_sublayer_output``, ``residual_stream``, ``single_stream``, ``pure_postnorm``):
  what the layer is, in the papers' terms; modifiers, ``--residual-scale`` and the diagnostics
  decide what composes with the placement from these, never from its name.

A :class:`Modifier` has the same members, is switched on by its own flag ``--<name>`` (which
its ``add_args`` adds, ``store_true``; see ``enabled``), and gets the chosen placement in
``__init__(self, args, placement)``; ``sublayer_forward = True`` makes the layers run the
placement's ``sublayers`` (fairseq's forward would skip its modules); ``requires``
({capability: value}) is what its paper needs of the placement: any other placement is
refused in one line naming the missing capability and the placements that have it.
"""
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from torch import Tensor, nn

from fairseq.modules import LayerNorm

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.flag_lists import flag  # noqa: F401 (the placements import it from here)
from fairseq_normplug.modules.norm_registry import ATTENTION, FFN, FINAL

Sublayers = Sequence[Tuple[str, Callable[[Tensor], Tensor]]]
PlacementSlot = Tuple[str, str, str]  # (path relative to the layer, role, short name)
#: the attribute of a layer being built (``LayerPlan.build_layer``, removed before it is wrapped)
#: that holds its norm factory (``models/norm_factory.LayerNorms``), read by :func:`slot_norm`
LAYER_NORM_FACTORY = "normplug_norms"

#: fairseq's own norm of each sublayer, on every layer (PreNorm: before it, PostNorm: after the residual)
SUBLAYER_NORMS = {"attn": "self_attn_layer_norm", "cross": "encoder_attn_layer_norm", "ffn": "final_layer_norm"}
STOCK_LAYER_SLOTS: Tuple[PlacementSlot, ...] = (
    ("self_attn_layer_norm", ATTENTION, "attn"),
    ("encoder_attn_layer_norm", ATTENTION, "cross"),
    ("final_layer_norm", FFN, "ffn"),
)


def slot_norm(layer: nn.Module, path: str, dim: Optional[int] = None) -> nn.Module:
    """The norm of the slot ``path`` (as a design lists it in ``norm_slots``) of ``layer``,
    ``dim`` wide (default the layer's ``embed_dim``), built by the build's norm factory
    (``models/norm_factory.py``) while ``layer`` is built, in ``build_layer``: the chosen
    ``--norm-type`` (or the slot's ``--norm-types-per-layer`` entry), fairseq's LayerNorm where
    the site keeps it. The design puts it at ``path`` itself. Outside a model build (a layer built
    by hand) it is a LayerNorm placeholder, as :func:`new_norm`'s."""
    width = layer.embed_dim if dim is None else dim
    norms = layer.__dict__.get(LAYER_NORM_FACTORY)
    return LayerNorm(width) if norms is None else norms.new(layer, path, width)


def new_norm(dim: int, role: str) -> nn.Module:
    """An extra norm built as fairseq builds its own (a LayerNorm), for a slot listed in the
    design's ``norm_slots``; where the slot's site asks for another norm type it is a placeholder,
    which the norm factory builds into the slot's norm when the layer leaves ``build_layer`` (for
    designs written before :func:`slot_norm`; a placeholder put in place later is refused)."""
    return LayerNorm(dim)


def set_final_norm(stack: nn.Module, norm) -> None:
    """Give ``stack`` PreNorm's final norm ``layer_norm`` (or remove it: ``norm=None``), at the
    place fairseq registers it (right after ``layers``), so parameter names and their order
    are those of a stock PreNorm stack."""
    stack.__dict__.pop("layer_norm", None)  # fairseq's PostNorm stack: a plain None attribute
    modules = [(name, module) for name, module in stack._modules.items() if name != "layer_norm"]
    stack._modules.clear()
    for name, module in modules:
        stack._modules[name] = module
        if name == "layers" and norm is not None:
            stack._modules["layer_norm"] = norm
    if norm is None:
        stack.layer_norm = None


#: what a placement can declare about its layers (class attributes of :class:`Placement`, read
#: by modifiers' ``requires``), with what each means
CAPABILITIES = {
    "normalizes_sublayer_input": "a norm on every sublayer's input, F(LN(x)) (PreNorm's)",
    "normalizes_sublayer_output": "a norm on every sublayer's output before the residual addition, LN(F(.)) "
                                  "(Sandwich's, OLMo 2's)",
    "residual_stream": "what the layers add up: 'raw', the un-normalised sum x + F(.) (PreNorm-like), or "
                       "'normalized', a norm after every residual addition (PostNorm-like); None: neither "
                       "throughout",
    "single_stream": "the layers pass one d-wide residual stream, not several concatenated along the features",
    "pure_postnorm": "x <- LN(x + F(x)) after every residual addition of both stacks, the residual branch "
                     "scalable as DeepNorm and Admin scale it",
    "stock_model": "fairseq's own model, stacks and layers untouched",
}
#: what PreNorm (x <- x + F(LN(x)), one stream) is, in capabilities: what NormFormer, LayerNorm
#: Scaling and the folds of the norms into the linear layers they feed need
PRENORM_LIKE = {"normalizes_sublayer_input": True, "normalizes_sublayer_output": False,
                "residual_stream": "raw", "single_stream": True}


def missing_capability(placement, requires: Mapping[str, object]) -> Optional[str]:
    """The first capability of ``requires`` ({capability: value}) that ``placement`` (a
    :class:`Placement`, class or instance) lacks, or None."""
    unknown = [name for name in requires if name not in CAPABILITIES]
    if unknown:
        raise NormplugError(f"unknown placement capability {unknown[0]!r}; choose from {', '.join(CAPABILITIES)}")
    return next((name for name, value in requires.items() if getattr(placement, name) != value), None)


def placements_with(requires: Mapping[str, object]) -> List[str]:
    """The registered placements (names, in registration order) that declare ``requires``."""
    return [name for name, cls in PLACEMENTS.items() if missing_capability(cls, requires) is None]


def lacks(placement, requires: Mapping[str, object]) -> str:
    """What ``placement`` lacks of ``requires``, for a one-line refusal: the capability, its
    meaning, and the placements that have all of ``requires`` (from the registry)."""
    name = missing_capability(placement, requires)
    wanted = ", ".join(f"{key}={value!r}" for key, value in requires.items())
    return (f"it has {name}={getattr(placement, name)!r}, not {requires[name]!r} ({CAPABILITIES[name]}); "
            f"placements with {wanted}: {', '.join(placements_with(requires)) or 'none'}")


class LayerDesign:
    """What placements and modifiers share (see the module docstring)."""

    name: str = ""  # set by the registering decorator
    #: the label of a results table's row (``experiments/tables.py``); default: ``name``
    label: str = ""
    defaults: Dict[str, object] = {}
    norm_slots: Tuple[PlacementSlot, ...] = ()
    final_norm = False
    #: the fairseq task the design must train under (None: any); ``refuse_other_task`` checks it
    training_task: Optional[str] = None

    @classmethod
    def add_args(cls, parser) -> None:
        """Add the design's own flags to the argument group ``parser``."""

    @staticmethod
    def refuse(message: str) -> None:
        """Refuse a combination: one line, before anything is built."""
        raise NormplugError(message)

    def describe(self) -> str:
        """The flags that chose this design, for messages."""
        return f"--{self.name}"

    def refuse_other_task(self, args, reason: str) -> None:
        """Refuse a ``--task`` other than :attr:`training_task` (``reason``: what that task does)."""
        task = getattr(args, "task", self.training_task)
        if self.training_task and task != self.training_task:
            self.refuse(f"{self.describe()} needs --task {self.training_task} ({reason}), got --task {task}")

    def refuse_xformers(self, args, reason: str) -> None:
        """Refuse fairseq's xFormers attention configs (they bypass fairseq's attention modules)."""
        for name in ("encoder_xformers_att_config", "decoder_xformers_att_config"):
            if getattr(args, name, None):
                self.refuse(f"{flag(name)} cannot be combined with {self.describe()}: {reason}")

    def resolved_fields(self) -> Dict[str, object]:
        """The design's own flags (keys of :attr:`defaults`) whose resolved values (a default
        chosen, a list normalised) ``args`` must record, so that a checkpoint rebuilds the same
        design; models/args_writer.py writes them (a design never writes ``args`` itself)."""
        return {}

    def build_layer(self, layer: nn.Module, index: int, num_layers: int) -> None:
        """Change layer ``index`` (0-based) of a stack of ``num_layers``, freshly built by fairseq."""

    def build_stack(self, stack: nn.Module) -> None:
        """Change a stack (encoder or decoder) once its layers are built."""
        if self.final_norm:
            set_final_norm(stack, new_norm(stack.layers[0].embed_dim, FINAL))

    def finish_model(self, model: nn.Module) -> None:
        """A last step on the built model (norm types installed, ``--weight-init`` applied)."""

    def logged_modules(self, model: nn.Module) -> Dict[str, nn.Module]:
        """Modules besides the norms whose statistics ``--norm-stats-interval`` logs, by short
        name (``enc0.gpas``): their input std, scalar parameters and ``logged_stats()``."""
        return {}


class Placement(LayerDesign):
    """Where the norms of a layer sit and how its residuals add up (``--norm-placement``)."""

    #: the model is fairseq's own, stacks and layers untouched (``post``, ``pre``)
    stock_model = False
    #: the layers keep fairseq's own forward (``post``, ``pre``, ``mix``)
    stock_forward = False
    #: the formula ends each stack with a norm: ``--no-decoder-final-norm`` is refused
    keeps_final_norm = False
    # capabilities (:data:`CAPABILITIES`); the defaults claim nothing a modifier could rely on
    normalizes_sublayer_input = False
    normalizes_sublayer_output = False
    residual_stream: Optional[str] = None
    single_stream = True
    #: every residual addition is followed by a norm, x <- LN(x + F(x)), in both stacks: the
    #: placement DeepNorm and Admin (``--residual-scale``) are defined for
    pure_postnorm = False

    def __init__(self, args):
        if getattr(args, "no_decoder_final_norm", False) and (self.final_norm or self.keeps_final_norm):
            self.refuse(f"--no-decoder-final-norm cannot be combined with {self.describe()}: its "
                        f"formula ends each stack with a final norm")

    def sublayers(self, layer: nn.Module, x: Tensor, sublayers: Sublayers) -> Tensor:
        raise NotImplementedError(f"--norm-placement {self.name} keeps fairseq's own layer forward")

    def describe(self) -> str:
        return f"--norm-placement {self.name}"

    def refuse_residual_scale(self, args, reason: str) -> None:
        """Refuse every ``--residual-scale`` (``reason``: why the placement's residuals take none)."""
        residual = getattr(args, "residual_scale", None) or "none"
        if residual != "none":
            self.refuse(f"--residual-scale {residual} cannot be combined with {self.describe()}: {reason}")

    def refuse_layerdrop(self, args, reason: str = "its two streams run through every layer of the stack") -> None:
        """Refuse LayerDrop for a placement whose streams must run through every layer."""
        for name in ("encoder_layerdrop", "decoder_layerdrop"):
            if getattr(args, name, 0):
                self.refuse(f"{flag(name)} {getattr(args, name)} cannot be combined with {self.describe()}: {reason}")

    def refuse_tfixup(self, args) -> None:
        """Refuse ``--weight-init tfixup`` for a placement without single x + F(x) residuals."""
        if getattr(args, "weight_init", None) == "tfixup":
            self.refuse(f"--weight-init tfixup cannot be combined with {self.describe()}: T-Fixup's "
                        f"scaling is derived for single x + F(x) residuals")


class Modifier(LayerDesign):
    """A switch on top of a placement (its flag is ``--<name>``)."""

    sublayer_forward = False
    #: the placement capabilities the modifier's paper needs ({capability: value}, :data:`CAPABILITIES`)
    requires: Dict[str, object] = {}

    def __init__(self, args, placement: Placement):
        """Read the modifier's flags from ``args``; refuse what ``placement`` does not define
        (here: a placement without the capabilities in :attr:`requires`)."""
        self.check_capabilities(placement)

    def check_capabilities(self, placement: Placement) -> None:
        """Refuse, in one line, a ``placement`` that lacks a capability of :attr:`requires`."""
        if missing_capability(placement, self.requires) is not None:
            self.refuse(f"{self.refusal(placement)}: {lacks(placement, self.requires)}")

    def refusal(self, placement: Placement) -> str:
        """The first part of the refusal of ``placement`` (what is refused, and the paper's reason)."""
        return f"{self.describe()} cannot be combined with {placement.describe()}"

    @classmethod
    def enabled(cls, args) -> bool:
        return bool(getattr(args, cls.name.replace("-", "_"), False))


#: {name: class}, in registration order (the order of ``--norm-placement``'s choices)
PLACEMENTS: Dict[str, Type[Placement]] = {}
MODIFIERS: Dict[str, Type[Modifier]] = {}


def _register(registry: Dict[str, type], base: type, kind: str, name: str):
    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise NormplugError(f"{kind} {name!r}: {cls!r} is not a subclass of "
                                f"fairseq_normplug.models.placements.{base.__name__}")
        if name in registry and registry[name] is not cls:
            raise NormplugError(f"{kind} {name!r} is already registered (by {registry[name].__module__}); "
                                f"choose another name")
        cls.name = name
        cls.label = cls.__dict__.get("label") or name
        registry[name] = cls
        return cls
    return register


def register_placement(name: str):
    """Class decorator: register a :class:`Placement` subclass as ``--norm-placement NAME``."""
    return _register(PLACEMENTS, Placement, "placement", name)


def register_modifier(name: str):
    """Class decorator: register a :class:`Modifier` subclass, switched on by ``--NAME``."""
    return _register(MODIFIERS, Modifier, "modifier", name)


def registered_designs():
    """Every registered placement and modifier class, placements first."""
    return (*PLACEMENTS.values(), *MODIFIERS.values())


def layer_norm_slots() -> Tuple[PlacementSlot, ...]:
    """fairseq's own layer norms, then each registered design's (no short name twice)."""
    slots, seen = [], set()
    for slot in STOCK_LAYER_SLOTS + tuple(s for design in registered_designs() for s in design.norm_slots):
        if slot[2] not in seen:
            seen.add(slot[2])
            slots.append(slot)
    return tuple(slots)
