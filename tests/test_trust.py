"""A table you can trust (issue 37): one owner per run, a table written whatever its runs did,
divergence as a result, and configs checked before any work. Fault tests on tiny tables of the
synthetic corpus: two launchers at once and staggered, an owner SIGKILLed and its run taken
over, a disk full during a checkpoint save, a read-only results folder, a corrupt scores.json,
a diverging row and an undecodable test sentence; in each, nothing finished is lost and a
re-run repairs what it can."""
import csv
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, write_configs
import fault_hooks
from inprocess import ForkedLauncher, forked_commands, run_fairseq
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import launchers, ownership, preflight, reproduce, runner
from fairseq_normplug.experiments.configs import CONFIG_DIR, load_table
from fairseq_normplug.experiments.launchers import LocalLauncher

#: 10 updates, dev BLEU and a save at 5 and 10, greedy decoding
RECIPE = {"base": "cpu_tiny", "decoding": {"beam": 1}, "generate": {"--max-tokens": "4000"},
          "train": {"--max-update": "10", "--validate-interval-updates": "5", "--log-interval": "5",
                    "--norm-stats-interval": "5"}}
TWO_ROWS = {"title": "Two tiny rows", "recipe": "trust_tiny", "pairs": ["src-tgt"], "rows": [
    {"name": "PreNorm", "model": ["--prenorm"], "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
    {"name": "PreNorm + ScaleNorm", "model": ["--prenorm", "--scalenorm"], "schedule": "no_warmup",
     "baseline": "PreNorm", "train": ["--lr", "3e-3"]}]}
#: a good row, a row whose model has fewer source positions than the longest test sentence
#: (its test decoding fails), and PostNorm at lr 1 without warmup (it diverges)
#: a mistyped flag, and a model with fewer source positions than the longest dev sentence
PREFLIGHT_BAD = {"title": "Two mistakes", "recipe": "trust_tiny", "pairs": ["src-tgt"], "rows": [
    {"name": "PreNorm", "model": ["--prenrom"], "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
    {"name": "PreNorm 8 positions", "model": ["--prenorm", "--max-source-positions", "8"], "schedule": "no_warmup",
     "train": ["--lr", "3e-3"]}]}
FAULTS = {"title": "A good, an undecodable and a diverging row", "recipe": "trust_tiny", "pairs": ["src-tgt"],
          "rows": [{"name": "PreNorm", "model": ["--prenorm"], "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
                   {"name": "PreNorm 40 positions", "model": ["--prenorm", "--max-source-positions", "40"],
                    "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
                   {"name": "PostNorm lr 1", "model": [], "schedule": "no_warmup", "train": ["--lr", "1"]}]}
RUNS = ("trust", "src-tgt")

#: one launcher (:func:`launcher_main`, reproduce.sh's run_table on a config folder), as its own
#: process; its fairseq commands are forks of it (tests/inprocess.py's forked_commands: the
#: runner's real command starts are the subject of test_launchers' --jobs 2 and submitit tests
#: and test_entry_points')
LAUNCHER = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {os.path.join(REPO, "tests")!r})
    from inprocess import forked_commands
    from test_trust import launcher_main
    with forked_commands():
        sys.exit(launcher_main(sys.argv[1:]))
""")

@pytest.fixture(scope="module")
def trust(tiny_raw, tiny_bin, tmp_path_factory):
    """Config folder (the tables above), a prepared data folder on the tiny corpus, and one
    whose test set has a sentence of 60 tokens (more than 40 positions); the launcher script."""
    root = tmp_path_factory.mktemp("trust")
    configs = write_configs(root / "configs", {"trust_tiny": RECIPE},
                            {"trust": TWO_ROWS, "faults": FAULTS, "mistakes": PREFLIGHT_BAD})
    data = root / "data"
    (data / "ref").mkdir(parents=True)
    os.symlink(tiny_bin, data / "bin")
    shutil.copy(os.path.join(tiny_raw, "test.tgt"), data / "ref" / "test.tok.tgt")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    (root / "launcher.py").write_text(LAUNCHER)
    return root, configs, str(data)


@pytest.fixture(scope="module")
def long_test_sentence(trust, tiny_raw, tmp_path_factory):
    """The tiny corpus with one more test sentence of 60 tokens."""
    root, _, _ = trust
    raw = tmp_path_factory.mktemp("long-raw")
    for split in ("train", "valid", "test"):
        for lang in ("src", "tgt"):
            shutil.copy(os.path.join(tiny_raw, f"{split}.{lang}"), raw / f"{split}.{lang}")
    words = open(os.path.join(tiny_raw, "test.src")).read().split()[:60]
    for lang in ("src", "tgt"):
        with open(raw / f"test.{lang}", "a") as f:
            f.write(" ".join(words) + "\n")
    data = root / "long-data"
    run_fairseq(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                 f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir",
                 str(data / "bin"), "--joined-dictionary", "--workers", "1"])
    (data / "ref").mkdir()
    shutil.copy(raw / "test.tgt", data / "ref" / "test.tok.tgt")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return str(data)


def table_csv(out, results="results") -> list:
    """results.csv without the wall times (the one field two identical tables differ in)."""
    with open(os.path.join(out, results, "results.csv"), encoding="utf-8") as f:
        return [{k: v for k, v in row.items() if k != "minutes"} for row in csv.DictReader(f)]


def run_dir(out, slug):
    return os.path.join(out, "runs", *RUNS, slug)


def uninterrupted_table(trust, rows=()) -> list:
    """The two-row table (or its ``rows``), uninterrupted, by one launcher in this process into
    ``reference``/runs, its fairseq commands in forked children (tests/inprocess.py's
    forked_commands): its results.csv (:func:`table_csv`)."""
    root, configs, data = trust
    out = root / "reference"
    with forked_commands():
        results = reproduce.run_table(load_table("trust", configs), ["src-tgt"], {"src-tgt": data},
                                      str(out / "runs"), str(out / "results"), list(rows), echo=lambda m: None)
    assert [r["status"] for r in results] == ["ok"] * len(rows or TWO_ROWS["rows"]) and not results.failed
    return table_csv(out)


@pytest.fixture(scope="module")
def reference(trust):
    """The two-row table, uninterrupted (:func:`uninterrupted_table`); the launchers of the tests
    below (two real processes, the others forked launchers) must give the same table."""
    return uninterrupted_table(trust)


def start_launcher(trust, out, name, rows=(), real=False, env=(), at_start=None):
    """A launcher of the two-row table (or of its ``rows``) on the runs folder ``out``/runs; its
    results go to ``out``/``name``-results, its output to ``name``.log; in a session of its own.
    It is a forked child of this process (tests/inprocess.py's ForkedLauncher: launcher.py's
    work, its fairseq commands forked from it, each calling ``at_start`` first), or with ``real``
    launcher.py in a new Python, its fairseq commands forks of that process. ``env``: more variables."""
    root, configs, data = trust
    log = open(root / f"{name}.log", "w")
    argv = [configs, "trust", data, str(root / out / "runs"), str(root / out / f"{name}-results"), *rows]
    options = dict(stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "NORMPLUG_HELD_POLL": "0.3", **dict(env)})
    if real:
        return subprocess.Popen([sys.executable, str(root / "launcher.py"), *argv], **options)
    return ForkedLauncher(lambda: launcher_main(argv), args=[str(root / "launcher.py"), *argv], at_start=at_start,
                          **options)


def start_paused_launcher(trust, out, name, pause_at, rows=("PreNorm",)):
    """A launcher (forked, :func:`start_launcher`) of ``rows`` (the PreNorm row; () for both) on
    ``out``/runs, its first fairseq process to reach ``pause_at`` held there (tests/fault_hooks.py's
    pause, installed in its forked fairseq commands); the file its held process writes its pid to."""
    paused = trust[0] / f"{name}.paused"
    proc = start_launcher(trust, out, name, rows=list(rows), at_start=fault_hooks.install,
                          env={"NORMPLUG_TEST_PAUSE_AT": pause_at, "NORMPLUG_TEST_PAUSED": str(paused)})
    return proc, paused


def held_pid(proc, paused) -> int:
    """The pid of the launcher's held fairseq process, once it is held there."""
    wait_for(lambda: paused.exists() or proc.poll() is not None, timeout=300)
    assert paused.exists(), f"the launcher ended (exit {proc.poll()}) before its process was held"
    return int(paused.read_text())


def launcher_main(argv) -> int:
    """A launcher's work (:data:`LAUNCHER`'s, and a ForkedLauncher's) on its command line
    ``argv``: its exit status."""
    configs, table, data, runs, results, *rows = argv
    results = reproduce.run_table(load_table(table, configs), ["src-tgt"], {"src-tgt": data}, runs, results, rows)
    return 1 if results.failed else 0


def launcher_here(trust, out, name, rows=()) -> int:
    """What ``finish(start_launcher(trust, out, name, rows))`` does, by a launcher in this process
    whose fairseq commands are forked (tests/inprocess.py's forked_commands): for a re-run whose
    subject is what the runner does with the runs another launcher left, not its own process.
    Its console lines go to ``name``.log; returns its exit status."""
    root, configs, data = trust
    lines = []
    with forked_commands():
        results = reproduce.run_table(load_table("trust", configs), ["src-tgt"], {"src-tgt": data},
                                      str(root / out / "runs"), str(root / out / f"{name}-results"), list(rows),
                                      echo=lines.append)
    (root / f"{name}.log").write_text("".join(line + "\n" for line in lines))
    return 1 if results.failed else 0


def finish(proc, timeout=300):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def wait_for(condition, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)


def trainings(log_text: str, label: str) -> int:
    return log_text.count(f"[{label}] training (")


def assert_trained_once_by_two(root, out, names, reference):
    """Every run trained once in all, a launcher named the other as holder, both tables the reference's."""
    logs = {name: (root / f"{name}.log").read_text() for name in names}
    for row in ("PreNorm", "PreNorm + ScaleNorm"):
        label = f"trust src-tgt | {row}"
        assert sum(trainings(log, label) for log in logs.values()) == 1, logs
        assert not any(f"[{label}] training (resuming)" in log for log in logs.values())
    assert any(f"held by host {socket.gethostname()} pid " in log for log in logs.values()), logs
    for name in names:
        assert table_csv(root / out, f"{name}-results") == reference, logs[name]
    assert not any(os.path.exists(os.path.join(run_dir(root / out, slug), ownership.LOCK_NAME))
                   for slug in ("prenorm", "prenorm-scalenorm"))


@pytest.mark.slow
def test_two_launchers_started_at_once_train_each_run_once(trust, reference):
    """Two real launcher processes (launcher.py in a new Python each, their fairseq commands
    forked from them) on one runs folder: the one test of two launcher processes started from
    the command line; the others fork theirs from this process."""
    procs = [start_launcher(trust, "once", name, real=True) for name in ("once-a", "once-b")]
    assert [finish(proc) for proc in procs] == [0, 0]
    assert_trained_once_by_two(trust[0], "once", ("once-a", "once-b"), reference)


@pytest.mark.slow
def test_a_second_launcher_started_while_the_first_trains_waits_for_it(trust, reference):
    """Staggered: the second starts when the first run has its first checkpoint (where it used
    to load that checkpoint and train beside the first); it trains the other run, then waits.
    The first's fairseq-train is held after update 6, past that checkpoint, until the second has
    found the run held (tests/fault_hooks.py's pause and release): however slow the machine, the
    first cannot finish its run before the second starts."""
    root = trust[0]
    first, paused = start_paused_launcher(trust, "staggered", "staggered-a", "update:6", rows=())
    held_pid(first, paused)
    assert os.path.exists(os.path.join(run_dir(root / "staggered", "prenorm"), "checkpoints", "checkpoint_last.pt"))
    second = start_launcher(trust, "staggered", "staggered-b")
    second_log = root / "staggered-b.log"
    wait_for(lambda: "held by" in second_log.read_text() or second.poll() is not None, timeout=300)
    fault_hooks.release(paused)
    assert finish(first) == 0 and finish(second) == 0
    assert_trained_once_by_two(root, "staggered", ("staggered-a", "staggered-b"), reference)
    assert "[trust src-tgt | PreNorm] held by host" in second_log.read_text()


@pytest.mark.slow
def test_a_killed_owners_run_is_taken_over_and_ends_as_if_uninterrupted(trust, reference):
    root = trust[0]
    # held after update 6, past the save of update 5, so that the kill comes mid-training however
    # slow the machine (polling for the checkpoint instead let a loaded machine finish the run first)
    killed, paused = start_paused_launcher(trust, "takeover", "killed", "update:6")
    held_pid(killed, paused)
    folder = run_dir(root / "takeover", "prenorm")
    assert runner.checkpoint_safety.read_checkpoint(os.path.join(folder, "checkpoints", "checkpoint_last.pt"))
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    holder = ownership.read_holder(os.path.join(folder, ownership.LOCK_NAME))
    assert holder is not None and holder.host == socket.gethostname()
    wait_for(lambda: not ownership.pid_alive(holder.pid))
    assert launcher_here(trust, "takeover", "taker", rows=["PreNorm"]) == 0
    log = (root / "taker.log").read_text()
    assert f"took the run over from host {holder.host} pid {holder.pid}" in log and "its process is gone" in log
    assert "[trust src-tgt | PreNorm] training (resuming)" in log
    assert table_csv(root / "takeover", "taker-results") == reference[:1]


@pytest.fixture
def runner_commands_forked():
    """The runner's fairseq commands in forked children of this process, for a test whose
    subject is the runner's logic (tests/inprocess.py's forked_commands)."""
    with forked_commands():
        yield


@pytest.fixture
def main_of(trust, monkeypatch, capsys):
    """``main(table, *args)``: reproduce.sh of a table of the config folder on the tiny corpus;
    (exit code, stdout lines)."""
    root, configs, data = trust
    monkeypatch.setattr(reproduce, "load_table", lambda name: load_table(name, configs))

    def main(table, out, *args, data_dir=data):
        argv = [table, "--data", f"src-tgt={data_dir}", "--runs-dir", str(root / out / "runs"),
                "--results-dir", str(root / out / "results"), *args]
        try:
            reproduce.main(argv)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        return code, capsys.readouterr().out.strip().splitlines()
    return main


@pytest.mark.slow
def test_a_diverging_row_and_an_undecodable_test_sentence(trust, long_test_sentence, main_of,
                                                          runner_commands_forked):
    """PostNorm at lr 1 without warmup ends as diverged at its first validation, with the dev
    loss against a uniform guess; a row whose model cannot take the longest test sentence is
    failed, named with its cause and log; the table is written with the good row; exit 1. The
    re-run trains nothing again."""
    root = trust[0]
    code, lines = main_of("faults", "faults", data_dir=long_test_sentence)
    assert code == 1
    with open(root / "faults" / "results" / "results.csv", encoding="utf-8") as f:
        rows = {row["row"]: row for row in csv.DictReader(f)}
    assert rows["PreNorm"]["status"] == "ok" and float(rows["PreNorm"]["tokenized_bleu"]) >= 0
    assert rows["PreNorm 40 positions"]["status"] == "failed" and rows["PreNorm 40 positions"]["tokenized_bleu"] == ""
    assert rows["PostNorm lr 1"]["status"] == "diverged" and rows["PostNorm lr 1"]["updates"] == "5"
    markdown = (root / "faults" / "results" / "results.md").read_text()
    assert "| PostNorm lr 1 | *diverged* |" in markdown and "| PreNorm 40 positions | *failed* |" in markdown
    folder = root / "faults" / "runs" / "faults" / "src-tgt"
    status = json.loads((folder / "postnorm-lr-1" / "status.json").read_text())
    uniform = math.log2(runner.target_vocabulary_size(long_test_sentence, "tgt"))
    loss = float(status["diverged"].split("dev loss ")[1].split()[0])
    assert loss > 2 * uniform and rows["PostNorm lr 1"]["stopped_by"] == status["diverged"]
    assert status["diverged"] == (f"dev loss {loss:g} bits per token at update 5, over 2 times a uniform guess over "
                                  f"the target vocabulary ({uniform:.2f} bits)")
    assert lines[-2] == "[reproduce] 1 run(s) FAILED:"
    assert lines[-1].startswith("[reproduce] FAILED faults src-tgt | PreNorm 40 positions: trained, not evaluated: "
                                "fairseq-generate failed for faults src-tgt | PreNorm 40 positions: ")
    assert "is invalid" in lines[-1] and lines[-1].endswith(f"log: {folder / 'prenorm-40-positions' / 'train.log'}")
    assert not list(folder.glob("*/generate-test.txt.tmp-*"))
    code, lines = main_of("faults", "faults", "--rows", "PostNorm lr 1", data_dir=long_test_sentence)
    assert code == 0 and "[faults src-tgt | PostNorm lr 1] diverged: skipped" in lines  # a result: exit 0
    assert not any("training (" in line for line in lines)


def copy_reference_runs(root, out):
    shutil.copytree(root / "reference" / "runs", root / out / "runs")
    return root / out / "runs" / "trust" / "src-tgt"


@pytest.mark.slow
def test_a_disk_full_during_a_checkpoint_save_fails_the_run_and_the_rerun_resumes(trust, reference, main_of,
                                                                                   monkeypatch):
    """The last save (update 10) hits a full disk: the run is failed with the cause, the table
    is written, exit 1; the re-run drops the half-written file, resumes from update 5 and ends
    with the uninterrupted run's numbers."""
    root = trust[0]
    monkeypatch.setenv("NORMPLUG_TEST_ENOSPC_AT", "10")
    with forked_commands(at_start=fault_hooks.install):  # the fault in its forked fairseq-train
        code, lines = main_of("trust", "full", "--rows", "PreNorm")
    assert code == 1
    folder = root / "full" / "runs" / "trust" / "src-tgt" / "prenorm"
    status = json.loads((folder / "status.json").read_text())
    assert status["status"] == "failed" and "No space left on device" in status["error"]
    assert lines[-1].startswith("[reproduce] FAILED trust src-tgt | PreNorm: training failed (exit 1): ")
    assert "(ENOSPC: the disk is full)" in lines[-1]  # issue 50: the summary names it
    assert not list(folder.glob("*status.json*tmp*"))  # no 0-byte status.json temporary
    assert table_csv(root / "full")[0]["status"] == "failed"
    assert list((folder / "checkpoints").glob("*.tmp"))  # the cut save
    monkeypatch.delenv("NORMPLUG_TEST_ENOSPC_AT")
    with forked_commands(at_start=fault_hooks.install):
        code, lines = main_of("trust", "full", "--rows", "PreNorm")
    assert code == 0 and any("removed" in line and ".tmp" in line for line in lines)
    assert any(line.endswith("PreNorm] training (resuming); log: " + str(folder / "train.log")) for line in lines)
    assert table_csv(root / "full") == reference[:1]
    assert not list((folder / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_a_read_only_results_folder_is_found_before_training_and_after_it(trust, reference, main_of, monkeypatch):
    """Before anything trains: one line naming the folder, no run folder. Read-only only once
    the runs are done: one line, the runs stay done and scored, nothing half-written is left."""
    root = trust[0]
    (root / "read-only" / "results").mkdir(parents=True)
    real = preflight.tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):
        if dir == str(root / "read-only" / "results"):
            raise OSError(30, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(preflight.tempfile, "TemporaryFile", read_only)
    code, lines = main_of("trust", "read-only")
    assert code == (f"reproduce.sh: error: the results folder {root / 'read-only' / 'results'} is not writable "
                    f"(Read-only file system); nothing was run")
    assert not (root / "read-only" / "runs").exists()
    folder = copy_reference_runs(root, "read-only-late")

    def write_fails(path, text):
        raise OSError(30, "Read-only file system", path)

    monkeypatch.setattr(reproduce.tables, "write_text_atomic", write_fails)
    code, lines = main_of("trust", "read-only-late")
    assert code == (f"reproduce.sh: error: cannot write the results table to {root / 'read-only-late' / 'results'}: "
                    f"Read-only file system; the runs are kept: fix it and run --collect")
    for slug in ("prenorm", "prenorm-scalenorm"):
        assert json.loads((folder / slug / "status.json").read_text())["status"] == "done"
        assert runner.read_scores(str(folder / slug / "scores.json")) is not None
    assert not list((root / "read-only-late").glob("results/*"))


@pytest.mark.slow
def test_a_corrupt_scores_json_is_a_failed_run_until_the_rerun_scores_it_again(trust, reference, main_of,
                                                                               runner_commands_forked):
    root = trust[0]
    folder = copy_reference_runs(root, "corrupt")
    (folder / "prenorm" / "scores.json").write_text('{"tokenized_bleu": 1')  # cut short
    (folder / "prenorm-scalenorm" / "scores.json").write_text("{}")
    code, lines = main_of("trust", "corrupt", "--collect")
    assert code == 0 and lines[-1] == "[reproduce] collected 0 of 2 runs with a result"
    assert [row["status"] for row in table_csv(root / "corrupt")] == ["failed", "failed"]
    code, lines = main_of("trust", "corrupt")
    assert code == 0 and sum("translating the test set" in line for line in lines) == 2
    assert not any("training (" in line for line in lines)
    assert table_csv(root / "corrupt") == reference


@pytest.mark.slow
def test_a_bad_status_or_scores_field_is_failed_until_the_rerun_repairs_it(trust, reference, main_of,
                                                                          runner_commands_forked):
    """Issue 50: ``"minutes": "x"`` in a status.json, ``"sacrebleu": "x"`` in a scores.json:
    --collect names both files, fails both runs and writes the table; the re-run trains nothing,
    records the first run done from its checkpoints, decodes the second again, and writes the
    uninterrupted table."""
    root = trust[0]
    folder = copy_reference_runs(root, "bad-records")
    status = json.loads((folder / "prenorm" / "status.json").read_text())
    (folder / "prenorm" / "status.json").write_text(json.dumps({**status, "minutes": "x"}))
    scores = json.loads((folder / "prenorm-scalenorm" / "scores.json").read_text())
    (folder / "prenorm-scalenorm" / "scores.json").write_text(json.dumps({**scores, "sacrebleu": "x"}))
    code, lines = main_of("trust", "bad-records", "--collect")
    assert code == 0 and lines[-1] == "[reproduce] collected 0 of 2 runs with a result"
    assert sum(str(folder / "prenorm" / "status.json") in line for line in lines) >= 1
    assert [row["status"] for row in table_csv(root / "bad-records")] == ["failed", "failed"]
    code, lines = main_of("trust", "bad-records")
    assert code == 0 and sum("translating the test set" in line for line in lines) == 1
    assert not any("training (" in line for line in lines)
    assert table_csv(root / "bad-records") == reference


# --------------------------------------------------------------------------- checked before any work


@pytest.fixture
def configs_copy(tmp_path):
    dest = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, dest)
    return dest


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("file,text,message", [
    ("recipes.json", lambda t: t.replace('"gnmt_alpha": 0.6', '"gnmt_alpha": NaN', 1),
     "recipes.json: invalid JSON (NaN is not a number JSON allows here (numbers must be finite)"),
    ("recipes.json", lambda t: t.replace('"max_len_a": 1', '"max_len_a": 1e999', 1),
     "recipes.json: invalid JSON (1e999 is not finite"),
    ("schedules.json", lambda t: "[" + t + "]", "schedules.json: expected a JSON object {...}, got list"),
    ("schedules.json", lambda t: t.replace('"warmup": 8000', '"warmup": -1', 1), "'warmup' must be an integer >= 0"),
    ("experiments/table3.json", lambda t: t.replace('"rows": [', '"rows": [{"name": "PreNorm: FixNorm, ScaleNorm", '
                                                    '"model": [], "schedule": "no_warmup"}, ', 1),
     "rows 'PreNorm: FixNorm, ScaleNorm' and 'PreNorm + FixNorm + ScaleNorm' map to one run folder "
     "('prenorm-fixnorm-scalenorm'); rename one"),
    ("experiments/table3.json", lambda t: t.replace('"gl-en"', '"../gl-en"', 1), "bad language pair '../gl-en'"),
    ("experiments/table3.json", lambda t: t.replace('"gl-en"', '"gl/en"', 1), "bad language pair 'gl/en'"),
])
def test_a_bad_config_is_one_line_naming_the_file(configs_copy, file, text, message):
    path = configs_copy / file
    path.write_text(text(path.read_text()))
    with pytest.raises(NormplugError) as error:
        load_table("table3", str(configs_copy))
    assert message in str(error.value) and os.path.basename(file) in str(error.value)
    assert "\n" not in str(error.value)


def test_a_decoding_number_out_of_range_and_a_file_not_utf8_are_refused(configs_copy):
    edit_json(configs_copy / "recipes.json", lambda d: d["ted"]["decoding"].update(max_len_a=-1))
    with pytest.raises(NormplugError, match="recipe 'ted': 'decoding' max_len_a must be a number >= 0, got -1"):
        load_table("table3", str(configs_copy))
    (configs_copy / "experiments" / "table3.json").write_bytes(b'{"title": "caf\xe9"}')
    with pytest.raises(NormplugError, match=r"table3.json: not UTF-8 text \(invalid continuation byte at byte 14\)"):
        load_table("table3", str(configs_copy))


def test_names_and_flags_are_refused_before_any_work(tmp_path, capsys):
    """A pair name with '/' on the command line, --lr under a schedule that ignores it, an
    unbalanced quote: one line each, nothing created; a quoted value stays one flag value."""
    runs = tmp_path / "runs"
    for argv, message in (
            (["table3", "gl/en"], "reproduce.sh: error: bad language pair 'gl/en'; write it as SRC-TGT, "
                                  "e.g. gl-en (language codes of 2-3 lower-case letters)"),
            (["table3", "gl-en", "--data", "../x=y"], "reproduce.sh: error: --data: bad language pair '../x'; write "
                                                      "it as SRC-TGT, e.g. gl-en (language codes of 2-3 lower-case "
                                                      "letters)"),
            (["table3", "gl-en", "--train-flags", "--lr 3e-3"],
             "reproduce.sh: error: table3 row 'PostNorm + LayerNorm': --lr 3e-3 is ignored by --lr-scheduler "
             "inv_sqrt_decay (its peak lr is eq. 7's, set by --lr-lambda); give --lr-lambda instead"),
            (["table3", "gl-en", "--train-flags", "--adam-betas '(0.9, 0.999)"],
             "reproduce.sh: error: --train-flags \"--adam-betas '(0.9, 0.999)\": No closing quotation (it is split like a shell command line)")):
        with pytest.raises(SystemExit) as exit_info:
            reproduce.main([*argv, "--runs-dir", str(runs), "--print-commands"])
        assert exit_info.value.code == message
    assert not runs.exists()
    reproduce.main(["table3", "gl-en", "--rows", "PreNorm + FixNorm + ScaleNorm", "--runs-dir", str(runs),
                    "--train-flags", "--adam-betas '(0.9, 0.98)'", "--print-commands"])
    assert "--adam-betas '(0.9, 0.98)' --save-interval-updates" in capsys.readouterr().out


# --------------------------------------------------------------------------- the lock's rules


def write_lock(folder, host, pid, heartbeat_age=0.0, slurm_job=None):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ownership.LOCK_NAME)
    with open(path + ".new", "w") as f:
        json.dump({"host": host, "pid": pid, "slurm_job": slurm_job, "token": "other", "created": 0.0}, f)
    beat = time.time() - heartbeat_age
    os.utime(path + ".new", (beat, beat))
    os.replace(path + ".new", path)  # a taker's new file, never the old one rewritten


def test_a_live_owner_keeps_its_run_and_a_dead_one_loses_it(tmp_path, monkeypatch):
    folder = str(tmp_path / "run")
    here = socket.gethostname()
    write_lock(folder, "node-7", 1234, heartbeat_age=60)  # another node, beating: held
    holder = ownership.RunOwnership(folder).acquire()
    assert holder.host == "node-7" and holder.describe().startswith("host node-7 pid 1234 (heartbeat 60 s ago)")
    with pytest.raises(NormplugError, match=r"^table3 gl-en \| PreNorm is held by host node-7 pid 1234 "):
        with ownership.owned(folder, "table3 gl-en | PreNorm"):  # scripts/train.sh
            pass
    write_lock(folder, "node-7", 1234, heartbeat_age=ownership.STALE_AFTER_S + 5)  # no heartbeat: taken
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None and owner.took_over[1].startswith("no heartbeat for ")
    assert ownership.read_holder(os.path.join(folder, ownership.LOCK_NAME)).pid == os.getpid()
    assert ownership.RunOwnership(folder).acquire().pid == os.getpid()  # another launcher here: held
    owner.release()
    assert not os.path.exists(os.path.join(folder, ownership.LOCK_NAME))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lock(folder, here, int(dead.stdout))  # this host, its process gone: taken at once
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None and owner.took_over[1] == "its process is gone"
    owner.release()
    # a requeued SLURM job (its id on another node's lock) takes its own run back at once
    write_lock(folder, "node-7", 1234, slurm_job="991_3")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "991")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None and owner.took_over[1] == "a requeued SLURM job takes its own run back"
    owner.release()
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")  # another task of the array: held
    write_lock(folder, "node-7", 1234, slurm_job="991_3")
    assert ownership.RunOwnership(folder).acquire().slurm_job == "991_3"


def test_the_heartbeat_is_rewritten_and_a_taken_over_lock_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(ownership, "HEARTBEAT_S", 0.05)
    folder = str(tmp_path / "run")
    os.makedirs(folder)
    owner = ownership.RunOwnership(folder)
    assert owner.acquire() is None
    path = os.path.join(folder, ownership.LOCK_NAME)
    first = ownership.read_holder(path).heartbeat
    wait_for(lambda: ownership.read_holder(path).heartbeat > first, timeout=10)
    # taken over meanwhile (this owner looked dead), and a late beat comes in the window between
    # its check and its touch: it touches only the file it created, never the taker's
    monkeypatch.setattr(owner, "_still_mine", lambda: True)
    write_lock(folder, "node-7", 1234, heartbeat_age=60)
    time.sleep(0.3)
    holder = ownership.read_holder(path)
    assert (holder.host, holder.token) == ("node-7", "other") and time.time() - holder.heartbeat > 59
    monkeypatch.undo()
    owner.release()
    assert ownership.read_holder(path).host == "node-7"


def test_a_run_held_elsewhere_waits_and_is_executed_once_it_is_released(tmp_path):
    """The launcher executes the other runs first, comes back to the held one, and executes
    it once its owner has released it; the held run's owner is named once."""
    calls, messages = [], []
    held_until = time.time() + 0.5

    def fake_execute(run, extra, echo):
        calls.append(run.row.name)
        if run.row.name == "PreNorm" and time.time() < held_until:
            return {"status": "running", "held_by": "host node-7 pid 1234"}
        return {"status": "done"}

    table = load_table("demo")
    runs = [runner.Run(table=table, row=row, pair="src-tgt", data_dir=str(tmp_path), run_dir=str(tmp_path / row.name))
            for row in (table.rows[0], dataclasses.replace(table.rows[0], name="PreNorm"))]
    launcher = LocalLauncher(visible_devices=[], execute=fake_execute)
    launchers_poll = launchers.HELD_POLL_S
    try:
        launchers.HELD_POLL_S = 0.1
        launcher.execute(runs, [], messages.append)
    finally:
        launchers.HELD_POLL_S = launchers_poll
    assert calls[:2] == [runs[0].row.name, "PreNorm"] and calls[-1] == "PreNorm" and len(calls) >= 3
    assert sum("held by host node-7 pid 1234" in m for m in messages) == 1


# --------------------------------------------------------------------------- --preflight


def over_8_positions(path):
    """(count, index and length of the longest) of the sentences over 8 tokens with </s>."""
    lengths = [len(line.split()) + 1 for line in open(path, encoding="utf-8")]
    longest = lengths.index(max(lengths))
    return sum(length > 8 for length in lengths), longest, lengths[longest]


def test_preflight_names_a_mistyped_flag_and_a_dev_sentence_over_the_positions(trust, tiny_raw, main_of):
    root = trust[0]
    (dev, dev_longest, dev_length), (test, _, _) = (over_8_positions(os.path.join(tiny_raw, f"{split}.src"))
                                                    for split in ("valid", "test"))
    code, lines = main_of("mistakes", "mistakes", "--preflight")
    assert code == "reproduce.sh: preflight: 3 problem(s), listed above; nothing was run"
    problems = [line for line in lines if line.startswith("[preflight] PROBLEM: ")]
    assert problems[0] == ("[preflight] PROBLEM: mistakes src-tgt | PreNorm: the flags do not parse: fairseq-train: "
                           "error: unrecognized arguments: --prenrom (--prenrom: did you mean --prenorm?)")
    assert problems[1] == (f"[preflight] PROBLEM: src-tgt: {dev} dev sentence(s) longer than the 8 source positions "
                           f"of row 'PreNorm 8 positions' (the longest, #{dev_longest}, has {dev_length} tokens with "
                           f"</s>); raise --max-source-positions or shorten the dev set")
    assert problems[2].startswith(f"[preflight] PROBLEM: src-tgt: {test} test sentence(s) longer than the 8 source ")
    assert len(problems) == 3 and not (root / "mistakes" / "runs").exists()


@pytest.mark.slow
def test_preflight_of_a_good_table_reports_speed_memory_and_time(trust, main_of):
    root = trust[0]
    code, lines = main_of("trust", "good", "--preflight")
    assert code == 0, lines
    for row in ("PreNorm", "PreNorm + ScaleNorm"):
        report = next(line for line in lines if line.startswith(f"[preflight] trust src-tgt | {row}: ")
                      and "tokens/s" in line)
        tokens, rest = report.split(": ", 1)[1].split(" target tokens/s, ")
        assert float(tokens.replace(",", "")) > 0
        assert " updates/s, peak CPU resident memory " in rest and "1 run(s) to train x at most 10 updates: " in rest
    assert lines[-2] == "[preflight] 2 runs: 0 done (skipped), 0 to resume, 2 to train"
    assert lines[-1].startswith("[preflight] 2 configuration(s), 2 run(s), 2 to train or resume: at most ")
    assert lines[-1].endswith(" free; 0 problem(s)") and not (root / "good").exists()


class LocalSlurm(launchers.SlurmLauncher):
    """--launcher slurm with submitit's local executor (no scheduler here)."""

    def __init__(self, **kwargs):
        super().__init__(cluster="local", **kwargs)


@pytest.mark.slow
def test_slurm_runs_the_preflight_as_one_job_and_submits_nothing_when_it_fails(trust, main_of, monkeypatch):
    root = trust[0]
    monkeypatch.setattr(launchers, "SlurmLauncher", LocalSlurm)
    submitted = []
    monkeypatch.setattr(LocalSlurm, "execute", lambda self, runs, extra, echo: submitted.append(runs))
    jobs = root / "mistakes-slurm" / "jobs"
    code, lines = main_of("mistakes", "mistakes-slurm", "--launcher", "slurm", "--devices-per-run", "0",
                          "--slurm-folder", str(jobs))
    assert code == "reproduce.sh: preflight: 3 problem(s), listed above; nothing was submitted"
    assert lines[0].startswith("[preflight] job ") and sum("PROBLEM" in line for line in lines) == 3
    assert len([job for job in os.listdir(jobs) if job != "%j"]) == 1 and not submitted and not (root / "mistakes-slurm" / "runs").exists()
    code, lines = main_of("trust", "good-slurm", "--launcher", "slurm", "--devices-per-run", "0", "--rows",
                          "PreNorm", "--slurm-folder", str(root / "good-slurm" / "jobs"))
    assert len(submitted) == 1 and [run.row.name for run in submitted[0]] == ["PreNorm"]
    assert any(line.startswith("[preflight] trust src-tgt | PreNorm: ") and "tokens/s" in line for line in lines)


def test_the_divergence_rules_on_validation_records():
    """An untrained model a bit above a uniform guess is not diverged (a tiny model at update
    3: 7.652 bits against 6.32); twice a guess, NaN, or back above a guess after having learned is."""
    def record(loss):
        return {"valid_loss": loss, "valid_num_updates": "20"}

    assert runner.diverged_at(record("7.652"), 6.32, learned=False) is None
    assert runner.diverged_at(record("130.5"), 6.32, learned=False) == (
        "dev loss 130.5 bits per token at update 20, over 2 times a uniform guess over the target vocabulary "
        "(6.32 bits)")
    assert runner.diverged_at(record("nan"), None, learned=False) == "dev loss nan at update 20"
    assert runner.diverged_at(record("7.652"), 6.32, learned=True).endswith("(6.32 bits) after it had been better")
    assert runner.diverged_at(record("5.1"), 6.32, learned=True) is None
    assert runner.diverged_at({"valid_bleu": "3"}, 6.32, learned=True) is None
