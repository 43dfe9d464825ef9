"""A table you can trust (issue 37): one owner per run, a table written whatever its runs did,
divergence as a result, and configs checked before any work. Fault tests on tiny tables of the
synthetic corpus: two launchers at once and staggered, an owner SIGKILLed and its run taken
over, a disk full during a checkpoint save, a read-only results folder, a corrupt scores.json,
a diverging row and an undecodable test sentence; in each, nothing finished is lost and a
re-run repairs what it can."""
import csv
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

from conftest import FAST_START, REPO
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
FAULTS = {"title": "A good, an undecodable and a diverging row", "recipe": "trust_tiny", "pairs": ["src-tgt"],
          "rows": [{"name": "PreNorm", "model": ["--prenorm"], "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
                   {"name": "PreNorm 40 positions", "model": ["--prenorm", "--max-source-positions", "40"],
                    "schedule": "no_warmup", "train": ["--lr", "3e-3"]},
                   {"name": "PostNorm lr 1", "model": [], "schedule": "no_warmup", "train": ["--lr", "1"]}]}
RUNS = ("trust", "src-tgt")

#: one launcher (reproduce.sh's run_table on a config folder), as its own process
LAUNCHER = textwrap.dedent("""
    import sys
    from fairseq_normplug.experiments.configs import load_table
    from fairseq_normplug.experiments.reproduce import run_table
    configs, table, data, runs, results = sys.argv[1:]
    results = run_table(load_table(table, configs), ["src-tgt"], {"src-tgt": data}, runs, results)
    sys.exit(1 if results.failed else 0)
""")

#: test-only: with NORMPLUG_TEST_ENOSPC_AT=N, fairseq-train's save of update N writes half the
#: checkpoint and fails as a full disk does (OSError ENOSPC)
ENOSPC_HOOK = textwrap.dedent('''
    import errno, importlib.machinery, io, os, sys

    def patch(module):
        def full_disk_save(obj, f):
            if obj["optimizer_history"][-1]["num_updates"] == int(os.environ["NORMPLUG_TEST_ENOSPC_AT"]):
                data = io.BytesIO()
                module.torch.save(obj, data)
                f.write(data.getvalue()[: len(data.getvalue()) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            return module.torch.save(obj, f)
        module._torch_persistent_save = full_disk_save

    class PatchAfterImport:
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "fairseq.checkpoint_utils":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            exec_module = spec.loader.exec_module
            def exec_and_patch(module):
                exec_module(module)
                patch(module)
            spec.loader.exec_module = exec_and_patch
            return spec

    if os.environ.get("NORMPLUG_TEST_ENOSPC_AT"):
        sys.meta_path.insert(0, PatchAfterImport())
''')


@pytest.fixture(scope="module")
def trust(tiny_raw, tiny_bin, tmp_path_factory):
    """Config folder (the tables above), a prepared data folder on the tiny corpus, and one
    whose test set has a sentence of 60 tokens (more than 40 positions); the launcher script."""
    root = tmp_path_factory.mktemp("trust")
    configs = root / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    recipes = json.loads((configs / "recipes.json").read_text())
    recipes["trust_tiny"] = RECIPE
    (configs / "recipes.json").write_text(json.dumps(recipes))
    (configs / "experiments" / "trust.json").write_text(json.dumps(TWO_ROWS))
    (configs / "experiments" / "faults.json").write_text(json.dumps(FAULTS))
    data = root / "data"
    (data / "ref").mkdir(parents=True)
    os.symlink(tiny_bin, data / "bin")
    shutil.copy(os.path.join(tiny_raw, "test.tgt"), data / "ref" / "test.tok.tgt")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    (root / "launcher.py").write_text(LAUNCHER)
    return root, str(configs), str(data)


@pytest.fixture(scope="module")
def long_test_sentence(trust, tiny_raw, tmp_path_factory):
    """The tiny corpus with one more test sentence of 60 tokens."""
    from conftest import cli, run_cli

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
    run_cli([cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--trainpref",
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


@pytest.fixture(scope="module")
def reference(trust):
    """The two-row table, uninterrupted, by one launcher in this process."""
    root, configs, data = trust
    out = root / "reference"
    results = reproduce.run_table(load_table("trust", configs), ["src-tgt"], {"src-tgt": data}, str(out / "runs"),
                                  str(out / "results"), echo=lambda m: None)
    assert [r["status"] for r in results] == ["ok", "ok"] and not results.failed
    return table_csv(out)


def start_launcher(trust, out, name, env=None):
    """A launcher of the two-row table on the runs folder ``out``/runs; its results go to
    ``out``/``name``-results, its output to ``name``.log."""
    root, configs, data = trust
    log = open(root / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, str(root / "launcher.py"), configs, "trust", data, str(root / out / "runs"),
                             str(root / out / f"{name}-results")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "NORMPLUG_HELD_POLL": "0.3", **(env or {})})


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


def test_two_launchers_started_at_once_train_each_run_once(trust, reference):
    procs = [start_launcher(trust, "once", name) for name in ("once-a", "once-b")]
    assert [finish(proc) for proc in procs] == [0, 0]
    assert_trained_once_by_two(trust[0], "once", ("once-a", "once-b"), reference)


def test_a_second_launcher_started_while_the_first_trains_waits_for_it(trust, reference):
    """Staggered: the second starts when the first run has its first checkpoint (where it used
    to load that checkpoint and train beside the first); it trains the other run, then waits."""
    root = trust[0]
    first = start_launcher(trust, "staggered", "staggered-a")
    checkpoint = os.path.join(run_dir(root / "staggered", "prenorm"), "checkpoints", "checkpoint_last.pt")
    wait_for(lambda: os.path.exists(checkpoint) or first.poll() is not None)
    second = start_launcher(trust, "staggered", "staggered-b")
    assert finish(first) == 0 and finish(second) == 0
    assert_trained_once_by_two(root, "staggered", ("staggered-a", "staggered-b"), reference)
    assert "[trust src-tgt | PreNorm] held by host" in (root / "staggered-b.log").read_text()


def test_a_killed_owners_run_is_taken_over_and_ends_as_if_uninterrupted(trust, reference):
    root = trust[0]
    killed = start_launcher(trust, "takeover", "killed")
    folder = run_dir(root / "takeover", "prenorm")
    wait_for(lambda: runner.checkpoint_safety.read_checkpoint(os.path.join(folder, "checkpoints", "checkpoint_last.pt"))
             is not None or killed.poll() is not None)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    holder = ownership.read_holder(os.path.join(folder, ownership.LOCK_NAME))
    assert holder is not None and holder.host == socket.gethostname()
    wait_for(lambda: not ownership.pid_alive(holder.pid))
    assert finish(start_launcher(trust, "takeover", "taker")) == 0
    log = (root / "taker.log").read_text()
    assert f"took the run over from host {holder.host} pid {holder.pid}" in log and "its process is gone" in log
    assert "[trust src-tgt | PreNorm] training (resuming)" in log
    assert table_csv(root / "takeover", "taker-results") == reference


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


def test_a_diverging_row_and_an_undecodable_test_sentence(trust, long_test_sentence, main_of):
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
    vocabulary = runner.target_vocabulary_size(long_test_sentence, "tgt")
    loss = float(status["diverged"].split("dev loss ")[1].split()[0])
    assert loss > math.log2(vocabulary) + runner.DIVERGENCE_MARGIN_BITS
    assert f"at update 5, worse than a uniform guess over the target vocabulary ({math.log2(vocabulary):.2f} bits)" \
        in status["diverged"]
    assert lines[-2] == "[reproduce] 1 run(s) FAILED:"
    assert lines[-1].startswith("[reproduce] FAILED faults src-tgt | PreNorm 40 positions: trained, not evaluated: "
                                "fairseq-generate failed for faults src-tgt | PreNorm 40 positions: ")
    assert "is invalid" in lines[-1] and lines[-1].endswith(f"log: {folder / 'prenorm-40-positions' / 'train.log'}")
    assert not list(folder.glob("*/generate-test.txt.tmp-*"))
    code, lines = main_of("faults", "faults", data_dir=long_test_sentence)
    assert code == 1 and not any("training (" in line for line in lines)
    assert any(line.endswith("[faults src-tgt | PostNorm lr 1] diverged: skipped") for line in lines)


def copy_reference_runs(root, out):
    shutil.copytree(root / "reference" / "runs", root / out / "runs")
    return root / out / "runs" / "trust" / "src-tgt"


def test_a_disk_full_during_a_checkpoint_save_fails_the_run_and_the_rerun_resumes(trust, reference, main_of,
                                                                                   monkeypatch):
    """The last save (update 10) hits a full disk: the run is failed with the cause, the table
    is written, exit 1; the re-run drops the half-written file, resumes from update 5 and ends
    with the uninterrupted run's numbers."""
    root = trust[0]
    hook = root / "enospc-hook"
    hook.mkdir()
    fast_start = os.path.join(FAST_START, "sitecustomize.py")
    (hook / "sitecustomize.py").write_text(f"{ENOSPC_HOOK}\nimport runpy\nrunpy.run_path({fast_start!r})\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ["PYTHONPATH"]]))
    monkeypatch.setenv("NORMPLUG_TEST_ENOSPC_AT", "10")
    code, lines = main_of("trust", "full", "--rows", "PreNorm")
    assert code == 1
    folder = root / "full" / "runs" / "trust" / "src-tgt" / "prenorm"
    status = json.loads((folder / "status.json").read_text())
    assert status["status"] == "failed" and "No space left on device" in status["error"]
    assert lines[-1].startswith("[reproduce] FAILED trust src-tgt | PreNorm: training failed (exit 1): ")
    assert table_csv(root / "full")[0]["status"] == "failed"
    assert list((folder / "checkpoints").glob("*.tmp"))  # the cut save
    monkeypatch.delenv("NORMPLUG_TEST_ENOSPC_AT")
    code, lines = main_of("trust", "full", "--rows", "PreNorm")
    assert code == 0 and any("removed" in line and ".tmp" in line for line in lines)
    assert any(line.endswith("PreNorm] training (resuming); log: " + str(folder / "train.log")) for line in lines)
    assert table_csv(root / "full") == reference[:1]
    assert not list((folder / "checkpoints").glob("*.tmp"))


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


def test_a_corrupt_scores_json_is_a_failed_run_until_the_rerun_scores_it_again(trust, reference, main_of):
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
