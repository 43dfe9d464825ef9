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
choose it, one launcher job at a time (test_launchers' ``--jobs 2`` table forks only its test
decodings from the launcher's worker threads; its trainings are real processes).

A launcher itself (the runner in a process of its own: test_trust's ``launcher.py`` running
``run_table``) can be such a fork too: :class:`ForkedLauncher` (``ForkedLauncher(main, stdout=log,
start_new_session=True, env=..., cwd=...)``) calls ``main()`` in a forked child that is a new
process in all the tests look at: its own pid (the one in its runs' locks) and, with
``start_new_session``, its own session (``os.killpg(proc.pid, SIGKILL)`` kills it with its
commands), its standard streams, folder and environment, Python's signal handlers (none of the
test process's stop forwarding), the runner's module state as at its start (no processes of its
own, no stop signal, no run owned, the settings it reads from the environment at import, such as
``$NORMPLUG_HELD_POLL``, read again from its own), its exit status ``main``'s, and its runs'
fairseq commands started as :class:`ForkedCommand` forks of it. A test's fault points
(tests/fault_hooks.py, a ``sitecustomize`` for a real process) are installed in those commands
by ``at_start``. The fault tests of one launcher (an owner SIGKILLed and taken over, a second
launcher started while the first trains, a launcher stopped by SIGTERM, SIGINT or SIGHUP while
its trainer or decoder is held, test_kill_rerun's jobs killed at four points) use it: their
subject is the launcher's logic under kills, signals and concurrency, not the start of a Python.
:func:`run_forked` starts commands side by side as such forks, ``conftest.run_parallel``'s way: the
hydra entry point beside fairseq-train, and the ranks of a data-parallel training (each fork its
own process and gloo rank; ``peers=True`` kills the other rank when one fails).
Real processes stay where the process itself is the subject: the shell scripts (train.sh
stopped by SIGTERM), submitit, ``--jobs 2`` (trainings started from several threads),
preflight's memory, and one test with two real launcher processes on one folder
(test_trust's ``test_two_launchers_started_at_once_train_each_run_once``, whose launchers fork
their fairseq commands with :func:`forked_commands`).
"""
import contextlib
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
from typing import Callable, Dict, List, Optional, Sequence

from conftest import COMMAND_TIMEOUT, FALLBACK_EXPECTED, assert_no_fallback, failure_report, run_parallel
import faster_compose

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


def _command_entry(args):
    """``(cli_main, argv)`` of the command line ``args``: a fairseq console script's
    (:func:`_entry_point`, ``argv`` = ``args``), or for ``python -m MODULE ARG...`` the module's
    ``cli_main()`` (which reads ``sys.argv``, as ``fairseq_normplug.hydra_train``'s) or else its
    ``main(argv)`` called with the arguments (``diagnostics.finetune``'s); ``argv`` = ``[MODULE,
    ARG...]``, as ``sys.argv``."""
    if len(args) >= 3 and args[1] == "-m":
        import importlib

        module = importlib.import_module(args[2])
        if callable(getattr(module, "cli_main", None)):
            return module.cli_main, args[2:]
        if not callable(getattr(module, "main", None)):
            raise ValueError(f"python -m {args[2]}: the module has neither cli_main() nor main(argv) to run in a fork")
        return (lambda: module.main(sys.argv[1:])), args[2:]
    return _entry_point(os.path.basename(args[0])), args


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


class ForkedProcess(subprocess.Popen):
    """``subprocess.Popen`` whose child is a fork of this process that calls ``self._child_main(args)``
    and ends with its exit status (``os._exit``): everything but the start (pipes, ``wait``,
    ``communicate``, signals, ``returncode``) is ``subprocess.Popen``'s. The one step replaced is
    CPython's POSIX ``Popen._execute_child`` (fork and exec): here fork, the child's standard
    streams, its own session with ``start_new_session=True`` (``os.setsid``, as Popen does),
    then :func:`_forked_main` with ``self._child_main``. The base of :class:`ForkedCommand` and
    :class:`ForkedLauncher`."""

    #: the child logs as fairseq's console scripts set it (to stdout, INFO), else as a Python
    #: program that configures no logging
    FAIRSEQ_LOGGING = False
    #: Popen options a subclass's child does not apply
    UNSUPPORTED = ("preexec_fn", "shell", "executable", "pass_fds", "process_group", "user", "group",
                   "extra_groups", "umask")
    #: modules a forked command imports on first use that this process may not have imported yet,
    #: imported here before the fork so that each child inherits them instead of importing them
    #: again: torch._dynamo, which torch.optim imports when fairseq-train builds its optimizer
    #: (about 1 CPU s of each forked training); this process's environment is left as it was
    #: (importing it sets TORCHINDUCTOR_CACHE_DIR, which torch sets again where it needs it)
    IMPORTED_BEFORE_THE_FORK = ("torch._dynamo",)

    def __init__(self, args, **popen_options):
        unsupported = sorted(k for k in self.UNSUPPORTED if popen_options.get(k) not in (None, False, (), -1))
        if unsupported:
            raise ValueError(f"{type(self).__name__} does not take {', '.join(unsupported)}")
        self._new_session = bool(popen_options.get("start_new_session"))
        missing = [module for module in self.IMPORTED_BEFORE_THE_FORK if module not in sys.modules]
        if missing:
            with _environment(None):
                for module in missing:
                    importlib.import_module(module)
        faster_compose.warm()  # the common overrides parsed before the fork, once (tests/faster_compose.py)
        super().__init__(args, **popen_options)

    def _child_main(self, args):
        """The child's work, after :func:`_forked_main` made it a new process; its exit status."""
        raise NotImplementedError

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *_):
        for stream in (sys.stdout, sys.stderr):  # nothing of this process's buffers written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                if self._new_session:
                    os.setsid()
                for fd in (p2cwrite, c2pread, errread):  # the parent's ends
                    if fd != -1:
                        os.close(fd)
                for fd, standard in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, standard)
                code = _forked_main(self._child_main, [str(a) for a in args], cwd, env,
                                    fairseq_logging=self.FAIRSEQ_LOGGING)
            except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
                os.write(2, traceback.format_exc().encode())
            finally:
                os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


class ForkedCommand(ForkedProcess):
    """``subprocess.Popen(command, ...)`` of a fairseq console script (``command[0]``: ``fairseq-train``,
    ``fairseq-generate``, ... bare or as a path) or of ``python -m MODULE ...`` (:func:`_command_entry`: the
    conversion's fine-tune, the plugin's hydra entry point) whose child is a fork of this process running the
    script's ``cli_main`` (see the module docstring) and exits with its exit status."""

    FAIRSEQ_LOGGING = True
    UNSUPPORTED = ForkedProcess.UNSUPPORTED + ("start_new_session",)

    def __init__(self, args, at_start: Optional[Callable[[], None]] = None, **popen_options):
        """``at_start``: called in the child before the command (with its ``sys.argv`` and
        environment), as a ``sitecustomize`` on its PYTHONPATH would run in a new process."""
        # imported here, before the fork
        self._cli_main, self._argv = _command_entry([str(a) for a in args])
        self._at_start = at_start
        super().__init__(args, **popen_options)

    def _child_main(self, args):
        sys.argv = [os.path.basename(self._argv[0]), *self._argv[1:]]
        if self._at_start is not None:
            self._at_start()
        return self._cli_main()


class ForkedLauncher(ForkedProcess):
    """A launcher (the experiment runner in a process of its own: ``launcher.py``'s ``run_table``,
    ``reproduce.main(argv)``) as a forked child of this process: ``ForkedLauncher(main, stdout=log,
    start_new_session=True, env=..., cwd=...)`` calls ``main()`` in the child, whose exit status is
    what it returns (an int; None is 0), its ``SystemExit``'s, 1 for an uncaught exception, or
    SIGINT for a KeyboardInterrupt (a stop signal's LauncherStopped) as Python ends. The child is a
    new process (see :func:`_forked_main`: its pid, signal handlers, environment and working
    folder, the runner's module state and settings) and starts the runner's fairseq commands as
    forks of itself (:func:`forked_commands`, each calling ``at_start`` first, as
    :class:`ForkedCommand` does). ``args`` (``sys.argv``, messages) defaults to ``[main's name]``."""

    def __init__(self, main: Callable[[], Optional[int]], args: Optional[Sequence] = None,
                 at_start: Optional[Callable[[], None]] = None, **popen_options):
        self._main, self._at_start = main, at_start
        super().__init__(list(args) if args else [getattr(main, "__name__", "launcher")], **popen_options)

    def _child_main(self, args):
        sys.argv = list(args)
        with forked_commands(at_start=self._at_start):
            return self._main()


def _forked_main(child_main, args, cwd, env, fairseq_logging=True) -> int:
    """In a forked child: what a new process of ``args`` would be (signal handlers, standard
    streams, working folder, environment, the plugin's module state and the settings it reads from
    the environment at import, fairseq's metrics and TensorBoard writers as at its start; torch on
    one thread; fairseq's logging to stdout with ``fairseq_logging``, as its console scripts set
    it, else Python's default), then ``child_main(args)``; returns its exit status (what it
    returns, an int, None: 0; a KeyboardInterrupt ends it by SIGINT, as Python does)."""
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
    if fairseq_logging:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
        root.handlers = [handler]
        root.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
    else:  # a Python program that configures no logging: warnings and worse to stderr
        root.handlers = []
        root.setLevel(logging.WARNING)
    _start_of_process()
    _plugin_state_of_a_new_process()
    progress_bar._tensorboard_writers.clear()  # this process's, open in it: not the child's to close
    code, interrupted = 0, False
    try:
        result = child_main(args)
        code = result if isinstance(result, int) else 0
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


#: the plugin's settings read from the environment when their module is imported (``NAME =
#: float(os.environ.get(...))``), {module: attributes}: a forked child reads them again from its
#: own environment, as a new process would (test_forked_commands checks that the list is whole)
ENVIRONMENT_SETTINGS = {"fairseq_normplug.experiments.launchers": ("HELD_POLL_S",),
                        "fairseq_normplug.experiments.ownership": ("HEARTBEAT_S", "STALE_AFTER_S"),
                        "fairseq_normplug.experiments.processes": ("STOP_GRACE_S",)}


def _settings_read_again() -> None:
    """:data:`ENVIRONMENT_SETTINGS` set again by each one's own one-line assignment in its
    module's source (``NAME = float(os.environ.get(...))``, so that the defaults are the module's),
    run in the module with today's environment. Lines of text, not ``ast`` objects: CPython 3.11's
    ``ast.parse`` can fail in a child forked deep in a call stack ("AST constructor recursion
    depth mismatch")."""
    import importlib

    for name, attributes in ENVIRONMENT_SETTINGS.items():
        module = importlib.import_module(name)
        with open(module.__file__, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for attribute in attributes:
            assignments = [line for line in lines if line.startswith(f"{attribute} = ")]
            if len(assignments) != 1:
                raise RuntimeError(f"{name} no longer sets {attribute} in one line: update "
                                   "tests/inprocess.py's ENVIRONMENT_SETTINGS")
            exec(assignments[0], vars(module))


def _plugin_state_of_a_new_process() -> None:
    """The experiment runner's process-wide state as a new process has it: no fairseq process of
    its own (``processes._PROCESSES``), no stop signal, real processes for its commands; no run
    owned (``ownership._OWNED``); its locks new (a thread of this process may hold them); its
    settings read from the environment (:func:`_settings_read_again`)."""
    import threading

    from fairseq_normplug import command_start
    from fairseq_normplug.experiments import ownership, processes

    processes._PROCESSES.__init__()  # in place: other modules import it by name
    command_start._COMMAND_STARTER = None
    ownership._OWNED.clear()
    ownership._OWNED_LOCK = threading.Lock()
    _settings_read_again()


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


def forked_commands(at_start: Optional[Callable[[], None]] = None):
    """Context manager: the experiment runner's commands, and the fine-tunes of the norm
    conversion (``diagnostics/convert.py``'s ``finetune``) and the data preparation's fairseq-preprocess
    (``prepare/pipeline.py``'s ``_binarize``), started as :class:`ForkedCommand` (the
    seam, ``fairseq_normplug/command_start.py``'s ``commands_started_by``), each calling ``at_start`` (if
    given) before its command."""
    import functools

    from fairseq_normplug.command_start import commands_started_by

    return commands_started_by(functools.partial(ForkedCommand, at_start=at_start) if at_start else ForkedCommand)


def run_forked(commands: Sequence[Sequence], cwd: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None,
               timeout: float = COMMAND_TIMEOUT, fallback_ok: bool = False, peers: bool = False,
               at_start: Optional[Callable[[], None]] = None) -> List[subprocess.CompletedProcess]:
    """``conftest.run_parallel`` for commands a :class:`ForkedCommand` runs (fairseq's console
    scripts, ``python -m MODULE``): started together as forks of this process, each calling
    ``at_start`` (if given) first, in ``cwd``, with the environment ``conftest.command_env(env)``;
    returns their CompletedProcess objects, in order. All are killed when ``timeout`` seconds
    have passed (an AssertionError with their output); with ``peers`` (the ranks of one
    data-parallel job), the others as soon as one fails."""
    import functools

    return run_parallel(commands, cwd=cwd, timeout=timeout, env=env, fallback_ok=fallback_ok, peers=peers,
                        start=functools.partial(ForkedCommand, at_start=at_start))
