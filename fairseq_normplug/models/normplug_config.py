"""The model's configuration as dataclasses and hydra config nodes, generated from its own
command-line flags (``TransformerNormplugModel.add_args``: fairseq's Transformer flags plus
:func:`~fairseq_normplug.models.normplug_args.add_normplug_args`), so that a flag added there,
or by an extension module imported before this is called, is a config field too.

* :func:`normplug_config_class`: ``TransformerNormplugConfig``, fairseq's ``TransformerConfig``
  plus one declared field per plugin flag. ``build_model`` resolves the flags once and hands
  this one object to every build hook (``build_embedding``, ``build_decoder``, ...), whatever
  the front-end gave (an argparse Namespace from fairseq-train or a checkpoint, a DictConfig
  from fairseq-hydra-train): ``TransformerConfig.from_namespace`` keeps only the fields a
  class declares when it reads a DictConfig.
* :func:`check_hydra_model_config`: a hydra ``cfg.model`` of this model is read exactly like
  the same flags on fairseq-train: an unknown key is refused, and every value goes through
  the flag's own argparse action (its type and choices, the same error message).
* :func:`register_hydra_model_nodes`: ``model=<arch>`` for every preset, as a hydra config group.
"""
import argparse
import dataclasses
import difflib
from typing import Any, Callable, Dict, List, Optional, Tuple

from fairseq.dataclass import FairseqDataclass
from fairseq.models.transformer import TransformerConfig
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.normplug_args import add_normplug_args
from fairseq_normplug.models.placements import registered_designs
from fairseq_normplug.modules.norm_registry import NORM_TYPES

MODEL = "transformer_normplug"


class _RaisingParser(argparse.ArgumentParser):
    """argparse whose errors are :class:`NormplugError` (the message argparse would print)."""

    def error(self, message):
        raise NormplugError(message)


def flag_parser(add_args) -> argparse.ArgumentParser:
    """A parser of the flags ``add_args(parser)`` adds, without defaults (the presets fill
    them, as in fairseq-train's model group), raising :class:`NormplugError`."""
    parser = _RaisingParser(argument_default=argparse.SUPPRESS, allow_abbrev=False, add_help=False)
    add_args(parser)
    return parser


def registered_flag_sources() -> tuple:
    """What the plugin's flags are read from at run time: the registered norm types, placements
    and modifiers (an extension loaded later registers its own, with their flags)."""
    return (*NORM_TYPES.values(), *registered_designs())


#: {add_args: (registered_flag_sources() when built, its flag actions)}
_FLAG_ACTIONS: Dict[Callable, Tuple[tuple, Dict[str, argparse.Action]]] = {}


def flag_actions(add_args) -> Dict[str, argparse.Action]:
    """{dest: argparse action} of the flags ``add_args(parser)`` adds (read-only: built again
    only when the registered norm types or designs change; a model build asks eight times)."""
    sources = registered_flag_sources()
    cached = _FLAG_ACTIONS.get(add_args)
    if cached is None or cached[0] != sources:
        actions = {action.dest: action for action in flag_parser(add_args)._actions}
        cached = _FLAG_ACTIONS[add_args] = (sources, actions)
    return cached[1]


def _field_type(action: argparse.Action):
    if action.nargs == 0:  # store_true / store_false
        return bool
    if action.choices is None and action.type in (int, float, str):
        return Optional[action.type]
    return Any  # choices are checked by the flag's own action (check_hydra_model_config)


def _config_field(action: argparse.Action) -> tuple:
    default = (not action.const) if action.nargs == 0 else None  # a switch not given
    return (action.dest, _field_type(action), dataclasses.field(default=default, metadata={"help": action.help}))


_CONFIG_CLASSES = {}


def normplug_config_class(add_args=add_normplug_args) -> type:
    """``TransformerNormplugConfig``: fairseq's TransformerConfig with one field per flag that
    ``add_args`` adds (default: the plugin's flags as they are now, extensions included;
    cached per set of flags). The plugin's is also this module's ``TransformerNormplugConfig``
    (found by name: a pickled config loads)."""
    global TransformerNormplugConfig
    actions = flag_actions(add_args)
    key = tuple(actions)
    if key not in _CONFIG_CLASSES:
        _CONFIG_CLASSES[key] = dataclasses.make_dataclass(
            "TransformerNormplugConfig", [_config_field(a) for a in actions.values()], bases=(TransformerConfig,),
            namespace={"__doc__": "fairseq's TransformerConfig plus the fields of the plugin's flags "
                                  "(fairseq_normplug.models.normplug_config)",
                       "__module__": __name__})
    if add_args is add_normplug_args:
        TransformerNormplugConfig = _CONFIG_CLASSES[key]
    return _CONFIG_CLASSES[key]


TransformerNormplugConfig = normplug_config_class()


def resolved_config(args):
    """The one config object every build hook reads: ``args`` (Namespace, DictConfig or a
    config object, already resolved by ``resolve_normplug_args``) as a TransformerNormplugConfig."""
    config_class = normplug_config_class()
    if isinstance(args, TransformerConfig) and not isinstance(args, config_class):
        # a stock TransformerConfig: its sub-configs as the mappings from_namespace reads
        args = argparse.Namespace(**{key: dataclasses.asdict(value) if isinstance(value, FairseqDataclass) else value
                                     for key, value in vars(args).items()})
    return config_class.from_namespace(args)


def model_arches() -> List[str]:
    """``--arch`` names of the plugin's model (the presets; extension presets included)."""
    from fairseq.models import ARCH_MODEL_INV_REGISTRY

    return list(ARCH_MODEL_INV_REGISTRY.get(MODEL, ()))


def register_hydra_model_nodes() -> None:
    """Store ``model=<arch>`` in hydra's ConfigStore for every preset: the node holds the name
    only, so the preset fills every size not given, as ``--arch`` does on fairseq-train."""
    store = ConfigStore.instance()
    for arch in model_arches():
        store.store(group="model", name=arch, node={"_name": arch}, provider="fairseq_normplug")


def _argv(actions: Dict[str, argparse.Action], values: Dict[str, Any]) -> List[str]:
    """The fairseq-train flags that give ``values`` ({dest: value}, from a hydra config)."""
    argv = []
    for dest, value in values.items():
        action = actions[dest]
        flag = action.option_strings[0]
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise NormplugError(f"model.{dest} is a switch ({flag}): true or false, got {value!r}")
            if value == bool(action.const):
                argv.append(flag)
        elif value is not None:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return argv


def check_hydra_model_config(cfg) -> None:
    """Read a hydra config's ``cfg.model`` of this model as fairseq-train reads the same flags:
    an unknown key is a :class:`NormplugError` naming the closest fields; each value goes
    through its flag's argparse action (type, choices, the same message) and is written back
    converted (``1e-5`` a float, ``auto`` a string); then the preset and the plugin's checks
    run on the whole config, flattened as fairseq-train's namespace is, before any data is read.
    A config of another model is left alone."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    from fairseq_normplug.models.transformer_normplug import TransformerNormplugModel

    model = cfg.get("model")
    arch = model.get("_name") if OmegaConf.is_config(model) else None
    if arch not in ARCH_MODEL_REGISTRY or not issubclass(ARCH_MODEL_REGISTRY[arch], TransformerNormplugModel):
        return
    parser = flag_parser(ARCH_MODEL_REGISTRY[arch].add_args)
    actions = {action.dest: action for action in parser._actions}
    values = {k: v for k, v in OmegaConf.to_container(model, resolve=True).items() if k != "_name"}
    check_model_setting_names(values, arch, actions)
    parsed = vars(parser.parse_args(_argv(actions, values)))
    for dest in values:
        if dest in parsed:
            model[dest] = parsed[dest]
    ARCH_CONFIG_REGISTRY[arch](_flat_namespace(cfg))  # the preset and every plugin check, on a copy


def check_model_setting_names(values, arch: str, actions: Optional[Dict[str, argparse.Action]] = None) -> None:
    """Refuse, naming the closest settings, a key of a hydra model config ``values`` (a mapping,
    e.g. ``cfg.model``) that is neither a flag of ``--arch arch`` nor a field its preset fills."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    if actions is None:
        actions = flag_actions(ARCH_MODEL_REGISTRY[arch].add_args)
    unknown = [key for key in values if key != "_name" and key not in actions]
    if not unknown:
        return
    preset_fields = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](preset_fields)  # fairseq's own derived fields (decoder_input_dim)
    unknown = [key for key in unknown if key not in vars(preset_fields)]
    if unknown:
        near = difflib.get_close_matches(unknown[0], actions, n=3)
        raise NormplugError(
            f"unknown model setting {unknown[0]!r} for {arch}"
            + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else "")
            + f"; the settings are the flags of fairseq-train --arch {arch} --help, with '_' for '-'")


def _flat_namespace(cfg) -> argparse.Namespace:
    """The hydra config as fairseq-train's flat namespace (registry choices by name, the
    model's keys last): what the preset and the plugin's checks read."""
    flat = {}
    for group, node in OmegaConf.to_container(cfg, resolve=True).items():
        if isinstance(node, dict) and group != "model":
            flat.update({k: v for k, v in node.items() if not isinstance(v, dict)})
            if node.get("_name") is not None:
                flat[group] = node["_name"]
    flat.update({k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "_name"})
    flat["arch"] = cfg.model._name
    return argparse.Namespace(**flat)
