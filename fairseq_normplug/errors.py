"""One error type for bad user input, reported on the command line as a single line."""
import sys


class NormplugError(ValueError):
    """A bad flag value or combination; the message names the value and the valid choices."""


def install_one_line_errors() -> None:
    """Make an uncaught :class:`NormplugError` print ``fairseq-normplug: error: ...`` and exit
    with status 2 (like argparse) instead of a traceback. Other exceptions are untouched."""
    previous = sys.excepthook
    if getattr(previous, "_normplug", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, NormplugError):
            sys.stderr.write(f"fairseq-normplug: error: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(2)
        previous(exc_type, exc, tb)

    hook._normplug = True
    sys.excepthook = hook
