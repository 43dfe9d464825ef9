"""The one place where the plugin starts its commands as processes: the experiment runner's
fairseq-train and fairseq-generate (``experiments/processes.py``), the norm conversion's
fine-tune (``diagnostics/convert.py``), the data preparation's fairseq-preprocess
(``prepare/pipeline.py``), the GPU check's trainings, decoding and benchmarks
(``bench/gpu_check.py``, ``bench/gpu_check_training.py``), the training benchmark's runs
(``bench/bench_train.py``) and the norm benchmark's rounds (``bench/bench_norms.py``). By default
a real process (``subprocess.Popen``); a test whose subject is the logic around a command, not
the process, chooses another starter for a block (``commands_started_by``: ``tests/inprocess.py``'s
``forked_commands`` runs each command in a forked child of the test process). Standard library
only, so that every layer can use it."""
import subprocess
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

#: how :func:`start_command` starts a command: ``starter(command, **popen_options)`` returns a
#: ``subprocess.Popen`` (or an object of its interface whose ``pid`` is a child process of
#: this one); None, the default, is ``subprocess.Popen`` itself: a real process
CommandStarter = Callable[..., subprocess.Popen]
_COMMAND_STARTER: Optional[CommandStarter] = None


@contextmanager
def commands_started_by(starter: CommandStarter) -> Iterator[None]:
    """While the block runs, every command started by :func:`start_command` is started by
    ``starter`` instead of ``subprocess.Popen``; everything else (the run's lock, stop signals,
    logs, exit codes) is unchanged."""
    global _COMMAND_STARTER
    previous, _COMMAND_STARTER = _COMMAND_STARTER, starter
    try:
        yield
    finally:
        _COMMAND_STARTER = previous


def start_command(command: List[str], **popen_options) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen_options)``, or the starter of an enclosing
    :func:`commands_started_by`."""
    starter = _COMMAND_STARTER or subprocess.Popen  # looked up now: tests replace subprocess.Popen
    return starter(command, **popen_options)


def run_command(command: List[str], timeout: Optional[float] = None, **popen_options) -> subprocess.CompletedProcess:
    """What ``subprocess.run(command, timeout=timeout, **popen_options)`` does, the command started
    by :func:`start_command`: waits for it, with its output where it was piped; an interrupted wait
    (Ctrl-C, a stop signal, ``timeout`` seconds passed: ``subprocess.TimeoutExpired``) kills it
    first, so that it does not outlive its caller."""
    process = start_command(command, **popen_options)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
