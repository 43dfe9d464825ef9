"""Reading a fairseq command's flag list, as fairseq's argparse does: the last occurrence of a
flag wins, ``--flag VALUE`` and ``--flag=VALUE`` alike."""
from typing import Dict, Optional, Sequence


def last_flag_value(flags: Sequence[str], flag: str) -> Optional[str]:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``flags`` (fairseq's argparse:
    the last occurrence wins), None if absent."""
    found = None
    for i, item in enumerate(flags):
        if item == flag and i + 1 < len(flags):
            found = flags[i + 1]
        elif item.startswith(flag + "="):
            found = item.split("=", 1)[1]
    return found


def command_flags(command: Sequence[str]) -> Dict[str, str]:
    """{flag: its value(s), joined by spaces ('' for a switch)} of a fairseq-train command after
    the program and its data folder; a flag given twice keeps its last value (argparse's rule)."""
    flags: Dict[str, str] = {}
    flag = None
    for item in command[2:]:
        if item.startswith("--"):
            flag, _, value = item.partition("=")
            flags[flag] = value
        elif flag is not None:
            flags[flag] = f"{flags[flag]} {item}".strip()
    return flags
