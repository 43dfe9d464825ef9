"""hydra's composition made cheaper in a test process, which composes fairseq's configuration
once for each fairseq command it runs (tests/inprocess.py) or forks: about 100 times in the quick
loop, at about 0.45 CPU s each (``fairseq.dataclass.utils.convert_namespace_to_omegaconf``
composes about 260 overrides, one ``group.key=value`` per field of fairseq's dataclasses). Three
changes of hydra 1.3.2's work, each giving what hydra gives:

- **Override parses remembered.** ``OverridesParser.parse_rule(self, s, rule_name)``
  (``hydra/core/override_parser/overrides_parser.py``; ``parse_overrides`` calls it for each
  override) parses each (string, rule) once with hydra's ANTLR grammar and returns a deep copy
  of that result each time after: the value a new parse gives, shared with no other caller. Most
  of the strings are the same in every command (``common.seed=1``, ``checkpoint.no_save=false``).
  A string that fails to parse is not remembered (its error is raised each time), and a parser
  with a config loader (hydra's sweepers, whose ``glob`` reads config groups) parses as before.
  A forked command's parses die with it, so :func:`warm` parses a tiny training command's
  overrides once in the test process before its first fork (tests/inprocess.py).
- **The ConfigStore shared by repository copies.** Each composition deep-copies its config
  repository (``CachingConfigRepository.__init__``, ``hydra/_internal/config_repository.py``),
  and with it the ``ConfigStore`` that the ``StructuredConfigSource`` refers to: every dataclass
  config fairseq registered, about 0.07 CPU s, though the store hands out deep copies of its
  nodes at each load anyway. ``StructuredConfigSource.__deepcopy__`` copies the source and keeps
  its reference to the live store, as hydra itself does since facebookresearch/hydra#2928 (not
  in the 1.3.2 that fairseq pins).
- **The caller found without ``inspect.stack()``.** ``hydra.initialize`` (fairseq's
  ``convert_namespace_to_omegaconf`` enters one per composition) finds the file and module that
  called it with ``detect_calling_file_or_module_from_stack_frame(stack_depth)``
  (``hydra/_internal/utils.py``), which builds ``inspect.stack()``: a ``FrameInfo`` with source
  lines and a module lookup for every frame of the stack, about 50 under pytest, 0.05 CPU s each
  time, to read one of them. :func:`calling_file_and_module` walks to that one frame
  (``sys._getframe``) and reads the same fields from it.

:func:`install` applies all three to this process and the forks it starts from then on. A real
process (``run_cli``, a test marked slow) composes once: it is not changed, and neither is the
plugin (its users' commands compose once each). tests/test_harness.py checks that hydra still
calls these methods where this module expects, that a remembered parse equals a new one for a
real fairseq command's overrides, that a copied repository loads through the live store, and
that the warm-up covers nearly all of another command's overrides; it fails when hydra changes
them, and that the caller is found as hydra finds it. docs/setup.md (tenth and eleventh rounds)
gives the CPU saved.
"""
import copy
import functools
import importlib
import sys
from typing import Any, Dict, Optional, Tuple

import hydra._internal.utils as hydra_utils
from hydra.core.override_parser.overrides_parser import OverridesParser

#: hydra's own ``parse_rule``, kept to parse what is not remembered yet (and for the tests)
HYDRA_PARSE_RULE = OverridesParser.parse_rule
_PARSED: Dict[Tuple[str, str], Any] = {}
_WARMED = False


@functools.wraps(HYDRA_PARSE_RULE)
def remembered_parse_rule(self: OverridesParser, s: str, rule_name: str) -> Any:
    if self.config_loader is not None:
        return HYDRA_PARSE_RULE(self, s, rule_name)
    key = (s, rule_name)
    if key not in _PARSED:
        _PARSED[key] = HYDRA_PARSE_RULE(self, s, rule_name)
    return copy.deepcopy(_PARSED[key])


def remembered() -> int:
    """How many (string, rule) parses this process holds."""
    return len(_PARSED)


def copy_sharing_the_store(self, memo: dict):
    """A copy of the source whose ``store`` is the live ConfigStore, not a deep copy of it."""
    source = copy.copy(self)
    memo[id(self)] = source
    return source


def structured_source_type() -> type:
    """The class of hydra's structured config sources that its compositions use: the one its
    ``SourcesRegistry`` holds once hydra has scanned its plugins (the scan executes the core
    plugins' modules again, which defines their classes anew)."""
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    Plugins.instance()
    return SourcesRegistry.instance().resolve("structured")


#: hydra's own caller detection (for the tests), and the modules that call it by that name
HYDRA_DETECT_CALLER = hydra_utils.detect_calling_file_or_module_from_stack_frame
CALLERS_OF_DETECT = ("hydra._internal.utils", "hydra.initialize")


def calling_file_and_module(stack_depth: int) -> Tuple[Optional[str], Optional[str]]:
    """What ``detect_calling_file_or_module_from_stack_frame(stack_depth)`` returns (the file of
    the frame ``stack_depth`` levels up, counting this function as 0, and the module of the
    function running there), read from that one frame. A notebook's cell is left to hydra."""
    frame = sys._getframe(stack_depth)
    if hydra_utils.is_notebook() and "_dh" in frame.f_globals:
        return HYDRA_DETECT_CALLER(stack_depth + 1)
    calling_module = None
    try:
        calling_module = hydra_utils._get_module_name_override()
        if calling_module is None:
            calling_module = frame.f_globals[frame.f_code.co_name].__module__
    except KeyError:
        try:
            calling_module = frame.f_locals["self"].__module__
        except KeyError:
            pass
    return frame.f_code.co_filename, calling_module


def warm() -> None:
    """Parse, once in this process, the overrides of a tiny fairseq-train command of the plugin,
    so that a fork of it started afterwards (tests/inprocess.py's forked commands and launchers)
    finds most of its own command's overrides parsed: the defaults of every group but the model's
    are the same strings in every command. About 0.2 CPU s, once."""
    global _WARMED
    if _WARMED:
        return
    _WARMED = True
    from fairseq.dataclass.utils import override_module_args

    from model_helpers import parse_args  # (imports conftest, which imports this module)

    args = parse_args("data-bin", "transformer_normplug_tiny", "--optimizer", "adam", "--lr-scheduler", "inverse_sqrt",
                      "--criterion", "label_smoothed_cross_entropy")
    OverridesParser.create().parse_overrides(override_module_args(args)[0])


def install() -> None:
    """The three changes, in this process and its later forks."""
    OverridesParser.parse_rule = remembered_parse_rule
    structured_source_type().__deepcopy__ = copy_sharing_the_store
    for name in CALLERS_OF_DETECT:
        module = importlib.import_module(name)  # (the attribute hydra.initialize is a class)
        assert module.detect_calling_file_or_module_from_stack_frame in (HYDRA_DETECT_CALLER,
                                                                        calling_file_and_module), name
        module.detect_calling_file_or_module_from_stack_frame = calling_file_and_module
