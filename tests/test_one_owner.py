"""One owner down to the trainer (issue 50): a launcher stopped by SIGTERM (SIGINT, SIGHUP)
ends its fairseq-train and fairseq-generate, waits for them, then releases its run; the run's
lock names the trainer (and the decoder while it decodes), and a run whose launcher is gone
but whose trainer still runs is not taken over. In-process tests of the lock's rules and of
the signal forwarding; fault tests (slow) on test_trust's tiny two-row table: the launcher is
stopped while its trainer (or decoder) is held at a chosen point by a test-only hook, then the
same table is run again at once, and must equal the uninterrupted one."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

import fault_hooks
from conftest import REPO
from inprocess import forked_commands
from test_trust import trust  # noqa: F401 (fixture)
from test_trust import (copy_reference_runs, finish, held_pid, launcher_here, run_dir, start_launcher,
                        start_paused_launcher, table_csv, uninterrupted_table, wait_for, write_lock)
from fairseq_normplug.experiments import ownership, runner, single_run
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.launchers import LocalLauncher

HERE = socket.gethostname()


def finished_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def write_lock_with(folder, launcher_pid, processes):
    """A lock of this host's launcher ``launcher_pid`` that records ``processes`` ({role: (pid, started)})."""
    write_lock(folder, HERE, launcher_pid)
    path = os.path.join(folder, ownership.LOCK_NAME)
    with open(path) as f:
        data = json.load(f)
    data["processes"] = {role: {"pid": pid, "started": started} for role, (pid, started) in processes.items()}
    with open(path, "w") as f:
        json.dump(data, f)


# --------------------------------------------------------------------------- the lock's rules


def test_a_run_whose_launcher_is_gone_but_whose_trainer_runs_is_not_taken_over(tmp_path):
    folder = str(tmp_path / "run")
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock_with(folder, finished_pid(), {"trainer": (trainer.pid, ownership.start_ticks(trainer.pid))})
        holder = ownership.RunOwnership(folder).acquire()
        assert holder is not None and holder.processes[0][:2] == ("trainer", trainer.pid)
        assert f", trainer pid {trainer.pid} (heartbeat" in holder.describe()
        assert ownership.live_holder(folder) == holder
        # a heartbeat older than the timeout does not matter on this host: the trainer writes the run
        old = time.time() - ownership.STALE_AFTER_S - 5
        os.utime(os.path.join(folder, ownership.LOCK_NAME), (old, old))
        assert ownership.RunOwnership(folder).acquire() is not None
    finally:
        trainer.kill()
        trainer.wait()
    owner = ownership.RunOwnership(folder)  # both gone: taken over at once
    assert owner.acquire() is None and owner.took_over[1] == "its process is gone, and so is its trainer"
    owner.release()


def test_a_recorded_pid_that_another_process_reuses_does_not_hold_the_run(tmp_path):
    folder = str(tmp_path / "run")
    write_lock_with(folder, finished_pid(), {"trainer": (os.getpid(), ownership.start_ticks(os.getpid()) - 1)})
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None and owner.took_over[1] == "its process is gone, and so is its trainer"
    owner.release()


def test_the_owner_records_its_trainer_and_decoder_through_its_descriptor(tmp_path):
    folder = str(tmp_path / "run")
    os.makedirs(folder)
    path = os.path.join(folder, ownership.LOCK_NAME)
    ownership.record_process(folder, "trainer", os.getpid())  # no owner in this process: nothing
    assert not os.path.exists(path)
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None
    ownership.record_process(os.path.join(folder, "."), "trainer", os.getpid())  # any spelling of the folder
    assert ownership.read_holder(path).processes == (("trainer", os.getpid(), ownership.start_ticks(os.getpid())),)
    ownership.record_process(folder, "trainer", None)
    ownership.record_process(folder, "decoder", os.getpid())
    assert [role for role, _, _ in ownership.read_holder(path).processes] == ["decoder"]
    write_lock(folder, "node-7", 1234)  # taken over meanwhile: the taker's lock is left alone
    ownership.record_process(folder, "decoder", None)
    assert ownership.read_holder(path).host == "node-7"
    owner.release()
    assert ownership.read_holder(path).host == "node-7"
    ownership.record_process(folder, "trainer", os.getpid())  # released: no owner any more
    assert ownership.read_holder(path).host == "node-7"


# --------------------------------------------------------------------------- signal forwarding


SLEEPER = "import time; print('sleeping', flush=True); time.sleep(60)"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_the_runs_process_and_then_stops_the_launcher(tmp_path, signum):
    folder = str(tmp_path / "run")
    os.makedirs(folder)
    run = types.SimpleNamespace(run_dir=folder)
    path = os.path.join(folder, ownership.LOCK_NAME)
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None
    recorded = []
    with pytest.raises(runner.LauncherStopped, match=signal.Signals(signum).name):
        with runner.stop_signals_forwarded():
            with runner.run_process(run, "trainer", [sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE,
                                    text=True) as proc:
                assert proc.stdout.readline() == "sleeping\n"  # started (a signal at start-up may end it otherwise)
                recorded.append(ownership.read_holder(path).processes)
                os.kill(os.getpid(), signum)
                proc.wait()  # the signal arrives before this returns
    (role, pid, started), = recorded[0]
    assert (role, pid) == ("trainer", proc.pid) and started is not None
    assert proc.returncode == -signum  # forwarded, ended, waited for
    assert ownership.read_holder(path).processes == ()  # forgotten once it ended
    assert signal.getsignal(signum) is not runner._on_stop_signal  # the previous handler is back
    owner.release()


def test_a_process_that_ends_normally_is_forgotten_and_no_stop_is_raised(tmp_path):
    run = types.SimpleNamespace(run_dir=str(tmp_path))
    owner = ownership.RunOwnership(str(tmp_path))
    assert owner.acquire() is None
    with runner.stop_signals_forwarded():
        with runner.run_process(run, "decoder", [sys.executable, "-c", "print(1)"], stdout=subprocess.PIPE,
                                text=True) as proc:
            assert proc.communicate()[0] == "1\n"
    assert ownership.read_holder(os.path.join(str(tmp_path), ownership.LOCK_NAME)).processes == ()
    owner.release()


def test_a_stopped_launcher_with_parallel_runs_ends_them_all_and_starts_no_other(tmp_path):
    """--jobs 2: SIGTERM while two runs train (their "trainers" are sleeping processes): both are
    ended, each worker's run is released, the third run never starts, and the launcher stops."""
    table = load_table("demo")
    runs = [runner.Run(table=table, row=table.rows[0], pair="src-tgt", data_dir=str(tmp_path),
                       run_dir=str(tmp_path / f"run{i}")) for i in range(3)]
    started, released = [], []

    def fake_execute(run, extra, echo):
        os.makedirs(run.run_dir, exist_ok=True)
        owner = ownership.RunOwnership(run.run_dir)
        assert owner.acquire() is None
        try:
            with runner.run_process(run, "trainer", [sys.executable, "-c", "import time; time.sleep(60)"]) as proc:
                started.append(proc)
                proc.wait()
        finally:
            released.append((run.run_dir, proc.returncode))
            owner.release()
        return {"status": "done"}

    def stop_once_both_train():
        wait_for(lambda: len(started) == 2, timeout=30)
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_both_train)
    stopper.start()
    with pytest.raises(runner.LauncherStopped):
        LocalLauncher(jobs=2, visible_devices=[], execute=fake_execute).execute(runs, [], lambda message: None)
    stopper.join()
    assert [proc.returncode for proc in started] == [-signal.SIGTERM] * 2
    # each run released only once its trainer had ended
    assert sorted(released) == [(runs[0].run_dir, -signal.SIGTERM), (runs[1].run_dir, -signal.SIGTERM)]
    assert not os.path.exists(runs[2].run_dir)


# --------------------------------------------------------------------------- fault tests


@pytest.fixture(scope="module")
def prenorm_reference(trust):
    """test_trust's table of the PreNorm row (the one row the fault tests below run), uninterrupted:
    its results.csv, and its run in ``reference``/runs."""
    return uninterrupted_table(trust, rows=["PreNorm"])


def kill_if_alive(pid):
    if ownership.pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("pause_at,target,signum", [
    # during training (the save of update 5 is there)
    pytest.param("update:7", "launcher", signal.SIGTERM, id="TERM-launcher-training"),
    # the whole job (a scheduler's stop)
    pytest.param("update:7", "group", signal.SIGTERM, id="TERM-group-training"),
    pytest.param("generate:1", "launcher", signal.SIGTERM, id="TERM-launcher-decoding"),
    # the terminal closed
    pytest.param("update:7", "launcher", signal.SIGHUP, id="HUP-launcher-training"),
])
def test_a_stopped_launcher_ends_its_process_and_the_rerun_equals_the_uninterrupted_table(
        trust, prenorm_reference, pause_at, target, signum):
    """Stopped while its fairseq-train is held after update 7, or its fairseq-generate at its first
    batch: for the decoder, the launcher starts on a copy of the uninterrupted run, trained and not
    yet scored (its training is not what is stopped)."""
    root = trust[0]
    out = f"stop-{pause_at.replace(':', '')}-{target}-{signal.Signals(signum).name}"
    if pause_at.startswith("generate"):
        trained = copy_reference_runs(root, out) / "prenorm"
        for name in ("scores.json", "generate-test.txt"):
            os.remove(trained / name)
    stopped, paused = start_paused_launcher(trust, out, out, pause_at)
    pid = held_pid(stopped, paused)
    try:
        (os.killpg if target == "group" else os.kill)(stopped.pid, signum)
        assert finish(stopped, timeout=120) != 0
        assert not ownership.pid_alive(pid), "the launcher exited, its fairseq process goes on"
        assert not os.path.exists(os.path.join(run_dir(root / out, "prenorm"), ownership.LOCK_NAME))
    finally:
        kill_if_alive(pid)
    assert launcher_here(trust, out, "rerun-" + out, rows=["PreNorm"]) == 0
    log = (root / f"rerun-{out}.log").read_text()
    assert "took the run over" not in log  # released by the stopped launcher
    assert ("training (resuming)" in log) == pause_at.startswith("update")
    assert table_csv(root / out, f"rerun-{out}-results") == prenorm_reference
    assert not [name for name in os.listdir(run_dir(root / out, "prenorm")) if ".tmp" in name]


@pytest.mark.slow
def test_a_killed_launchers_trainer_keeps_the_run_until_it_ends(trust, prenorm_reference):
    """SIGKILL to the launcher alone: its trainer goes on, and the lock names it; a re-run
    waits for it (held), then takes the run over and ends with the uninterrupted table."""
    root, out = trust[0], "kill-launcher"
    killed, paused = start_paused_launcher(trust, out, out, "update:7")
    pid = held_pid(killed, paused)
    try:
        lock = os.path.join(run_dir(root / out, "prenorm"), ownership.LOCK_NAME)
        holder = ownership.read_holder(lock)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert ownership.pid_alive(pid) and [role for role, _, _ in holder.processes] == ["trainer"]
        rerun = start_launcher(trust, out, "rerun-" + out, rows=["PreNorm"])
        log = root / f"rerun-{out}.log"
        wait_for(lambda: "held by" in log.read_text() or rerun.poll() is not None)
        assert f"held by host {HERE} pid {killed.pid}, trainer pid " in log.read_text()
        time.sleep(1)
        assert rerun.poll() is None and "training (" not in log.read_text()
    finally:
        kill_if_alive(pid)  # the trainer ends
    assert finish(rerun) == 0
    text = log.read_text()
    assert "its process is gone, and so is its trainer" in text and "training (resuming)" in text
    assert table_csv(root / out, f"rerun-{out}-results") == prenorm_reference


@pytest.mark.slow
def test_train_sh_stopped_by_sigterm_ends_its_trainer_and_the_same_command_resumes(trust, monkeypatch, capsys):
    """scripts/train.sh (single_run.train_main, in this process): SIGTERM while fairseq-train (a
    real process, held after update 7 by the fault hooks' sitecustomize) is held ends it, releases
    the run and exits with one line; the same command resumes from update 5 and trains to update
    10 (its fairseq-train forked: the resume is the runner's logic, not its process's)."""
    root, configs, data = trust
    monkeypatch.setattr(single_run, "load_table", lambda name: load_table(name, configs))
    folder = str(root / "train-sh" / "prenorm")
    argv = ["trust", "PreNorm", data, "--run-dir", folder]
    paused = root / "train-sh.paused"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([fault_hooks.sitecustomize_folder(root), REPO]))
    monkeypatch.setenv("NORMPLUG_TEST_PAUSE_AT", "update:7")
    monkeypatch.setenv("NORMPLUG_TEST_PAUSED", str(paused))

    def stop_once_held():
        wait_for(paused.exists, timeout=300)
        if signal.getsignal(signal.SIGTERM) is getattr(runner, "_on_stop_signal", None):
            os.kill(os.getpid(), signal.SIGTERM)
        else:  # nothing would forward it (it would end this test process): the trainer is ended instead
            os.kill(int(paused.read_text()), signal.SIGKILL)

    stopper = threading.Thread(target=stop_once_held)
    stopper.start()
    try:
        with pytest.raises(SystemExit, match="^train.sh: stopped by SIGTERM: fairseq-train ended; the same command"):
            single_run.train_main(argv)
    finally:
        stopper.join()
        kill_if_alive(int(paused.read_text()))
    assert not ownership.pid_alive(int(paused.read_text()))
    assert not os.path.exists(os.path.join(folder, ownership.LOCK_NAME))
    assert json.load(open(os.path.join(folder, "status.json")))["status"] == "running"
    monkeypatch.delenv("NORMPLUG_TEST_PAUSE_AT")
    with pytest.raises(SystemExit) as exit_info, forked_commands():
        single_run.train_main(argv)
    assert exit_info.value.code == 0
    status = json.load(open(os.path.join(folder, "status.json")))
    assert (status["status"], status["updates"]) == ("done", 10)
    assert "training (resuming)" in capsys.readouterr().out
