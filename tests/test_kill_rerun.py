"""Nothing lost when a job dies: a one-row tiny table is killed with SIGKILL (its whole
process group, as a scheduler kills a job) at four points in turn: during training, while a
checkpoint is copied, during test decoding, while results.csv is written. It is re-run after
each with the same command and ends with the results.csv (and scores.json) of an
uninterrupted run: the same selected update, dev and test BLEU to the last digit. Each job is
a forked launcher (tests/inprocess.py's ForkedLauncher) in a session of its own, its fairseq
commands forked from it; the kill points are hit deterministically by the test-only patches of
tests/fault_hooks.py, installed in the job's fairseq commands. The repair rules of
:mod:`fairseq_normplug.checkpoint_safety` are also checked one by one on small files."""
import csv
import functools
import glob
import json
import os
import shutil
import signal
import subprocess

import pytest
import torch

import fault_hooks
from conftest import REPO
from inprocess import ForkedLauncher
from fairseq_normplug import checkpoint_safety
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import tables
from fairseq_normplug.experiments.configs import CONFIG_DIR, load_table
from fairseq_normplug.experiments.reproduce import run_table

TABLE = {
    "title": "One tiny row, killed and re-run",
    "recipe": "kill_tiny",
    "pairs": ["src-tgt"],
    "rows": [{"name": "PreNorm + FixNorm + ScaleNorm", "model": ["--prenorm", "--fixnorm", "--scalenorm"],
              "schedule": "no_warmup", "train": ["--lr", "3e-3"]}],
}
#: 20 updates (an epoch is 14: a save at its end), dev BLEU and a save at 10 and 20, the test
#: set decoded in 4 batches
RECIPE = {"base": "cpu_tiny", "generate": {"--max-tokens": "6000", "--batch-size": "25"},
          "train": {"--max-update": "20", "--validate-interval-updates": "10", "--log-interval": "10",
                    "--norm-stats-interval": "10"}}
RUN = ("runs", "kill", "src-tgt", "prenorm-fixnorm-scalenorm")

JOB_TIMEOUT = 300


@pytest.fixture(scope="module")
def setup(tiny_raw, tiny_bin, tmp_path_factory):
    """A prepared data folder (the shared tiny corpus) and the table's configs."""
    root = tmp_path_factory.mktemp("kill")
    data = root / "data"
    shutil.copytree(tiny_bin, data / "bin")
    os.makedirs(data / "ref")
    shutil.copyfile(os.path.join(tiny_raw, "test.tgt"), data / "ref" / "test.tok.tgt")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    configs = root / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    recipes = json.loads((configs / "recipes.json").read_text())
    recipes["kill_tiny"] = RECIPE
    (configs / "recipes.json").write_text(json.dumps(recipes))
    (configs / "experiments" / "kill.json").write_text(json.dumps(TABLE))
    return root


def job_main(root, name, kill_at):
    """A job's work: the table run into ``root``/``name``, its results.csv write cut at
    ``write:NAME`` (the other kill points are in its fairseq commands)."""
    if kill_at.startswith("write:"):
        fault_hooks.during_write(tables)
    folder = os.path.join(root, name)
    run_table(load_table("kill", os.path.join(root, "configs")), ["src-tgt"], {"src-tgt": os.path.join(root, "data")},
              os.path.join(folder, "runs"), os.path.join(folder, "results"))


@pytest.fixture(scope="module")
def jobs(setup):
    """``run(name, kill_at)``: the table as one job, a forked launcher in a session of its own (as a
    scheduler's job; tests/inprocess.py's ForkedLauncher), with NORMPLUG_KILL_AT set for it and
    its forked fairseq commands (tests/fault_hooks.py installed in each); its exit code (-9:
    killed). Its output goes to ``name``.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NORMPLUG_KILL_AT", None)

    def run(name, kill_at=""):
        with open(setup / f"{name}.log", "a") as log:
            proc = ForkedLauncher(functools.partial(job_main, str(setup), name, kill_at), stdout=log,
                                  stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                  env={**env, **({"NORMPLUG_KILL_AT": kill_at} if kill_at else {})},
                                  at_start=fault_hooks.install)
        try:
            return proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"the job did not end in {JOB_TIMEOUT} s")

    return run


def _log(root, name):
    path = root / f"{name}.log"
    return path.read_text()[-4000:] if path.exists() else ""


def _results(root, name):
    with open(root / name / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row.pop("minutes")  # wall time, the one field that differs
    scores = json.loads((root / name).joinpath(*RUN, "scores.json").read_text())
    return rows, scores


def _checkpoint(root, name):
    return checkpoint_safety.read_checkpoint(os.path.join(root, "killed", *RUN, "checkpoints", name))


def _interval(root, update):
    paths = glob.glob(os.path.join(root, "killed", *RUN, "checkpoints", f"checkpoint_*_{update}.pt"))
    return checkpoint_safety.read_checkpoint(paths[0]) if paths else None


def _status(root):
    return json.loads(open(os.path.join(root, "killed", *RUN, "status.json")).read())["status"]


def _run_files(root, pattern):
    return glob.glob(os.path.join(root, "killed", *RUN, pattern))


@pytest.mark.slow
def test_killed_table_reruns_to_the_uninterrupted_results(setup, jobs):
    root = setup
    assert jobs("uninterrupted") == 0, _log(root, "uninterrupted")
    (expected,), expected_scores = reference = _results(root, "uninterrupted")
    assert expected["status"] == "ok" and int(expected["updates"]) == 20 and int(expected["selected_update"]) > 0
    assert float(expected["dev_bleu"]) > 0 and float(expected["sacrebleu"]) > 0
    points = [
        # during training, 3 updates into epoch 2: the re-run resumes from the end-of-epoch-1
        # checkpoint (update 14), where fairseq's own iterator would change the batches
        ("update:17", lambda: _checkpoint(root, "checkpoint_last.pt").updates == 14 and _status(root) == "running"),
        # while the last save (update 20) is copied to checkpoint_last.pt: training is over but
        # fairseq-train would resume from a broken file (or, repaired, train update 21)
        ("copy:checkpoint_last.pt:20", lambda: os.path.exists(_run_files(root, "checkpoints/checkpoint_last.pt")[0])
         and _checkpoint(root, "checkpoint_last.pt") is None and _interval(root, 20).updates == 20),
        # test decoding, third batch: a partial temporary output, no generate-test.txt
        ("generate:3", lambda: _status(root) == "done" and _checkpoint(root, "checkpoint_last.pt").updates == 20
         and _run_files(root, "generate-test.txt.tmp-*") and not _run_files(root, "generate-test.txt")),
        # results.csv half written (its temporary file)
        ("write:results.csv", lambda: _run_files(root, "scores.json")
         and glob.glob(os.path.join(root, "killed", "results", ".results.csv.*.tmp"))
         and not os.path.exists(os.path.join(root, "killed", "results", "results.csv"))),
    ]
    for kill_at, killed_there in points:
        assert jobs("killed", kill_at) == -signal.SIGKILL, f"{kill_at}: not killed\n{_log(root, 'killed')}"
        assert killed_there(), f"{kill_at}: not the expected state\n{_log(root, 'killed')}"
    assert jobs("killed") == 0, _log(root, "killed")
    assert _results(root, "killed") == reference
    log = open(os.path.join(root, "killed", *RUN, "train.log")).read()
    assert log.count("Loaded checkpoint") == 1  # resumed after the first kill only
    assert not _run_files(root, "generate-test.txt.tmp-*")
    # issue 50: the killed results write's hidden temporary file is gone too
    assert not glob.glob(os.path.join(root, "killed", "results", ".*.tmp")) and not _run_files(root, ".*.tmp")
    status = json.loads(open(os.path.join(root, "killed", *RUN, "status.json")).read())
    assert status["minutes"] > 0  # the killed attempts' training time, kept at each validation


def _fake_checkpoint(path, updates, val_loss=None, best=None, next_lr=1e-3, scheduler=None, scheduler_state=None):
    torch.save({"model": {"w": torch.full((64,), float(updates))},
                "optimizer_history": [{"num_updates": updates, "lr_scheduler_state": scheduler_state or {}}],
                "extra_state": {"val_loss": val_loss, **({"best": best} if best is not None else {})},
                "last_optimizer_state": {"param_groups": [{"lr": next_lr}]},
                "cfg": {"lr_scheduler": scheduler or {"_name": "inverse_sqrt"}}}, str(path))


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _updates(folder, name):
    info = checkpoint_safety.read_checkpoint(str(folder / name))
    return None if info is None else info.updates


class NotACheckpointClass:
    """A class no fairseq checkpoint holds: the safe loader refuses it."""


def test_a_whole_checkpoint_the_safe_loader_refuses_is_an_error_not_deleted(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save({"model": {}, "optimizer_history": [{"num_updates": 3}], "extra": NotACheckpointClass()}, path)
    with pytest.raises(NormplugError, match="safe loader"):
        checkpoint_safety.read_checkpoint(path)
    assert os.path.exists(path)
    with open(path, "r+b") as f:  # a cut file is simply not complete
        f.truncate(os.path.getsize(path) // 2)
    assert checkpoint_safety.read_checkpoint(path) is None


def test_repair_finishes_the_interrupted_save(tmp_path):
    # killed while copying the save of update 20 (a new best) to checkpoint_last.pt
    _fake_checkpoint(tmp_path / "checkpoint_1_10.pt", 10, 5.0, 5.0)
    _fake_checkpoint(tmp_path / "checkpoint_2_20.pt", 20, 7.0, 7.0)
    shutil.copyfile(tmp_path / "checkpoint_2_20.pt", tmp_path / "checkpoint_best.pt")
    shutil.copyfile(tmp_path / "checkpoint_1_10.pt", tmp_path / "checkpoint_last.pt")
    _truncate(tmp_path / "checkpoint_last.pt")
    (tmp_path / "checkpoint_3_30.pt.tmp").write_bytes(b"partial")
    actions = checkpoint_safety.repair(str(tmp_path))
    assert _updates(tmp_path, "checkpoint_last.pt") == 20 and _updates(tmp_path, "checkpoint_best.pt") == 20
    assert not (tmp_path / "checkpoint_3_30.pt.tmp").exists() and len(actions) == 3
    assert checkpoint_safety.repair(str(tmp_path)) == []  # nothing left to do


def test_repair_rewrites_a_cut_best_and_keeps_an_older_best(tmp_path):
    # killed while copying update 20 (a new best) to checkpoint_best.pt: both copies redone
    _fake_checkpoint(tmp_path / "checkpoint_last.pt", 10, 5.0, 5.0)
    _fake_checkpoint(tmp_path / "checkpoint_2_20.pt", 20, 7.0, 7.0)
    shutil.copyfile(tmp_path / "checkpoint_2_20.pt", tmp_path / "checkpoint_best.pt")
    _truncate(tmp_path / "checkpoint_best.pt")
    checkpoint_safety.repair(str(tmp_path))
    assert _updates(tmp_path, "checkpoint_last.pt") == 20 and _updates(tmp_path, "checkpoint_best.pt") == 20
    # a save that was not a new best (val 6 < best 7) leaves checkpoint_best.pt alone
    _fake_checkpoint(tmp_path / "checkpoint_3_30.pt", 30, 6.0, 7.0)
    checkpoint_safety.repair(str(tmp_path))
    assert _updates(tmp_path, "checkpoint_last.pt") == 30 and _updates(tmp_path, "checkpoint_best.pt") == 20


def test_finished_training_is_not_resumed(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    _fake_checkpoint(path, 30)
    info = checkpoint_safety.read_checkpoint(str(path))
    assert "--max-update 30" in checkpoint_safety.finished(info, 30)
    assert checkpoint_safety.finished(info, 31) is None and checkpoint_safety.finished(None, 30) is None
    scheduler = {"_name": "val_decay", "stop_lr": 5e-5, "warmup_updates": 10}
    _fake_checkpoint(path, 30, next_lr=4e-5, scheduler=scheduler)
    assert "--stop-lr" in checkpoint_safety.finished(checkpoint_safety.read_checkpoint(str(path)), 1000)
    _fake_checkpoint(path, 30, next_lr=6e-5, scheduler=scheduler)
    assert checkpoint_safety.finished(checkpoint_safety.read_checkpoint(str(path)), 1000) is None
    _fake_checkpoint(path, 5, next_lr=4e-5, scheduler=scheduler)  # in warmup: the floor does not apply
    assert checkpoint_safety.finished(checkpoint_safety.read_checkpoint(str(path)), 1000) is None
    # --stop-patience 2: the dev BLEU of the saved validation history has stalled (or not)
    scheduler = {"_name": "inv_sqrt_decay", "stop_lr": 0.0, "warmup_updates": 10, "stop_patience": 2}
    stalled = {"history": [[10, 3.0], [20, 5.0], [30, 4.0]], "maximize": True}
    _fake_checkpoint(path, 30, scheduler=scheduler, scheduler_state=stalled)
    assert checkpoint_safety.finished(checkpoint_safety.read_checkpoint(str(path)), 1000) is None
    stalled["history"].append([40, 5.0])
    _fake_checkpoint(path, 40, scheduler=scheduler, scheduler_state=stalled)
    stopped = checkpoint_safety.read_checkpoint(str(path))
    assert "no gain for 2 validations" in checkpoint_safety.finished(stopped, 1000)
    # the resuming command's rules decide: more patience (or a lower floor) trains on
    assert checkpoint_safety.finished(stopped, 1000, stop_patience=3) is None
    assert "no gain for 1 validations" in checkpoint_safety.finished(stopped, 1000, stop_patience=1)
    _fake_checkpoint(path, 30, next_lr=4e-5, scheduler={"_name": "val_decay", "stop_lr": 5e-5, "warmup_updates": 10})
    floor = checkpoint_safety.read_checkpoint(str(path))
    assert checkpoint_safety.finished(floor, 1000, stop_lr=1e-5) is None
    assert "--stop-lr 0.0001" in checkpoint_safety.finished(floor, 1000, stop_lr=1e-4)


def test_command_line_repairs_and_tells_a_finished_run(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "checkpoint_1_20.pt", 20, 7.0, 7.0)
    shutil.copyfile(tmp_path / "checkpoint_1_20.pt", tmp_path / "checkpoint_last.pt")
    _truncate(tmp_path / "checkpoint_last.pt")
    assert checkpoint_safety.main([str(tmp_path), "--max-update", "30"]) == 0
    out = capsys.readouterr().out
    assert "removed the incomplete checkpoint_last.pt" in out and "checkpoint_last.pt: update 20" in out
    assert _updates(tmp_path, "checkpoint_best.pt") == 20
    assert checkpoint_safety.main([str(tmp_path), "--max-update", "20"]) == 3
    assert "training is over" in capsys.readouterr().out
    torch.save({"model": {}, "optimizer_history": [{"num_updates": 5}]}, str(tmp_path / "old.pt"),
               _use_new_zipfile_serialization=False)  # torch's pre-1.6 format: complete, not a zip
    assert _updates(tmp_path, "old.pt") == 5
