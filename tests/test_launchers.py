"""Launchers (experiments/launchers.py) and reproduce.sh's table options: device slots and
threads, --jobs 2 against --jobs 1, submitit's local executor (with a preemption), honest exit
status, --print-commands, --status, --collect."""
import csv
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch

import fault_hooks
from conftest import REPO
from inprocess import ForkedCommand, forked_commands
from fairseq_normplug.command_start import commands_started_by
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import demo, launchers, reproduce
from fairseq_normplug.experiments.configs import CONFIG_DIR, load_table
from fairseq_normplug.experiments.launchers import LocalLauncher, SlurmLauncher, device_slots

# --------------------------------------------------------------------------- device slots


@pytest.mark.parametrize("jobs,per_run,visible,slots", [
    (1, None, [], [None]), (3, None, [], [None, None, None]), (1, None, ["0", "1"], [None]),
    (1, 2, ["0", "1", "2"], ["0,1"]), (2, None, ["0", "1", "2", "3", "4"], ["0,1", "2,3"]),
    (2, 1, ["4", "6", "7"], ["4", "6"]), (4, 2, [str(i) for i in range(8)], ["0,1", "2,3", "4,5", "6,7"]),
])
def test_device_slots_are_disjoint_groups_of_the_visible_gpus(jobs, per_run, visible, slots):
    assert device_slots(jobs, per_run, visible) == slots


@pytest.mark.parametrize("jobs,per_run,visible,message", [
    (3, 2, ["0", "1", "2", "3"], "--jobs 3 x --devices-per-run 2 = 6 GPUs, but 4 are visible (0,1,2,3)"),
    (3, None, ["0", "1"], "--jobs 3 needs at least 3 GPUs, 2 visible (0,1); use --jobs 2 or fewer"),
    (1, 2, [], "--devices-per-run 2: no GPU is visible here"), (0, None, [], "--jobs must be at least 1, got 0"),
])
def test_impossible_device_requests_are_one_line_errors(jobs, per_run, visible, message):
    with pytest.raises(NormplugError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        device_slots(jobs, per_run, visible)


@pytest.fixture
def fake_data(tmp_path):
    """A folder that passes the runner's checks (nothing here trains on it)."""
    data = tmp_path / "src-tgt"
    for path in ("bin/dict.src.txt", "bin/train.src-tgt.src.bin", "ref/test.tok.tgt"):
        (data / path).parent.mkdir(parents=True, exist_ok=True)
        (data / path).write_text("")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return str(data)


@pytest.fixture
def cpu_machine(monkeypatch):
    """This machine as a CPU-only one, whatever it has (the tests' expectations are CPU's)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def demo_runs(data_dir: str, runs_dir: str, seeds=(1,)):
    return reproduce.plan_runs(load_table("demo"), ["src-tgt"], {"src-tgt": data_dir}, runs_dir, seeds=seeds)


def test_parallel_runs_get_their_own_slot_and_a_share_of_the_cores(fake_data, tmp_path):
    started = []

    def fake_execute(run, extra, echo):
        started.append((run.label, run.devices, run.threads, run.num_devices, time.monotonic()))
        time.sleep(0.05)
        started.append((run.label, run.devices, "end", None, time.monotonic()))

    launcher = LocalLauncher(jobs=2, devices_per_run=2, visible_devices=["0", "1", "2", "3"], cores=8,
                             execute=fake_execute)
    runs = launcher.prepare(demo_runs(fake_data, str(tmp_path / "runs"), seeds=(1, 2)))
    messages = []
    launcher.execute(runs, [], messages.append)
    starts = [e for e in started if e[2] != "end"]
    assert len(starts) == 6 and {e[1] for e in starts} == {"0,1", "2,3"}
    assert {(e[2], e[3]) for e in starts} == {(4, 2)}  # 8 cores / 2 jobs; 2 GPUs per run
    running = {}
    for label, devices, what, _, _ in sorted(started, key=lambda e: e[4]):
        if what == "end":
            del running[label]
        else:
            assert devices not in running.values(), "two runs at once on one slot"
            running[label] = devices
    assert sum("(CUDA_VISIBLE_DEVICES=" in m for m in messages) == 6


def test_one_job_keeps_todays_environment(fake_data, tmp_path):
    launcher = LocalLauncher(visible_devices=["0", "1"])
    run = launcher.prepare(demo_runs(fake_data, str(tmp_path)))[0]
    assert (run.devices, run.num_devices, run.threads, run.env()) == (None, None, None, {})
    assert LocalLauncher(jobs=2, visible_devices=[], cores=2).threads == 1


def test_a_runs_fairseq_processes_get_its_devices_and_threads_and_an_evaluation_error_is_recorded(
        fake_data, tmp_path, monkeypatch):
    """execute_run with fairseq-train and fairseq-generate stubbed: both get the run's
    CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS; a failing fairseq-generate does not raise, it
    leaves the run 'trained, not evaluated' with the error (and so a failed run)."""
    from fairseq_normplug.experiments import runner

    envs = {}

    class FakeTrain:
        pid = os.getpid()  # the runner records its processes' pids

        def __init__(self, command, env, **kwargs):
            envs["train"] = env
            os.makedirs(os.path.join(run.run_dir, "checkpoints"), exist_ok=True)
            # a complete checkpoint (the runner refuses a truncated one before decoding)
            torch.save({"model": {}, "optimizer_history": [{"num_updates": 400}], "extra_state": {}},
                       os.path.join(run.run_dir, "checkpoints", "checkpoint_best.pt"))
            self.stdout = iter(['2026-01-01 10:00:00 | INFO | train_inner | {"num_updates": "400"}\n'])

        def wait(self):
            return 0

    class FakeGenerate:
        pid, returncode = os.getpid(), 1

        def __init__(self, command, env, **kwargs):
            envs["generate"] = env

        def communicate(self):
            return None, "Traceback\nRuntimeError: out of memory\n"

    def fake_process(command, **kwargs):
        return (FakeGenerate if os.path.basename(command[0]) == "fairseq-generate" else FakeTrain)(command, **kwargs)

    monkeypatch.setattr(runner.subprocess, "Popen", fake_process)
    run = dataclasses.replace(demo_runs(fake_data, str(tmp_path))[0], devices="2,3", num_devices=2, threads=1)
    messages = []
    status = launchers.execute_run(run, [], messages.append)
    for name in ("train", "generate"):
        assert (envs[name]["CUDA_VISIBLE_DEVICES"], envs[name]["OMP_NUM_THREADS"]) == ("2,3", "1")
    assert messages[0] == (f"[{run.label}] 1000 tokens per update (--max-tokens 500 x 2 devices x --update-freq 1)"
                           f" on CUDA_VISIBLE_DEVICES=2,3, 1 thread")
    assert messages[-1] == f"[{run.label}] error: fairseq-generate failed for {run.label}: RuntimeError: out of memory"
    assert status["status"] == "done" and status["updates"] == 400
    assert launchers.failure_of(run) == (f"trained, not evaluated: fairseq-generate failed for {run.label}: "
                                         f"RuntimeError: out of memory")


# --------------------------------------------------------------------------- real tiny tables

RECIPE = {"base": "cpu_tiny", "decoding": {"beam": 1}, "generate": {"--max-tokens": "4000"},
          "train": {"--max-update": "10", "--validate-interval-updates": "5", "--log-interval": "5",
                    "--norm-stats-interval": "5"}}
TWO_ROWS = {"title": "Two tiny rows", "recipe": "test_orch", "pairs": ["src-tgt"], "rows": [
    {"name": "PreNorm", "model": ["--prenorm"], "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
    {"name": "PreNorm + FixNorm + ScaleNorm", "model": ["--prenorm", "--fixnorm", "--scalenorm"],
     "schedule": "no_warmup", "baseline": "PreNorm", "train": ["--lr", "3e-3", "--max-update", "15"]}]}
FAILING = {"title": "A diverging and a failing row", "recipe": "test_orch", "pairs": ["src-tgt"], "rows": [
    {"name": "Diverging", "model": [], "schedule": "no_warmup", "train": ["--lr", "1e4"]},
    {"name": "Failing", "model": [], "schedule": "no_warmup", "train": ["--optimizer", "no-such-optimizer"]}]}


@pytest.fixture(scope="module")
def orch(tiny_data_dir, tmp_path_factory):
    """Config folder with the two-row tiny table, and a data folder on the tiny corpus (conftest)."""
    root = tmp_path_factory.mktemp("orch")
    config_dir = root / "configs"
    shutil.copytree(CONFIG_DIR, config_dir)
    recipes = json.loads((config_dir / "recipes.json").read_text())
    recipes["test_orch"] = RECIPE
    (config_dir / "recipes.json").write_text(json.dumps(recipes))
    (config_dir / "experiments" / "orch.json").write_text(json.dumps(TWO_ROWS))
    return root, str(config_dir), tiny_data_dir


def table_run(orch, name, launcher, out_name):
    root, config_dir, data = orch
    out = root / out_name
    messages = []
    results = reproduce.run_table(load_table("orch", config_dir), ["src-tgt"], {"src-tgt": data},
                                  str(out / "runs"), str(out / "results"), echo=messages.append, launcher=launcher)
    return out, results, messages


def csv_without_times(out) -> list:
    with open(out / "results" / "results.csv", encoding="utf-8") as f:
        return [{k: v for k, v in row.items() if k != "minutes"} for row in csv.DictReader(f)]


def run_records_without_times(run_dir) -> dict:
    """A run's status.json and scores.json (all but the minutes), its test translations and dev
    records (generate-test.txt's H- lines, train.log's valid records but their wall times)."""
    status = json.loads((run_dir / "status.json").read_text())
    hypotheses = [line for line in (run_dir / "generate-test.txt").read_text().splitlines() if line.startswith("H-")]
    valid = [{k: v for k, v in json.loads(line.split(" | ", 3)[3]).items() if k != "valid_wall"}
             for line in (run_dir / "train.log").read_text().splitlines() if " | valid | " in line]
    return {"status": {k: v for k, v in status.items() if k != "minutes"},
            "scores": json.loads((run_dir / "scores.json").read_text()), "hypotheses": hypotheses, "valid": valid}


def log_span(log_path) -> tuple:
    """(first, last) timestamp of a fairseq log, as 'YYYY-MM-DD HH:MM:SS' strings."""
    stamps = [line[:19] for line in open(log_path, encoding="utf-8") if line[:2] == "20" and line[19:22] == " | "]
    return stamps[0], stamps[-1]


@pytest.fixture(scope="module")
def one_job(orch):
    """The table by one job, its fairseq commands in forked children of this process
    (tests/inprocess.py's forked_commands); ``two_jobs``, the same table, its trainings by real
    processes."""
    with forked_commands():
        return table_run(orch, "orch", LocalLauncher(jobs=1, cpus_per_run=1, visible_devices=[]), "jobs1")


def real_trainings_forked_decodings(command, **popen_options) -> subprocess.Popen:
    """A run's fairseq-train as a real process, its fairseq-generate as a forked child of this
    process (tests/inprocess.py's ForkedCommand): a starter for ``commands_started_by``."""
    if os.path.basename(command[0]) == "fairseq-generate":
        return ForkedCommand(command, **popen_options)
    return subprocess.Popen(command, **popen_options)


@pytest.fixture(scope="module")
def two_jobs(orch, one_job):
    """The same table by two jobs at once: its two trainings real fairseq-train processes, started
    by the launcher's two worker threads (compared with ``one_job``'s forked ones), its test
    decodings forked children (their start is not the subject). After ``one_job``: every module
    the runner and its commands import lazily is imported already, so that no worker thread
    imports one while the other forks a decoding (the child would inherit the import half done)."""
    with commands_started_by(real_trainings_forked_decodings):
        return table_run(orch, "orch", LocalLauncher(jobs=2, cpus_per_run=1, visible_devices=[]), "jobs2")


@pytest.mark.slow
def test_two_jobs_run_at_once_and_give_the_same_table_as_one(one_job, two_jobs):
    (out1, results1, messages1), (out2, results2, messages2) = one_job, two_jobs
    assert [r["status"] for r in results1] == ["ok", "ok"] and not results1.failed and not results2.failed
    assert csv_without_times(out1) == csv_without_times(out2)
    assert (out1 / "results" / "results.md").exists() and (out2 / "results" / "results.md").exists()
    for slug in ("prenorm", "prenorm-fixnorm-scalenorm"):  # forked children (one job) = real trainers (two)
        run1, run2 = (out / "runs" / "orch" / "src-tgt" / slug for out in (out1, out2))
        assert run_records_without_times(run1) == run_records_without_times(run2), slug
    spans = {}
    for out in (out1, out2):
        first, second = (out / "runs" / "orch" / "src-tgt" / slug / "train.log"
                         for slug in ("prenorm", "prenorm-fixnorm-scalenorm"))
        spans[out] = log_span(first), log_span(second)
    (a1, b1), (a2, b2) = spans[out1], spans[out2]
    assert b1[0] >= a1[1], "--jobs 1 trains one run after the other"
    assert b2[0] < a2[1] and a2[0] < b2[1], "--jobs 2 trains both at once"
    for messages in (messages1, messages2):  # one progress line per validation, with the run's label
        for label in ("orch src-tgt | PreNorm]", "orch src-tgt | PreNorm + FixNorm + ScaleNorm]"):
            validations = 2 if label.endswith("PreNorm]") else 3
            assert sum(m.startswith(f"[{label[:-1]}] update ") and "dev loss" in m for m in messages) == validations
            assert any(m.startswith(f"[{label[:-1]}] 1500 tokens per update (--max-tokens 1500 x 1 device x "
                                    f"--update-freq 1), 1 thread") for m in messages)


@pytest.mark.slow
def test_submitit_local_executor_runs_the_table_and_requeues_a_preempted_job(orch, one_job, monkeypatch):
    """The same jobs as on SLURM, run by submitit's local executor; the second run gets the
    preemption signal (SIGUSR2) while its fairseq-train is held after update 6, past its first
    checkpoint (tests/fault_hooks.py's pause, a sitecustomize in the job's real processes: however
    slow the machine, the signal comes mid-training): it is requeued and resumes from update 5, and
    its resumed trainer passes update 6 without being held again. (The first run's folder is --jobs
    1's finished one: its job only finds it done, to save time.)"""
    root, _, _ = orch
    shutil.copytree(one_job[0] / "runs" / "orch" / "src-tgt" / "prenorm", root / "slurm" / "runs" / "orch" /
                    "src-tgt" / "prenorm")
    paused = root / "slurm-trainer.paused"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([fault_hooks.sitecustomize_folder(root), REPO]))
    monkeypatch.setenv("NORMPLUG_TEST_PAUSE_AT", "update:6")
    monkeypatch.setenv("NORMPLUG_TEST_PAUSED", str(paused))
    launcher = SlurmLauncher(folder=str(root / "submitit"), cluster="local", gpus_per_run=0, cpus_per_run=1,
                             time_limit_min=30)
    preempted = root / "slurm" / "runs" / "orch" / "src-tgt" / "prenorm-fixnorm-scalenorm"
    signalled = []

    def preempt():
        deadline = time.time() + 300
        while time.time() < deadline and not signalled:
            job = launcher.submitted.get(str(preempted))
            if job is not None and paused.exists():
                for pid in launchers.descendants(int(job.job_id)):
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"submitit.core._submit" in f.read():
                            os.kill(pid, signal.SIGUSR2)
                            signalled.append(pid)
                            break
            time.sleep(0.05)

    thread = threading.Thread(target=preempt, daemon=True)
    thread.start()
    out, results, messages = table_run(orch, "orch", launcher, "slurm")
    thread.join(1)
    assert signalled, "the preemption signal was never sent"
    assert [r["status"] for r in results] == ["ok", "ok"] and not results.failed
    assert "PreNorm + FixNorm + ScaleNorm" in (out / "results" / "results.md").read_text()
    log = (preempted / "train.log").read_text()
    assert "Loaded checkpoint" in log and json.loads((preempted / "status.json").read_text())["updates"] == 15
    job_log = open(launcher.submitted[str(preempted)].paths.stdout, encoding="utf-8").read()
    assert "time limit or preemption: stopping" in job_log and "training (resuming)" in job_log
    assert sum("] job " in m and " ended: done" in m for m in messages) == 2


def test_a_failed_run_makes_the_exit_status_non_zero_a_diverged_one_does_not(fake_data, tmp_path, monkeypatch,
                                                                             capsys, cpu_machine):
    """reproduce.sh end to end with fairseq-train stubbed (the runner's real divergence detection
    is tests/test_experiments.py's): a row that diverges and a row whose fairseq-train fails."""
    from fairseq_normplug.experiments import runner

    config_dir = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, config_dir)
    recipes = json.loads((config_dir / "recipes.json").read_text())
    recipes["test_orch"] = RECIPE
    (config_dir / "recipes.json").write_text(json.dumps(recipes))
    (config_dir / "experiments" / "orch_failing.json").write_text(json.dumps(FAILING))
    monkeypatch.setattr(reproduce, "load_table", lambda name: load_table(name, str(config_dir)))

    class FakeTrain:
        pid = os.getpid()  # the runner records its processes' pids

        def __init__(self, command, **kwargs):
            diverging = "1e4" in command
            self.code = 1 if diverging else 2
            self.stdout = iter(["FloatingPointError: Minimum loss scale reached (0.0001).\n"] if diverging else [
                "usage: fairseq-train [-h]\n", "fairseq-train: error: argument --optimizer: invalid choice: "
                "'no-such-optimizer'\n"])

        def wait(self):
            return self.code

    monkeypatch.setattr(runner.subprocess, "Popen", FakeTrain)
    runs_dir = tmp_path / "runs"
    args = ["orch_failing", "--data", f"src-tgt={fake_data}", "--runs-dir", str(runs_dir),
            "--results-dir", str(tmp_path / "results"), "--jobs", "2"]
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(args)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == "[reproduce] 1 run(s) FAILED:"
    assert lines[-1] == (f"[reproduce] FAILED orch_failing src-tgt | Failing: training failed (exit 2): fairseq-train: "
                         f"error: argument --optimizer: invalid choice: 'no-such-optimizer'; log: "
                         f"{runs_dir / 'orch_failing' / 'src-tgt' / 'failing' / 'train.log'}")
    with open(tmp_path / "results" / "results.csv", encoding="utf-8") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["diverged", "failed"]
    reproduce.main(args[:1] + ["--rows", "Diverging"] + args[1:])  # a diverged run alone: exit 0
    assert "FAILED" not in capsys.readouterr().out


def test_demo_exits_non_zero_naming_the_failed_runs(fake_data, tmp_path, monkeypatch, capsys, cpu_machine):
    run = demo_runs(fake_data, str(tmp_path))[0]
    outcome = []
    monkeypatch.setattr(demo, "prepare", lambda raw, src, tgt, dest, *rest: fake_data)
    monkeypatch.setattr(demo, "corpus_folder", lambda *args: "corpus-00000000")
    monkeypatch.setattr(demo, "run_table", lambda *args, **kw: reproduce.TableResults([], [run], outcome))
    argv = ["--corpus", str(tmp_path), "--src", "src", "--tgt", "tgt", "--out", str(tmp_path / "out")]
    demo.main(argv)  # no failure: returns
    outcome.append((run, "training failed (exit 1)", run.path("train.log")))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert "1 run(s) failed" in lines[-3]
    assert lines[-1] == (f"[reproduce] FAILED {run.label}: training failed (exit 1); log: {run.path('train.log')}")


# --------------------------------------------------------------------------- looking at a table


def test_print_commands_prints_every_command_and_runs_nothing(fake_data, tmp_path, capsys, cpu_machine):
    runs_dir = tmp_path / "runs"
    reproduce.main(["demo", "--data", f"src-tgt={fake_data}", "--runs-dir", str(runs_dir), "--seeds", "1", "2",
                    "--jobs", "2", "--cpus-per-run", "1", "--print-commands"])
    out = capsys.readouterr().out
    assert not runs_dir.exists()
    assert out.count("fairseq-train ") == 6 and out.count("fairseq-generate ") == 6
    for folder in ("postnorm-layernorm-warmup", "postnorm-layernorm-warmup-seed2", "prenorm-dyt-seed2"):
        assert f"run folder: {runs_dir / 'demo' / 'src-tgt' / folder}\n" in out
    assert out.count("seed 2; devices: cpu, 1 thread; 1000 tokens per update (--max-tokens 1000 x 1 device x "
                     "--update-freq 1)") == 3
    assert out.count("--seed 2 ") == 3 and out.count("train: OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ") == 6
    # 400 updates x 1000 tokens at ~1,100 target tokens/s (configs/speed.json) = 0.10 hours each
    assert out.count("cost: at most 400 updates x 1000 tokens at 1,100 target tokens/s") == 6
    assert "= 0.10 hours of training" in out
    assert out.strip().splitlines()[-1].startswith("[print-commands] 6 runs: 0 done (skipped), 0 to resume, 6 to "
                                                   "train; nothing was run; estimated training time of the 6 "
                                                   "run(s) to train with a measured speed: 0.61 hours")


def test_print_commands_of_the_paper_recipe_before_the_data_is_prepared(tmp_path, capsys):
    """Issue 19's check: table3 gl-en on one device trains with --max-tokens 4096, one joint
    embedding, Adam (0.9, 0.999) and decodes up to source + 50; nothing needs preparing first."""
    runs_dir = tmp_path / "runs"
    reproduce.main(["table3", "gl-en", "--data", f"gl-en={tmp_path / 'not-prepared'}", "--runs-dir", str(runs_dir),
                    "--rows", "PreNorm + FixNorm + ScaleNorm", "--print-commands"])
    out = capsys.readouterr().out
    assert not runs_dir.exists() and not (tmp_path / "not-prepared").exists()
    assert "is not prepared yet" in out and "4096 tokens per update (--max-tokens 4096 x 1 device x --update-freq 1)" in out
    train = next(line for line in out.splitlines() if line.startswith("  train: "))
    test = next(line for line in out.splitlines() if line.startswith("  test: "))
    for flags in ("--share-all-embeddings", "--adam-betas '(0.9, 0.999)'", "--target-vocab-mask",
                  '--eval-bleu-args \'{"beam": 4, "max_len_a": 1, "max_len_b": 50}\'', "--gnmt-search"):
        assert flags in train
    assert "--beam 4 --max-len-a 1 --max-len-b 50 --gnmt-alpha 0.6 --gnmt-search" in test


def test_a_table_under_another_recipe_runs_apart_from_its_own(tmp_path, capsys):
    """--recipe cpu_short: the beyond rows at CPU scale (600 updates, greedy dev and test), in
    runs/beyond.cpu_short, never in the table's own run folders; a bad name is one line."""
    runs_dir = tmp_path / "runs"
    reproduce.main(["beyond", "de-en", "--recipe", "cpu_short", "--data", f"de-en={tmp_path / 'de-en'}",
                    "--runs-dir", str(runs_dir), "--rows", "B2T + warmup", "--print-commands"])
    out = capsys.readouterr().out
    assert f"run folder: {runs_dir / 'beyond.cpu_short' / 'de-en' / 'b2t-warmup'}" in out
    train = next(line for line in out.splitlines() if line.startswith("  train: "))
    test = next(line for line in out.splitlines() if line.startswith("  test: "))
    assert "--arch transformer_normplug_mini" in train and "--max-update 600" in train
    assert "--stop-patience" not in train and "--norm-placement b2t" in train
    assert '--eval-bleu-args \'{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}\'' in train
    assert "--beam 1 --max-len-a 1.2 --max-len-b 10" in test and "--gnmt" not in test
    with pytest.raises(SystemExit) as error:
        reproduce.main(["beyond", "de-en", "--recipe", "cpu_shrot", "--print-commands"])
    assert str(error.value).startswith("reproduce.sh: error: unknown recipe 'cpu_shrot'; choose from ted, ")
    assert "\n" not in str(error.value)


def test_print_commands_shows_the_slurm_submission(fake_data, tmp_path, capsys):
    reproduce.main(["demo", "--data", f"src-tgt={fake_data}", "--runs-dir", str(tmp_path / "runs"),
                    "--rows", "PreNorm + DyT", "--launcher", "slurm", "--partition", "gpu", "--time-limit", "600",
                    "--devices-per-run", "2", "--cpus-per-run", "8", "--mem", "64G", "--account", "nmt",
                    "--sbatch", "qos=high", "--print-commands"])
    out = capsys.readouterr().out
    assert ("sbatch --time=600 --nodes=1 --ntasks-per-node=1 --gpus-per-node=2 --cpus-per-task=8 --partition=gpu "
            "--mem=64G --account=nmt --qos=high") in out
    assert out.count("fairseq-train ") == 1 and "devices: 2 GPUs (a SLURM job's), 8 threads" in out
    assert "1000 tokens per update (--max-tokens 500 x 2 devices x --update-freq 1)" in out
    assert not (tmp_path / "runs").exists()


def test_the_slurm_options_become_the_jobs_sbatch_options(tmp_path, monkeypatch):
    """submitit's own sbatch file for the options (a stand-in srun: submitit looks for one)."""
    import submitit

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    launcher = SlurmLauncher(folder=str(tmp_path / "jobs"), partition="gpu", time_limit_min=600, gpus_per_run=2,
                             cpus_per_run=8, mem="64G", account="nmt", jobs=3,
                             sbatch=launchers.parse_sbatch(["qos=high", "exclusive"]))
    executor = submitit.AutoExecutor(folder=str(tmp_path / "jobs"), cluster="slurm", slurm_max_num_timeout=10)
    executor.update_parameters(**launcher.parameters())
    sbatch = executor._executor._make_submission_file_text("python -m job", "uid")
    for line in ("--partition=gpu", "--time=600", "--gpus-per-node=2", "--cpus-per-task=8", "--mem=64G",
                 "--account=nmt", "--qos=high", "--exclusive", "--nodes=1", "--ntasks-per-node=1", "--signal=USR2@90"):
        assert f"#SBATCH {line}\n" in sbatch
    assert executor._executor.max_num_timeout == 10
    with pytest.raises(NormplugError, match="--sbatch takes KEY=VALUE or KEY"):
        launchers.parse_sbatch(["qos="])


def test_slurm_without_submitit_is_a_one_line_error(fake_data, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "submitit" else real_import(name, *a, **k))
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["demo", "--data", f"src-tgt={fake_data}", "--runs-dir", str(tmp_path), "--launcher", "slurm"])
    assert str(exit_info.value.code) == f"reproduce.sh: error: {launchers.SUBMITIT_MISSING}"
    assert "pip install .[slurm]" in launchers.SUBMITIT_MISSING


def test_status_shows_state_last_update_best_dev_bleu_and_elapsed_time(fake_data, tmp_path, capsys, cpu_machine):
    runs = demo_runs(fake_data, str(tmp_path / "runs"))
    os.makedirs(runs[0].run_dir)
    runs[0].set_status(status="done", minutes=3.25, updates=300)
    with open(runs[0].path("scores.json"), "w") as f:
        json.dump({"tokenized_bleu": 20.0}, f)
    os.makedirs(runs[1].run_dir)
    with open(runs[1].path("train.log"), "w") as f:
        for update, bleu in ((100, "11.5"), (200, "17.25"), (300, "16")):
            f.write(f'2026-01-01 10:00:00 | INFO | train_inner | {{"epoch": "1", "num_updates": "{update - 10}"}}\n')
            f.write(f'2026-01-01 10:00:01 | INFO | valid | {{"epoch": "1", "valid_bleu": "{bleu}", '
                    f'"valid_num_updates": "{update}"}}\n')
        f.write('2026-01-01 10:00:02 | INFO | train_inner | {"epoch": "1", "num_updates": "310"}\n')
    runs[1].set_status(status="running", minutes=1.0)
    os.utime(runs[1].path("status.json"), (time.time() - 120, time.time() - 120))
    reproduce.main(["demo", "--data", f"src-tgt={fake_data}", "--runs-dir", str(tmp_path / "runs"), "--status"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["run", "state", "last", "update", "best", "dev", "BLEU", "elapsed"]
    first, second, third = (line.split("  ") for line in lines[1:4])
    assert [c.strip() for c in first if c.strip()][1:] == ["tested", "-", "-", "3.2 min"]
    assert [c.strip() for c in second if c.strip()][1:] == ["running", "310", "17.25", "3.0 min"]
    assert [c.strip() for c in third if c.strip()][1:] == ["pending", "-", "-", "-"]
    assert lines[-1].startswith("[status] 3 runs: 1 tested, 1 running, 1 pending")


def test_collect_writes_the_table_from_what_has_finished(fake_data, tmp_path, capsys, cpu_machine):
    results = tmp_path / "results"
    reproduce.main(["demo", "--data", f"src-tgt={fake_data}", "--runs-dir", str(tmp_path / "runs"),
                    "--results-dir", str(results), "--collect"])
    assert "collected 0 of 3 runs with a result" in capsys.readouterr().out
    with open(results / "results.csv", encoding="utf-8") as f:  # not started yet: not failed
        assert [row["status"] for row in csv.DictReader(f)] == ["pending", "pending", "pending"]
    assert "| PostNorm + LayerNorm + warmup | *pending* |" in (results / "results.md").read_text(encoding="utf-8")


def test_demo_trains_every_seed_with_the_jobs_asked_for(fake_data, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "prepare", lambda raw, src, tgt, dest, *rest: fake_data)
    monkeypatch.setattr(demo, "corpus_folder", lambda *args: "corpus-00000000")
    monkeypatch.setattr(demo, "run_table", lambda *args, **kw: calls.append(kw) or reproduce.TableResults([], [], []))
    demo.main(["--corpus", str(tmp_path), "--src", "src", "--tgt", "tgt", "--out", str(tmp_path / "out"),
               "--seeds", "1", "2", "3", "--jobs", "2"])
    assert list(calls[0]["seeds"]) == [1, 2, 3] and calls[0]["launcher"].jobs == 2
    with pytest.raises(SystemExit):  # a repeated seed is refused before anything runs
        demo.main(["--seeds", "1", "1"])
    assert len(calls) == 1
