"""The fairseq processes of a launcher's runs (fairseq-train, fairseq-generate): each one
recorded in its run's lock while it runs (experiments/ownership.py), the launcher's stop signals
forwarded to them, and each one ended and waited for before its launcher stops."""
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional

from fairseq_normplug.command_start import start_command
from fairseq_normplug.experiments import ownership

if TYPE_CHECKING:
    from fairseq_normplug.experiments.runs import Run


#: the signals a launcher forwards to its runs' processes before it stops (:func:`stop_signals_forwarded`)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: seconds a stopped run's process has to end after the forwarded signal, before SIGKILL
STOP_GRACE_S = float(os.environ.get("NORMPLUG_STOP_GRACE", "30"))


class LauncherStopped(KeyboardInterrupt):
    """The launcher got a stop signal (:data:`STOP_SIGNALS`): its runs' processes were ended;
    a KeyboardInterrupt, so that callers that stop on Ctrl-C stop on it too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


class _Processes:
    """The fairseq processes this launcher runs now, and the stop signal it got, if any."""

    def __init__(self):
        self.lock = threading.RLock()  # re-entered by the signal handler when it interrupts the main thread in it
        self.running: Dict[int, subprocess.Popen] = {}
        self.stop_signal: Optional[int] = None
        self.starting = False  # the main thread is between Popen and registering the process

    def forward(self, signum: int) -> None:
        with self.lock:
            processes = list(self.running.values())
        for proc in processes:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass


_PROCESSES = _Processes()


def stop_requested() -> Optional[int]:
    """The stop signal this launcher got, None if none."""
    return _PROCESSES.stop_signal


def _on_stop_signal(signum: int, _frame) -> None:
    first = _PROCESSES.stop_signal is None
    if first:
        _PROCESSES.stop_signal = signum
    _PROCESSES.forward(signum)
    if first and not _PROCESSES.starting:  # while a process starts, run_process raises once it is registered
        raise LauncherStopped(signum)


@contextmanager
def stop_signals_forwarded() -> Iterator[None]:
    """While the block runs (in the main thread), :data:`STOP_SIGNALS` are forwarded to the
    runs' fairseq processes and raise :class:`LauncherStopped` (once; a second signal is only
    forwarded, so that the stop's clean-up is not cut short). Elsewhere: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _on_stop_signal) for signum in STOP_SIGNALS}
    _PROCESSES.stop_signal = None
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _PROCESSES.stop_signal = None  # every process of the block has ended: the next block starts afresh


def end_process(proc: subprocess.Popen, signum: int = signal.SIGTERM, grace_s: Optional[float] = None) -> None:
    """End ``proc`` (a stopped or failed run's fairseq process): ``signum`` unless it was
    forwarded already, reading what it still writes, SIGKILL after ``grace_s`` seconds (None:
    :data:`STOP_GRACE_S`, as it is when called)."""
    if grace_s is None:
        grace_s = STOP_GRACE_S
    if proc.poll() is None and _PROCESSES.stop_signal is None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    try:
        proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    except (OSError, ValueError):  # its pipes were closed by the interrupted reader
        proc.wait()


@contextmanager
def run_process(run: "Run", role: str, command: List[str], **popen_options) -> Iterator[subprocess.Popen]:
    """``command`` started by :func:`start_command` (``subprocess.Popen(command, **popen_options)``)
    as ``run``'s ``role`` (``trainer``, ``decoder``): recorded in the run's lock while it runs;
    when the block ends by an exception (a stop signal included) it is ended and waited for
    (:func:`end_process`) before the exception goes on; a block that ends normally must have waited for it. A launcher stopped
    meanwhile raises :class:`LauncherStopped` (a worker thread's run ends here)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _PROCESSES.starting = True
    try:
        proc = start_command(command, **popen_options)
        with _PROCESSES.lock:
            _PROCESSES.running[id(proc)] = proc
    finally:
        if main:
            _PROCESSES.starting = False
    try:
        try:
            ownership.record_process(run.run_dir, role, proc.pid)
            if _PROCESSES.stop_signal is not None:  # the signal came while it started
                _PROCESSES.forward(_PROCESSES.stop_signal)
                raise LauncherStopped(_PROCESSES.stop_signal)
            yield proc
        except BaseException:
            end_process(proc)
            raise
        finally:
            with _PROCESSES.lock:
                _PROCESSES.running.pop(id(proc), None)
        if _PROCESSES.stop_signal is not None:  # ended by the forwarded signal: not a result
            raise LauncherStopped(_PROCESSES.stop_signal)
    finally:
        ownership.record_process(run.run_dir, role, None)
