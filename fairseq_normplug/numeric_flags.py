"""The one check of every numeric flag: its value is a finite number (``nan``, ``inf`` and
``-inf`` are refused) inside the range declared with the flag, refused in one line naming the
flag, the value and the valid range.

A flag declares its range where it is declared, with :func:`number_flag` (public:
``from fairseq_normplug import number_flag``, for a researcher's own norms and placements too)::

    parser.add_argument("--mynorm-p", metavar="P", help="...", **number_flag(above=0))

The value is checked as fairseq-train parses it (and as a hydra ``cfg.model`` is read, through
the same argparse action), and again by :func:`check_number_flags` when the model's flags are
resolved (a checkpoint's or a hand-made Namespace). A plugin flag declared with a plain
``type=float`` gets the finiteness check there too.
"""
import argparse
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple

from fairseq_normplug.errors import NormplugError


@dataclass(frozen=True)
class NumberRange:
    """The valid values of a numeric flag: ``low``/``high`` (None: unbounded), open or closed;
    ``note`` says what the number is (in the refusal); ``words`` are non-numbers the flag
    also takes (``auto``)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""
    words: Tuple[str, ...] = ()

    def contains(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """``> 0``, ``>= 1``, ``in [0, 1]``, ``in (0, 1)`` (empty when unbounded)."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return ""


#: a float flag without a declared range: any finite number
ANY_FINITE = NumberRange()


def number_error(option: str, value, valid: NumberRange) -> Optional[str]:
    """The one-line refusal of ``value`` for the flag ``option``, None when it is valid."""
    if value is None or (isinstance(value, str) and value in valid.words) or valid.contains(value):
        return None
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    what = " ".join(part for part in ("" if finite else "a finite number", valid.describe()) if part)
    note = f" ({valid.note})" if valid.note else ""
    words = f" (or pass {' or '.join(valid.words)})" if valid.words else ""
    return f"{option} must be {what}{note}, got {value}{words}"


def check_number(option: str, value, valid: NumberRange = ANY_FINITE) -> None:
    """Raise the one-line :class:`NormplugError` of :func:`number_error` (a list: each item)."""
    for item in value if isinstance(value, (list, tuple)) else (value,):
        message = number_error(option, item, valid)
        if message:
            raise NormplugError(message)


class CheckedNumber(argparse.Action):
    """Store a numeric flag's value after :func:`check_number` (argparse lets the
    NormplugError through: one line, as the plugin's other refusals)."""

    def __init__(self, option_strings, dest, valid: NumberRange = ANY_FINITE, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.valid = valid

    def __call__(self, parser, namespace, values, option_string=None):
        check_number(option_string or self.option_strings[0], values, self.valid)
        setattr(namespace, self.dest, values)


def number_flag(kind: Callable = float, *, above: Optional[float] = None, at_least: Optional[float] = None,
                below: Optional[float] = None, at_most: Optional[float] = None, note: str = "",
                words: Iterable[str] = ()) -> dict:
    """``add_argument`` keywords (``type`` and ``action``) of a numeric flag whose value must be
    finite and ``> above`` / ``>= at_least`` / ``< below`` / ``<= at_most`` (each optional);
    ``kind`` parses the text (float, int, or a parser that also returns the ``words``)."""
    valid = NumberRange(low=above if above is not None else at_least, high=below if below is not None else at_most,
                        low_open=above is not None, high_open=below is not None, note=note, words=tuple(words))
    return {"type": kind, "action": functools.partial(CheckedNumber, valid=valid)}


def check_number_flags(args, actions: Iterable[argparse.Action]) -> None:
    """Check every value on ``args`` of the flags ``actions`` (a parser's) declares numeric: a
    :func:`number_flag` against its range, a plain ``type=float`` flag for finiteness."""
    for action in actions:
        valid = getattr(action, "valid", ANY_FINITE if action.type is float else None)
        if valid is not None and action.option_strings:
            check_number(action.option_strings[0], getattr(args, action.dest, None), valid)
