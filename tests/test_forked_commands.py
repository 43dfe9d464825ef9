"""The runner's one seam for starting commands (fairseq_normplug/command_start.py's start_command) and
tests/inprocess.py's ForkedCommand, which the runner tests choose with forked_commands(): a child
process forked from the test process, with the pipes, folder, environment, threads, logging,
signal handling and exit status of a new process. The console script's entry is replaced here
by a stand-in that reports what it sees (fairseq itself runs this way in test_experiments).
ForkedLauncher, the same fork for a launcher (the runner in a process of its own): its pid,
session, environment, folder, the runner's state and settings, exit status and stop signals."""
import logging
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import inprocess
from inprocess import ForkedCommand, ForkedLauncher, forked_commands
from fairseq_normplug import command_start
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import launchers, ownership, processes


def stand_in():
    """A console script's ``cli_main`` that prints what its process sees, then does what
    ``$FORKED_THEN`` says: end, ``exit 3``, ``normplug`` (a NormplugError), ``crash``, ``compute``
    (an OpenMP-parallel sum), ``sleep``."""
    print(sys.argv, os.getcwd(), os.environ.get("FORKED_SEEN"), torch.get_num_threads(), sys.stdin.read())
    logging.getLogger("fairseq_cli.train").info("a log record")
    print("to stderr", file=sys.stderr)
    then = os.environ.get("FORKED_THEN", "end")
    if then == "exit 3":
        sys.exit(3)
    if then == "normplug":
        raise NormplugError("bad --norm-type x; choose from layernorm, rmsnorm")
    if then == "crash":
        raise RuntimeError("boom")
    if then == "compute":  # on OpenMP's threads
        print("sum", torch.ones(4_000_000).exp().sum().item() > 0, torch.get_num_threads())
    if then == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
    if then == "best":  # fairseq's best dev score so far, kept on save_checkpoint
        from fairseq import checkpoint_utils

        print("best", getattr(checkpoint_utils.save_checkpoint, "best", None))


@pytest.fixture
def entry_replaced(monkeypatch):
    monkeypatch.setattr(inprocess, "_entry_point", lambda command: stand_in)


def forked(then="end", **options):
    return ForkedCommand(["/some/bin/fairseq-train", "data-bin", "--arch", "x"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "FORKED_THEN": then}, **options)


def test_the_runner_starts_real_processes_unless_a_test_chooses_forked_ones():
    real = command_start.start_command([sys.executable, "-c", "print(1)"], stdout=subprocess.PIPE, text=True)
    assert type(real) is subprocess.Popen and real.communicate()[0] == "1\n" and real.returncode == 0
    with forked_commands():
        with command_start.commands_started_by(subprocess.Popen):  # nested: the inner starter, then the outer again
            assert command_start._COMMAND_STARTER is subprocess.Popen
        assert command_start._COMMAND_STARTER is ForkedCommand
    assert command_start._COMMAND_STARTER is None


def test_a_forked_command_has_its_own_pipes_folder_environment_threads_and_log(entry_replaced, tmp_path):
    cwd, env = os.getcwd(), dict(os.environ)
    proc = ForkedCommand(["/some/bin/fairseq-train", "data-bin", "--arch", "x"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                         env={**os.environ, "FORKED_SEEN": "yes", "OMP_NUM_THREADS": "2"})
    out, err = proc.communicate("its input", timeout=60)
    assert proc.returncode == 0 and proc.pid != os.getpid()
    first, log = out.splitlines()
    assert first == f"['fairseq-train', 'data-bin', '--arch', 'x'] {tmp_path} yes 1 its input"  # 1 thread
    assert log.endswith(" | INFO | fairseq_cli.train | a log record")  # fairseq's format, on stdout
    assert err == "to stderr\n"
    assert os.getcwd() == cwd and dict(os.environ) == env  # this process is as it was


@pytest.mark.parametrize("then,code,stderr_end", [
    ("exit 3", 3, "to stderr\n"),
    ("normplug", 2, "to stderr\nfairseq-normplug: error: bad --norm-type x; choose from layernorm, rmsnorm\n"),
    ("crash", 1, "RuntimeError: boom\n"),
])
def test_a_forked_command_exits_as_the_process_would(entry_replaced, then, code, stderr_end):
    proc = forked(then)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.endswith(stderr_end), err


def test_a_forked_command_computes_on_one_thread_after_this_process_used_several(entry_replaced):
    """GNU OpenMP hangs in a fork of a process whose pool had several threads, if the fork asks
    for several again: the child computes on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(4_000_000).exp().sum()  # this process's pool of 2 threads
        proc = ForkedCommand(["fairseq-train"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "FORKED_THEN": "compute", "OMP_NUM_THREADS": "2"})
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        torch.set_num_threads(threads)
    assert proc.returncode == 0 and out.splitlines()[-1] == "sum True 1", err


def test_a_stop_signal_ends_a_forked_command_as_it_ends_a_process(entry_replaced):
    """The launcher's handlers (which raise LauncherStopped in the launcher) are not the child's."""
    with processes.stop_signals_forwarded():
        proc = forked("sleep")
        _, log, sleeping = (proc.stdout.readline() for _ in range(3))
        assert log.endswith("a log record\n") and sleeping == "sleeping\n"  # it runs
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_only_fairseq_commands_and_plain_options_are_forked():
    with pytest.raises(ValueError, match="no in-process entry point for 'python'"):
        ForkedCommand(["python", "-c", "print(1)"])
    with pytest.raises(ValueError, match="ForkedCommand does not take start_new_session"):
        ForkedCommand(["fairseq-train"], start_new_session=True)


@pytest.fixture
def stand_in_modules(tmp_path, monkeypatch):
    """Modules ``forked_by_main`` (a ``main(argv)``), ``forked_by_cli_main`` (a ``cli_main()``
    reading ``sys.argv``) and ``forked_by_nothing`` on this process's path."""
    (tmp_path / "forked_by_main.py").write_text(
        "import sys\ndef main(argv):\n    print('main', argv, sys.argv)\n    sys.exit(4)\n")
    (tmp_path / "forked_by_cli_main.py").write_text(
        "import sys\ndef cli_main():\n    print('cli_main', sys.argv)\ndef main(argv):\n    print('not me')\n")
    (tmp_path / "forked_by_nothing.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_python_m_command_runs_the_modules_cli_main_or_main(stand_in_modules):
    """``python -m MODULE ARG...`` (the conversion's fine-tune, the hydra entry point): the
    module's ``cli_main()`` if it has one, else ``main(argv)``; ``sys.argv`` as ``python -m`` sets it."""
    by_main = ForkedCommand([sys.executable, "-m", "forked_by_main", "a", "--b"], stdout=subprocess.PIPE, text=True)
    assert by_main.communicate(timeout=60)[0] == "main ['a', '--b'] ['forked_by_main', 'a', '--b']\n"
    assert by_main.returncode == 4
    by_cli_main = ForkedCommand([sys.executable, "-m", "forked_by_cli_main", "x=1"], stdout=subprocess.PIPE, text=True)
    assert by_cli_main.communicate(timeout=60)[0] == "cli_main ['forked_by_cli_main', 'x=1']\n"
    assert by_cli_main.returncode == 0
    with pytest.raises(ValueError, match="python -m forked_by_nothing: the module has neither cli_main"):
        ForkedCommand([sys.executable, "-m", "forked_by_nothing"])


def test_run_forked_runs_commands_side_by_side_and_returns_them_in_order(entry_replaced, tmp_path):
    first, second = inprocess.run_forked([["fairseq-train", "one"], ["fairseq-generate", "two"]], cwd=str(tmp_path),
                                         env={"FORKED_SEEN": "both", "FORKED_THEN": None})
    assert (first.returncode, second.returncode) == (0, 0) and first.args == ["fairseq-train", "one"]
    assert first.stdout.startswith(f"['fairseq-train', 'one'] {tmp_path} both 1")
    assert second.stdout.startswith(f"['fairseq-generate', 'two'] {tmp_path} both 1")
    assert first.stderr == second.stderr == "to stderr\n"
    failed, = inprocess.run_forked([["fairseq-train"]], env={"FORKED_THEN": "exit 3"})
    assert failed.returncode == 3  # returned, as run_parallel returns it: the test decides
    with pytest.raises(AssertionError, match="still running after 1 s, killed"):
        inprocess.run_forked([["fairseq-train"]], env={"FORKED_THEN": "sleep"}, timeout=1)


# ---- fairseq's state kept on its functions --------------------------------------------------

@pytest.fixture
def an_earlier_commands_best_scores():
    """What an earlier fairseq-train in this process leaves on fairseq's functions: a best dev
    loss no run beats, and early stopping's count past any patience."""
    from fairseq import checkpoint_utils
    from fairseq_cli import train

    checkpoint_utils.save_checkpoint.best = -1e9
    train.should_stop_early.best, train.should_stop_early.num_runs = -1e9, 99
    yield
    for (module, function), attributes in inprocess.FAIRSEQ_FUNCTION_STATE.items():
        for attribute in attributes:
            vars(getattr(sys.modules[module], function)).pop(attribute, None)


def test_a_forked_command_starts_without_an_earlier_commands_best_score(entry_replaced, an_earlier_commands_best_scores):
    """A forked runner's training inherited the test process's best dev score and never wrote
    checkpoint_best.pt (the trust table's runs failed in the suite, not alone)."""
    proc = forked("best")
    out, _ = proc.communicate()
    assert proc.returncode == 0 and "best None" in out, out


def test_an_in_process_training_writes_its_own_best_checkpoint(an_earlier_commands_best_scores, tiny_bin, tmp_path):
    from conftest import cli
    from inprocess import run_fairseq
    from test_cli import TRAIN_COMMON

    flags = [flag for flag in TRAIN_COMMON if flag != "--disable-validation"]
    proc = run_fairseq([cli("fairseq-train"), tiny_bin, "--arch", "transformer_normplug_tiny", *flags,
                        "--save-dir", str(tmp_path), "--max-update", "4", "--validate-interval-updates", "2",
                        "--patience", "1"])
    assert (tmp_path / "checkpoint_best.pt").exists(), proc.stdout[-2000:]
    assert "early stop" not in proc.stdout + proc.stderr


def test_the_state_inprocess_resets_is_still_where_fairseq_keeps_it():
    """Fails when fairseq renames what it keeps on its functions (update FAIRSEQ_FUNCTION_STATE)."""
    import importlib
    import inspect

    for (module, function), attributes in inprocess.FAIRSEQ_FUNCTION_STATE.items():
        source = inspect.getsource(importlib.import_module(module))
        assert all(f"{function}.{attribute} =" in source for attribute in attributes), (module, function)



# ---- a forked launcher ------------------------------------------------------------------------

def wait_for(condition, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.02)


def what_a_launcher_sees():
    """A launcher's main: what its process is, then ``$LAUNCHER_THEN``'s ending."""
    print(os.getpid(), os.getpgid(0) == os.getpid(), os.getcwd(), os.environ.get("FORKED_SEEN"),
          launchers.HELD_POLL_S, ownership.STALE_AFTER_S, processes.STOP_GRACE_S,
          command_start._COMMAND_STARTER is ForkedCommand, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          processes.stop_requested(), len(processes._PROCESSES.running), len(ownership._OWNED), flush=True)
    then = os.environ.get("LAUNCHER_THEN", "return 3")
    if then == "return 3":
        return 3
    if then == "exit 4":
        sys.exit(4)
    if then == "normplug":
        raise NormplugError("bad row 'x'; choose from PreNorm")
    if then == "crash":
        raise RuntimeError("boom")
    return None


def test_a_forked_launcher_is_a_new_process_with_its_environment_folder_and_the_runners_state(tmp_path):
    """Its own pid and session; its cwd and env applied, the settings read from the environment
    at import (NORMPLUG_HELD_POLL, ...) read again from its own; none of this launcher's stop
    handlers, processes or owned runs; its fairseq commands forked; its exit status main's."""
    settings = launchers.HELD_POLL_S, ownership.STALE_AFTER_S, processes.STOP_GRACE_S
    owner = ownership.RunOwnership(str(tmp_path))
    assert owner.acquire() is None  # a run this process owns: not the child's
    try:
        with processes.stop_signals_forwarded():
            proc = ForkedLauncher(what_a_launcher_sees, stdout=subprocess.PIPE, text=True, cwd=str(tmp_path),
                                  start_new_session=True,
                                  env={**os.environ, "FORKED_SEEN": "yes", "NORMPLUG_HELD_POLL": "0.25",
                                       "NORMPLUG_LOCK_TIMEOUT": "7", "NORMPLUG_STOP_GRACE": "2"})
            out, _ = proc.communicate(timeout=60)
    finally:
        owner.release()
    assert proc.returncode == 3 and proc.pid != os.getpid()
    assert out.split() == [str(proc.pid), "True", str(tmp_path), "yes", "0.25", "7.0", "2.0", "True", "True",
                           "None", "0", "0"]
    assert (launchers.HELD_POLL_S, ownership.STALE_AFTER_S, processes.STOP_GRACE_S) == settings  # as they were
    assert "FORKED_SEEN" not in os.environ and command_start._COMMAND_STARTER is None


@pytest.mark.parametrize("then,code,stderr_end", [
    ("end", 0, ""), ("exit 4", 4, ""),
    ("normplug", 2, "fairseq-normplug: error: bad row 'x'; choose from PreNorm\n"),
    ("crash", 1, "RuntimeError: boom\n"),
])
def test_a_forked_launcher_exits_as_its_process_would(then, code, stderr_end):
    proc = ForkedLauncher(what_a_launcher_sees, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "LAUNCHER_THEN": then})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.endswith(stderr_end), err


def launcher_with_a_sleeping_command():
    """A launcher's main: the runner's seam starts a fairseq-train (the stand-in, sleeping) inside
    its stop forwarding; on a stop, what the command ended with."""
    run = types.SimpleNamespace(run_dir=os.getcwd())
    try:
        with processes.stop_signals_forwarded():
            with processes.run_process(run, "trainer", ["fairseq-train"], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, "FORKED_THEN": "sleep"}) as command:
                command.stdout.readline()  # what it sees
                print(type(command).__name__, command.pid, command.stdout.readline().split()[-1],
                      command.stdout.readline().strip(), flush=True)
                command.wait()
    except processes.LauncherStopped as stop:
        print(stop, command.returncode, flush=True)
        return 5
    return 0


def test_killing_a_forked_launchers_group_kills_its_commands(entry_replaced, tmp_path):
    proc = ForkedLauncher(launcher_with_a_sleeping_command, stdout=subprocess.PIPE, text=True, cwd=str(tmp_path),
                          start_new_session=True)
    kind, command_pid, log, sleeping = proc.stdout.readline().split()
    assert (kind, log, sleeping) == ("ForkedCommand", "record", "sleeping")  # forked, and it runs
    assert os.getpgid(int(command_pid)) == proc.pid  # in the launcher's group
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    wait_for(lambda: not ownership.pid_alive(int(command_pid)))


def test_a_stop_signal_reaches_the_forked_launchers_handler(entry_replaced, tmp_path):
    """SIGTERM to the launcher: the runner's handler forwards it to its command and raises
    LauncherStopped; the test process's own handlers are untouched."""
    proc = ForkedLauncher(launcher_with_a_sleeping_command, stdout=subprocess.PIPE, text=True, cwd=str(tmp_path),
                          start_new_session=True)
    assert proc.stdout.readline().split()[0] == "ForkedCommand"
    handler = signal.getsignal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 5 and out == f"stopped by SIGTERM {-signal.SIGTERM}\n"
    assert signal.getsignal(signal.SIGTERM) is handler


def test_every_setting_read_from_the_environment_at_import_is_read_again_in_a_forked_child():
    """Fails when a module of the plugin reads a new setting from the environment at import
    (add it to inprocess.ENVIRONMENT_SETTINGS)."""
    import ast
    import pathlib

    import fairseq_normplug

    found = {}
    for path in pathlib.Path(fairseq_normplug.__file__).parent.rglob("*.py"):
        module = ".".join(path.relative_to(pathlib.Path(fairseq_normplug.__file__).parent.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and "os.environ" in ast.unparse(node.value or ast.Constant()):
                targets = getattr(node, "targets", None) or [node.target]
                found.setdefault(module, set()).update(t.id for t in targets)
    assert found == {module: set(names) for module, names in inprocess.ENVIRONMENT_SETTINGS.items()}
