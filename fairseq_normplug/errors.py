"""One error type for bad user input, reported on the command line as a single line."""
import sys


class NormplugError(ValueError):
    """A bad flag value or combination; the message names the value and the valid choices."""


def exit_with_one_line(error: NormplugError) -> None:
    """Print ``fairseq-normplug: error: ...`` and exit with status 2 (like argparse)."""
    sys.stderr.write(f"fairseq-normplug: error: {error}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def in_hydra_job() -> bool:
    """Whether this code runs inside a hydra job (fairseq-hydra-train), whose error report is a
    stack trace: the plugin's refusals then exit with one line themselves."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def install_one_line_errors() -> None:
    """Make an uncaught :class:`NormplugError` print ``fairseq-normplug: error: ...`` and exit
    with status 2 (like argparse) instead of a traceback. Other exceptions are untouched."""
    previous = sys.excepthook
    if getattr(previous, "_normplug", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, NormplugError):
            exit_with_one_line(exc)
        previous(exc_type, exc, tb)

    hook._normplug = True
    sys.excepthook = hook
