"""The fairseq command line being parsed: the parser and arguments of the innermost
``fairseq.options.parse_args_and_arch`` call on the stack, which the model's ``add_args`` hook
reads (it is handed only an argument group).

* :func:`parse_in_progress`: its ``parser`` and ``input_args`` (a Python caller's own list, as
  fairseq's tests and notebooks pass it, else ``sys.argv[1:]``), so that ``--normplug-modules``
  is honoured wherever arguments are parsed;
* :func:`one_line_errors`: that parser's errors as one line naming the nearest flags (an
  unrecognized flag) or the nearest choice (an invalid choice), without argparse's usage dump
  (fairseq-train's is ~190 lines). The plugin installs it from the model's ``add_args``
  (fairseq-train) and from the ``translation_normplug`` task's (also fairseq-generate and
  fairseq-interactive, which add no model flags).

Reading the caller's frame relies on the name of one local variable of fairseq's function,
``input_args`` and ``parser``; ``tests/test_doors.py`` fails if fairseq renames them.
"""
import argparse
import difflib
import re
import sys
from typing import List, NamedTuple, Optional

_MARK = "_normplug_one_line"


class ParseInProgress(NamedTuple):
    parser: Optional[argparse.ArgumentParser]
    argv: List[str]


def parse_in_progress() -> ParseInProgress:
    """The parser and arguments of the innermost ``parse_args_and_arch`` call on the stack
    (``(None, sys.argv[1:])`` outside one)."""
    from fairseq import options

    function = options.parse_args_and_arch
    code = getattr(function, "__wrapped__", function).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            input_args = frame.f_locals.get("input_args")
            return ParseInProgress(frame.f_locals.get("parser"), list(sys.argv[1:] if input_args is None else input_args))
        frame = frame.f_back
    return ParseInProgress(None, list(sys.argv[1:]))


def nearest_flags(parser: argparse.ArgumentParser, word: str) -> List[str]:
    """The parser's option strings closest to the unknown ``word`` (``--prenrom`` -> ``--prenorm``)."""
    flag = word.split("=", 1)[0]
    return difflib.get_close_matches(flag, list(parser._option_string_actions), n=3, cutoff=0.75)


#: argparse's message for a value outside ``choices`` (Python 3.8-3.13 quote the choices, 3.12.8+ may not)
_INVALID_CHOICE = re.compile(r"invalid choice: '?(?P<value>.*?)'? \(choose from (?P<choices>.*)\)$")


def nearest_choice(message: str) -> Optional[str]:
    """The valid choice closest to the invalid one in argparse's ``invalid choice`` ``message``
    (``'sandwhich'`` -> ``'sandwich'``), or None."""
    found = _INVALID_CHOICE.search(message)
    if found is None:
        return None
    listed = found.group("choices")
    choices = re.findall(r"'([^']*)'", listed) or [choice.strip() for choice in listed.split(",")]
    near = difflib.get_close_matches(found.group("value"), choices, n=1, cutoff=0.6)
    return near[0] if near else None


def one_line_error(parser: argparse.ArgumentParser, message: str) -> str:
    """``PROG: error: MESSAGE`` with the nearest flags of each unrecognized argument, or the
    nearest valid choice of an invalid one."""
    choice = nearest_choice(message)
    if choice is not None:
        return f"{parser.prog}: error: {message} (did you mean {choice!r}?)"
    prefix = "unrecognized arguments: "
    if message.startswith(prefix):
        hints = []
        for word in message[len(prefix):].split():
            near = nearest_flags(parser, word) if word.startswith("-") else []
            if near:
                hints.append(f"{word}: did you mean {' or '.join(near)}?")
        if hints:
            message += " (" + "; ".join(hints) + ")"
    return f"{parser.prog}: error: {message}"


def one_line_errors(parser: Optional[argparse.ArgumentParser]) -> None:
    """Make ``parser.error`` (argparse: usage, then the message, exit 2) print one line and exit 2."""
    if parser is None or getattr(parser.error, _MARK, False):
        return

    def error(message):
        sys.stderr.write(one_line_error(parser, message) + "\n")
        sys.stderr.flush()
        raise SystemExit(2)

    setattr(error, _MARK, True)
    parser.error = error
