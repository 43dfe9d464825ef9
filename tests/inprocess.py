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

Each call starts with fairseq's state as a new process has it (its metrics reset, and the best
dev score and early-stopping counts it keeps on its functions forgotten: ``_start_of_process``), and
what a process's exit would do is done at its end: fairseq's TensorBoard writers (one per log
key, kept in a module-level dict and closed by an ``atexit`` hook) are closed and forgotten, so
that the next command writes its own folder. One command at a time: fairseq's state is global.

Use a real command (``run_cli``, in a test marked ``slow``) when the process is the subject:
signals, exit codes of the shell scripts, set-up, several processes on one folder.

The experiment runner's commands (fairseq-train and fairseq-generate of a table's runs, started
by ``experiments/processes.py``'s ``run_process``) can run the same way in a forked child of the
test process instead: :func:`forked_commands` (``with forked_commands(): run_table(...)``)
starts them as :class:`ForkedCommand`, a ``subprocess.Popen`` whose child calls the console
script's ``cli_main`` instead of executing the program, so that it does not start Python, torch
and fairseq again (3 of the 4-6 CPU seconds of a tiny training). It is a process all the same:
its own pid (recorded in the run's lock, signalled, waited for), its stdin, stdout and stderr
the pipes and files the runner gave it, its environment and working folder, and its exit
status the command's; torch computes on one thread in it (GNU OpenMP cannot start a pool of
several in a fork of a process that used one), as the runner's tests ask of their runs. Tests
whose subject is the runner's logic (what it trains, skips, resumes, records and scores)
choose it, one launcher job at a time; those whose subject is the process (kills, stop
signals, several launchers or jobs at once, preflight's memory) keep real processes.
"""
import contextlib
import io
import logging
import os
import signal
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


#: fairseq's process-wide state kept on its functions (attributes a function sets on itself), which a
#: new process starts without: the best validation score so far, which decides whether
#: checkpoint_best.pt is written (``checkpoint_utils.save_checkpoint.best``), and early stopping's
#: (``fairseq_cli.train.should_stop_early.best`` / ``num_runs``). {(module, function): attributes}
FAIRSEQ_FUNCTION_STATE = {("fairseq.checkpoint_utils", "save_checkpoint"): ("best",),
                          ("fairseq_cli.train", "should_stop_early"): ("best", "num_runs")}


def _start_of_process() -> None:
    """fairseq's state as a new process has it: its metrics' aggregators reset (nothing logged
    by an earlier command leaks in) and :data:`FAIRSEQ_FUNCTION_STATE` forgotten (an earlier
    command's best dev BLEU would stop this one from writing checkpoint_best.pt)."""
    import importlib

    from fairseq.logging import metrics

    metrics.reset()
    for (module, function), attributes in FAIRSEQ_FUNCTION_STATE.items():
        state = vars(getattr(importlib.import_module(module), function))
        for attribute in attributes:
            state.pop(attribute, None)


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
    _start_of_process()
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


class ForkedCommand(subprocess.Popen):
    """``subprocess.Popen(command, ...)`` of a fairseq console script (``command[0]``: ``fairseq-train``,
    ``fairseq-generate``, ... bare or as a path) whose child is a fork of this process running the
    script's ``cli_main`` (see the module docstring): everything but the start (pipes, ``wait``,
    ``communicate``, signals, ``returncode``) is ``subprocess.Popen``'s. The one step replaced is
    CPython's POSIX ``Popen._execute_child`` (fork and exec): here fork, then the entry point and
    ``os._exit`` with its exit status."""

    def __init__(self, args, **popen_options):
        unsupported = sorted(k for k in ("preexec_fn", "shell", "executable", "pass_fds", "start_new_session",
                                         "process_group", "user", "group", "extra_groups", "umask")
                             if popen_options.get(k) not in (None, False, (), -1))
        if unsupported:
            raise ValueError(f"ForkedCommand does not take {', '.join(unsupported)}")
        self._cli_main = _entry_point(os.path.basename(str(args[0])))  # imported here, before the fork
        super().__init__(args, **popen_options)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *_):
        for stream in (sys.stdout, sys.stderr):  # nothing of this process's buffers written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                for fd in (p2cwrite, c2pread, errread):  # the parent's ends
                    if fd != -1:
                        os.close(fd)
                for fd, standard in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, standard)
                code = _forked_main(self._cli_main, [str(a) for a in args], cwd, env)
            except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
                os.write(2, traceback.format_exc().encode())
            finally:
                os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _forked_main(cli_main, args, cwd, env) -> int:
    """In a forked child: what a new process of ``args`` would be (signal handlers, standard
    streams, working folder, environment, fairseq's logging, metrics and TensorBoard writers as
    at its start; torch on one thread), then ``cli_main``; returns its exit status (a
    KeyboardInterrupt ends it by SIGINT, as Python does)."""
    for signum in signal.valid_signals():  # this process's handlers (the launcher's stop forwarding) are not its
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _new_process_warnings()
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                                               write_through=True) for fd in (1, 2))
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
    import torch
    from fairseq.logging import progress_bar

    # one thread, whatever OMP_NUM_THREADS says: GNU OpenMP hangs in a fork of a process that
    # used a pool of several threads (the runner's tests give their runs 1 thread anyway)
    torch.set_num_threads(1)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    root.handlers = [handler]
    root.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
    _start_of_process()
    progress_bar._tensorboard_writers.clear()  # this process's, open in it: not the child's to close
    sys.argv = [os.path.basename(args[0]), *args[1:]]
    code, interrupted = 0, False
    try:
        cli_main()
    except SystemExit as stop:
        code = _exit_status(stop)
    except BaseException:  # noqa: BLE001 - an uncaught exception, reported as Python reports it
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        code = 1
        try:
            sys.excepthook(*sys.exc_info())  # the plugin's hook: one line and status 2 for a NormplugError
        except SystemExit as stop:
            code = _exit_status(stop)
    finally:
        _end_of_process()
        sys.stdout.flush(), sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _new_process_warnings() -> None:
    """Warnings as a new process has them: Python's default filters (not the test's), printed to
    stderr (not recorded by pytest); a fallback of the plugin's fast paths stays an error, as in
    this process (conftest.py), unless it is the expected behaviour here."""
    import warnings

    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    if not FALLBACK_EXPECTED:
        warnings.filterwarnings("error", r"fairseq-normplug. (native CPU norm kernels unavailable|torch\.compile of)",
                                RuntimeWarning)

    def show(message, category, filename, lineno, file=None, line=None):
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def _exit_status(stop: SystemExit) -> int:
    """The exit status of a process ended by ``stop`` (a non-integer code printed, status 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    sys.stderr.write(f"{stop.code}\n")
    return 1


def forked_commands():
    """Context manager: the experiment runner's commands started as :class:`ForkedCommand` (the
    runner's seam, ``experiments/processes.py``'s ``commands_started_by``)."""
    from fairseq_normplug.experiments.processes import commands_started_by

    return commands_started_by(ForkedCommand)
