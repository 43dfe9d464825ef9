"""fairseq's commands run inside the test process, as fairseq's own tests do (its
``tests/utils.py`` calls ``train.main`` and ``generate.main``): :func:`run_fairseq` takes the
command line a test would start (``fairseq-train DATA --arch ...``) and returns what
``conftest.run_cli`` returns for it, a ``CompletedProcess`` with the exit status, stdout and
stderr, without starting Python, torch and fairseq again.

The call is the console script's own ``cli_main`` with ``sys.argv`` set to the command line,
in ``cwd`` and with ``env`` applied, both restored afterwards. Its output is what the command
would print: fairseq's log records (its format, to stdout, as ``fairseq_cli`` configures
them), ``print`` output, and the plugin's one-line refusals (``fairseq-normplug: error: ...``,
exit status 2) where the installed ``sys.excepthook`` would print them. Any other exception
is exit status 1 with its traceback on stderr, as an uncaught exception ends a process.

Each call starts with fairseq's metrics as a new process has them (``metrics.reset()``), and
what a process's exit would do is done at its end: fairseq's TensorBoard writers (one per log
key, kept in a module-level dict and closed by an ``atexit`` hook) are closed and forgotten, so
that the next command writes its own folder. One command at a time: fairseq's state is global.

Use a real command (``run_cli``, in a test marked ``slow``) when the process is the subject:
signals, exit codes of the shell scripts, set-up, several processes on one folder.
"""
import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback
from typing import Dict, Optional, Sequence

from conftest import FALLBACK_EXPECTED, assert_no_fallback, failure_report

#: fairseq_cli's log record format (fairseq_cli/train.py's ``logging.basicConfig``)
LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def _entry_point(command: str):
    """The ``cli_main`` of a fairseq console script."""
    if command == "fairseq-train":
        from fairseq_cli.train import cli_main
    elif command == "fairseq-generate":
        from fairseq_cli.generate import cli_main
    elif command == "fairseq-interactive":
        from fairseq_cli.interactive import cli_main
    elif command == "fairseq-preprocess":
        from fairseq_cli.preprocess import cli_main
    else:
        raise ValueError(f"no in-process entry point for {command!r}; "
                         "choose from fairseq-train, fairseq-generate, fairseq-interactive, fairseq-preprocess")
    return cli_main


@contextlib.contextmanager
def _environment(env: Optional[Dict[str, Optional[str]]]):
    """``os.environ`` updated by ``env`` (None: unset) for the block, then restored."""
    saved = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _end_of_process() -> None:
    """What fairseq does at a process's exit and a later command must not inherit: its
    TensorBoard writers (``fairseq.logging.progress_bar._tensorboard_writers``, closed by its
    ``atexit`` hook ``_close_writers``) are closed and forgotten."""
    from fairseq.logging import progress_bar

    writers = getattr(progress_bar, "_tensorboard_writers", None)
    if writers is None:
        raise RuntimeError("fairseq.logging.progress_bar no longer has _tensorboard_writers: update tests/inprocess.py")
    progress_bar._close_writers()
    writers.clear()


@contextlib.contextmanager
def _captured_logging(stream):
    """Every log record of the block written to ``stream`` in fairseq's format, at fairseq's
    level (INFO): the root logger's handlers are swapped for the block."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    root.handlers = [handler]
    root.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
    try:
        yield
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)


def run_fairseq(args: Sequence, cwd: Optional[str] = None, check: bool = True,
                env: Optional[Dict[str, Optional[str]]] = None, fallback_ok: bool = False,
                input: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run the fairseq command line ``args`` (``args[0]``: ``fairseq-train``, ``fairseq-generate``,
    ``fairseq-interactive`` or ``fairseq-preprocess``, bare or as a path) in this process; see the
    module docstring. ``check``: a non-zero exit fails the test with the output, as ``run_cli``;
    ``input``: the command's standard input (fairseq-interactive reads its sentences there)."""
    from fairseq_normplug.errors import NormplugError

    args = [str(a) for a in args]
    command = os.path.basename(args[0])
    cli_main = _entry_point(command)
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd, saved_stdin = sys.argv, os.getcwd(), sys.stdin
    code = 0
    from fairseq.logging import metrics

    metrics.reset()  # a new process's aggregators: nothing logged by an earlier command leaks in
    with _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            _captured_logging(out):
        sys.argv = [command, *args[1:]]
        sys.stdin = io.StringIO(input or "")
        try:
            if cwd is not None:
                os.chdir(cwd)
            cli_main()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                err.write(f"{stop.code}\n")
        except NormplugError as error:  # the plugin's excepthook: one line, status 2
            err.write(f"fairseq-normplug: error: {error}\n")
            code = 2
        except Exception:  # an uncaught exception: its traceback, status 1
            err.write(traceback.format_exc())
            code = 1
        finally:
            sys.argv, sys.stdin = saved_argv, saved_stdin
            os.chdir(saved_cwd)
            _end_of_process()
    proc = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(failure_report(proc))
    if not fallback_ok and not FALLBACK_EXPECTED:
        assert_no_fallback(proc.stdout + proc.stderr, command)
    return proc
