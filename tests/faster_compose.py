"""hydra's composition made cheaper in a test process, which composes fairseq's configuration
once for each fairseq command it runs (tests/inprocess.py) or forks: about 100 times in the quick
loop, at about 0.45 CPU s each (``fairseq.dataclass.utils.convert_namespace_to_omegaconf``
composes about 260 overrides, one ``group.key=value`` per field of fairseq's dataclasses). Two
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

:func:`install` applies both to this process and the forks it starts from then on. A real
process (``run_cli``, a test marked slow) composes once: it is not changed, and neither is the
plugin (its users' commands compose once each). tests/test_harness.py checks that hydra still
calls these methods where this module expects, that a remembered parse equals a new one for a
real fairseq command's overrides, that a copied repository loads through the live store, and
that the warm-up covers nearly all of another command's overrides; it fails when hydra changes
them. docs/setup.md (tenth round) gives the CPU saved.
"""
import copy
import functools
import os
from typing import Any, Dict, Tuple

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


def warm() -> None:
    """Parse, once in this process, the overrides of a tiny fairseq-train command of the plugin,
    so that a fork of it started afterwards (tests/inprocess.py's forked commands and launchers)
    finds most of its own command's overrides parsed: the defaults of every group but the model's
    are the same strings in every command. About 0.2 CPU s, once."""
    global _WARMED
    if _WARMED:
        return
    _WARMED = True
    from fairseq import options
    from fairseq.dataclass.utils import override_module_args

    from conftest import REPO  # (conftest imports this module)

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "data-bin", "--user-dir", os.path.join(REPO, "fairseq_normplug"), "--arch", "transformer_normplug_tiny", "--optimizer", "adam",
        "--lr-scheduler", "inverse_sqrt", "--criterion", "label_smoothed_cross_entropy", "--cpu"])
    OverridesParser.create().parse_overrides(override_module_args(args)[0])


def install() -> None:
    """Both changes, in this process and its later forks."""
    OverridesParser.parse_rule = remembered_parse_rule
    structured_source_type().__deepcopy__ = copy_sharing_the_store
