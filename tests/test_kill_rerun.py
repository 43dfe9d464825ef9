"""Nothing lost when a job dies: a one-row tiny table is killed with SIGKILL (its whole
process group, as a scheduler kills a job) at four points in turn: during training, while a
checkpoint is copied, during test decoding, while results.csv is written. It is re-run after
each with the same command and ends with the results.csv (and scores.json) of an
uninterrupted run: the same selected update, dev and test BLEU to the last digit. The kill
points are hit deterministically by a test-only ``sitecustomize`` hook on the subprocesses'
PYTHONPATH. The repair rules of :mod:`fairseq_normplug.checkpoint_safety` are also checked
one by one on small files."""
import csv
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from fairseq_normplug import checkpoint_safety
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import CONFIG_DIR

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

KILL_HOOK = '''
"""Test-only (tests/test_kill_rerun.py): with NORMPLUG_KILL_AT=POINT set, SIGKILL this
process group at POINT; the module named in PATCHES is patched right after its import.
  update:N          after training update N (fairseq-train)
  copy:NAME:N       half-way through copying the save of update N to NAME (fairseq-train)
  generate:N        at the N-th batch of fairseq-generate
  write:NAME        half-way through writing NAME (experiments.tables.write_text_atomic)
"""
import importlib.machinery
import os
import re
import signal
import sys


def point():
    return os.environ.get("NORMPLUG_KILL_AT", "").split(":")


def kill():
    os.killpg(os.getpgrp(), signal.SIGKILL)


def after_update(module):
    step = module.Trainer.train_step

    def train_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if self.get_num_updates() == int(point()[1]):
            kill()
        return out
    module.Trainer.train_step = train_step


def during_copy(module):
    copy = module.PathManager.copy

    def half_copy(src, dst, overwrite=False):
        if os.path.basename(dst) == point()[1] and re.search(rf"_{point()[2]}\\.pt$", src):
            with open(src, "rb") as f:
                data = f.read()
            with open(dst, "wb") as f:
                f.write(data[: len(data) // 2])
            kill()
        return copy(src, dst, overwrite=overwrite)
    module.PathManager.copy = staticmethod(half_copy)


def during_decoding(module):
    if not sys.argv[0].endswith("fairseq-generate"):
        return
    step, calls = module.FairseqTask.inference_step, []  # one call per batch, whichever generator

    def counted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == int(point()[1]):
            kill()
        return step(self, *args, **kwargs)
    module.FairseqTask.inference_step = counted


def during_write(module):
    from fairseq_normplug.atomic_files import atomic_output

    write = module.write_text_atomic

    def half_write(path, text):
        if os.path.basename(path) == point()[1]:
            with atomic_output(path) as tmp:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text[: len(text) // 2])
                kill()
        return write(path, text)
    module.write_text_atomic = half_write


PATCHES = {"update": ("fairseq.trainer", after_update), "copy": ("fairseq.file_io", during_copy),
           "generate": ("fairseq.tasks.fairseq_task", during_decoding)}


class PatchAfterImport:
    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


if point()[0] in PATCHES:
    sys.meta_path.insert(0, PatchAfterImport(*PATCHES[point()[0]]))
'''

#: One process imports the runner once, then forks one job per line of stdin ({"name",
#: "kill_at"}): the job is its own process group (as a scheduler's job), runs the table with
#: NORMPLUG_KILL_AT set for it and its fairseq subprocesses; the job's pid, then its exit
#: code, come back as lines.
JOBS = textwrap.dedent("""
    import json, os, sys, traceback
    import sitecustomize
    from fairseq_normplug.experiments import tables
    from fairseq_normplug.experiments.configs import load_table
    from fairseq_normplug.experiments.reproduce import run_table
    root = sys.argv[1]
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            out = os.open(os.path.join(root, job["name"] + ".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.environ.pop("NORMPLUG_KILL_AT", None)
            if job["kill_at"]:
                os.environ["NORMPLUG_KILL_AT"] = job["kill_at"]
            if job["kill_at"].startswith("write:"):
                sitecustomize.during_write(tables)
            code = 0
            try:
                folder = os.path.join(root, job["name"])
                run_table(load_table("kill", os.path.join(root, "configs")), ["src-tgt"],
                          {"src-tgt": os.path.join(root, "data")}, os.path.join(folder, "runs"),
                          os.path.join(folder, "results"))
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            os._exit(code)
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
""")
JOB_TIMEOUT = 300


@pytest.fixture(scope="module")
def setup(tiny_raw, tiny_bin, tmp_path_factory):
    """A prepared data folder (the shared tiny corpus), the table's configs and the hook."""
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
    os.makedirs(root / "hook")
    (root / "hook" / "sitecustomize.py").write_text(KILL_HOOK)
    return root


@pytest.fixture(scope="module")
def jobs(setup):
    """``run(name, kill_at)``: the table as one job (see JOBS); its exit code (-9: killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(setup / "hook"), REPO])}
    env.pop("NORMPLUG_KILL_AT", None)
    proc = subprocess.Popen([sys.executable, "-c", JOBS, str(setup)], env=env, cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)

    def answer(pid=None):
        ready, _, _ = select.select([proc.stdout], [], [], JOB_TIMEOUT)
        if not ready:
            if pid:
                os.killpg(pid, signal.SIGKILL)
            raise AssertionError(f"no answer from the job runner in {JOB_TIMEOUT} s")
        line = proc.stdout.readline()
        assert line, f"the job runner died (exit {proc.wait()})"
        return int(line)

    def run(name, kill_at=""):
        proc.stdin.write(json.dumps({"name": name, "kill_at": kill_at}) + "\n")
        proc.stdin.flush()
        return answer(answer())

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


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
