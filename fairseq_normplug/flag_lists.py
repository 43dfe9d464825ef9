"""Flag lists of fairseq command lines, read by argparse's rules: a flag is a ``--name`` token,
its values are the tokens up to the next ``--name`` (``--name=VALUE`` gives its first one), the
last occurrence of a flag wins, and text is split into tokens as a shell splits it. Standard
library only, so that every layer (placements, tables, the runner) reads flags alike."""
import shlex
from typing import Dict, List, Optional, Sequence


def flag(dest: str) -> str:
    """The command-line flag of an argparse ``dest``: ``dyt_alpha_init`` -> ``--dyt-alpha-init``."""
    return "--" + dest.replace("_", "-")


def split_flags(text: str) -> List[str]:
    """``text`` split into tokens as a shell splits it (quotes keep ``'(0.9, 0.999)'`` one
    token); raises ValueError for unbalanced quotes."""
    return shlex.split(text)


def parse_flag_list(tokens: Sequence[str]) -> Dict[str, List[str]]:
    """{flag: the values of its last occurrence} of a token list, in first-seen order of the
    flags: ``[]`` for a switch, ``["v"]`` for ``--x v`` or ``--x=v``, several for ``nargs``
    flags. Tokens before the first flag (the program, a data folder) are skipped."""
    flags: Dict[str, List[str]] = {}
    name = None
    for token in tokens:
        if token.startswith("--"):
            name, equals, value = token.partition("=")
            flags[name] = [value] if equals else []
        elif name is not None:
            flags[name].append(token)
    return flags


def last_flag_value(tokens: Sequence[str], name: str) -> Optional[str]:
    """The (first) value of the last occurrence of flag ``name`` in ``tokens``, ``--x v`` and
    ``--x=v`` alike; None when it is absent or a switch."""
    values = parse_flag_list(tokens).get(name)
    return values[0] if values else None


def command_flags(command: Sequence[str]) -> Dict[str, str]:
    """{flag: its values joined by spaces ('' for a switch)} of a fairseq-train command after
    the program and its data folder (:func:`parse_flag_list`)."""
    return {name: " ".join(values).strip() for name, values in parse_flag_list(command[2:]).items()}
