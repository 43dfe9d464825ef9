"""Loading a researcher's own norm types and placements from outside the package
(docs/extending.md). An extension is a Python module that calls
``fairseq_normplug.register_norm`` / ``register_placement`` when it is imported; it is named by

* ``--normplug-modules PATH[,PATH...]`` on any fairseq command line (a ``.py`` file, a package
  folder or an importable module name); the plugin reads it from the command line when fairseq
  imports it (``--user-dir``), that is before fairseq parses the model's arguments, so the
  extension's ``--norm-type`` / ``--norm-placement`` choices and flags exist in ``fairseq-train``;
  under ``fairseq-hydra-train`` the override ``model.normplug_modules=PATH`` does the same;
* the environment variable ``NORMPLUG_MODULES`` (same syntax), for any command;
* the entry-point group ``fairseq_normplug.extensions`` of an installed package
  (``[project.entry-points."fairseq_normplug.extensions"] my_norms = "my_pkg.norms"``);
* a checkpoint: the model records the extension modules its norm type and placement come from
  (``normplug_modules`` in its saved arguments, as absolute paths or module names), and
  building it again (fairseq-generate, -interactive, -validate, the hub) loads them first. A
  missing one is a one-line error naming it and how to point to its new place.
"""
import importlib
import importlib.util
import logging
import os
import sys
from importlib import metadata
from typing import Dict, Iterable, List, Optional, Sequence, Union

from fairseq_normplug.errors import NormplugError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fairseq_normplug.extensions"
ENVIRONMENT_VARIABLE = "NORMPLUG_MODULES"
FLAG = "--normplug-modules"
HYDRA_KEY = "normplug_modules="

#: {module name: where it came from (absolute path, or the module name itself)} of every loaded extension
LOADED: Dict[str, str] = {}


def split_items(spec: Union[None, str, Sequence[str]]) -> List[str]:
    """``"a.py,b"`` or ``["a.py", "b"]`` -> ``["a.py", "b"]`` (empty items dropped)."""
    if not spec:
        return []
    items = spec.split(",") if isinstance(spec, str) else [part for item in spec for part in str(item).split(",")]
    return [item.strip() for item in items if item.strip()]


def _module_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-3] if base.endswith(".py") else base


def _import_path(path: str, name: str):
    """Import the ``.py`` file or package folder ``path`` as module ``name``."""
    if os.path.isdir(path):
        init = os.path.join(path, "__init__.py")
        if not os.path.isfile(init):
            raise NormplugError(f"{FLAG} {path}: a folder must be a Python package (it has no __init__.py)")
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_extension(item: str) -> str:
    """Import one extension (a ``.py`` file, a package folder or a module name) once; return the
    module name it is known by."""
    is_path = item.endswith(".py") or os.sep in item or os.path.exists(item)
    name = _module_name(item) if is_path else item
    if name in LOADED:
        return name
    if is_path and not os.path.exists(item):
        if name in sys.modules:  # the same module already imported from elsewhere (a moved file)
            LOADED[name] = os.path.abspath(item)
            return name
        raise NormplugError(
            f"{FLAG}: the extension module {item} does not exist; a checkpoint that needs it "
            f"decodes with its new place given as --model-overrides \"{{'normplug_modules': 'PATH'}}\" "
            f"(fairseq-generate/-interactive/-validate), normplug_modules='PATH' (from_pretrained) "
            f"or {ENVIRONMENT_VARIABLE}=PATH")
    try:
        if is_path:
            _import_path(os.path.abspath(item), name)
        else:
            importlib.import_module(name)
    except NormplugError:
        raise
    except ModuleNotFoundError as error:
        if not is_path and error.name == name.split(".")[0]:
            raise NormplugError(f"{FLAG} {item}: no such file, folder or importable module") from None
        raise NormplugError(f"{FLAG} {item}: importing it failed: {error}") from error
    except Exception as error:
        raise NormplugError(f"{FLAG} {item}: importing it failed: {type(error).__name__}: {error}") from error
    LOADED[name] = os.path.abspath(item) if is_path else name
    logger.info("fairseq-normplug: loaded extension %s (%s)", name, LOADED[name])
    return name


def load_extensions(spec: Union[None, str, Sequence[str]]) -> List[str]:
    """Load every extension named in ``spec`` (``--normplug-modules`` syntax); their module names."""
    return [load_extension(item) for item in split_items(spec)]


def command_line_items(argv: Sequence[str]) -> List[str]:
    """The ``--normplug-modules`` values (and hydra's ``[+]model.normplug_modules=``) in ``argv``."""
    items: List[str] = []
    for index, word in enumerate(argv):
        if word == FLAG and index + 1 < len(argv):
            items.append(argv[index + 1])
        elif word.startswith(FLAG + "="):
            items.append(word[len(FLAG) + 1:])
        elif word.lstrip("+").startswith("model." + HYDRA_KEY):
            items.append(word.split("=", 1)[1])
    return items


def load_entry_point_extensions() -> List[str]:
    """Import every module of the ``fairseq_normplug.extensions`` entry-point group; a broken
    one is reported in one warning line and skipped (the plugin stays usable)."""
    names = []
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as error:  # an installed package must not break every fairseq command
            logger.warning("fairseq-normplug: extension entry point %s = %s failed to load: %s: %s",
                           entry.name, entry.value, type(error).__name__, error)
            continue
        module = entry.value.split(":")[0]
        LOADED.setdefault(module, module)
        names.append(module)
    return names


def load_startup_extensions(argv: Optional[Sequence[str]] = None) -> List[str]:
    """At plugin import: entry points, ``NORMPLUG_MODULES`` and the command line's ``--normplug-modules``."""
    argv = sys.argv[1:] if argv is None else argv
    names = load_entry_point_extensions()
    names += load_extensions(os.environ.get(ENVIRONMENT_VARIABLE))
    for item in command_line_items(argv):
        names += load_extensions(item)
    return names


def load_command_line_extensions(argv: Sequence[str]) -> List[str]:
    """Load the ``--normplug-modules`` of ``argv``, the arguments fairseq is parsing now
    (:func:`~fairseq_normplug.fairseq_parsing.parse_in_progress`), before the model adds its
    ``--norm-type`` choices and flags."""
    return [name for item in command_line_items(argv) for name in load_extensions(item)]


def needed_sources(module_names: Iterable[str]) -> List[str]:
    """Where the extensions that define ``module_names`` came from (to record in a checkpoint):
    the loaded extension whose name is the module or a package above it; built-ins give nothing."""
    sources = []
    for module in module_names:
        if module == "fairseq_normplug" or module.startswith("fairseq_normplug."):
            continue
        owner = next((name for name in LOADED if module == name or module.startswith(name + ".")), None)
        source = LOADED[owner] if owner is not None else module
        if source not in sources:
            sources.append(source)
    return sources
