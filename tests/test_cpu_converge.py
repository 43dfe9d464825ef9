"""The ``cpu_converge`` recipe and the ``cpu`` table (docs/results.md): every run ends by its own
stopping rule, never at the update cap. A tiny run of the table's baseline row, trained through
the runner with the recipe's flags, stops once dev BLEU has stalled for ``--stop-patience``
validations, far before its ``--max-update``; its re-run does not train again."""
import dataclasses
import json
import os

import pytest

from fairseq_normplug import checkpoint_safety
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.runner import Run, changed_flags, last_flag_value, run_folder, stopped_by, train
from inprocess import forked_commands

BASELINE = "PostNorm + LayerNorm + warmup"
#: the recipe's --stop-patience: validations in a row without a dev-BLEU gain that end a run
PATIENCE = int(last_flag_value(load_table("cpu").recipe.train, "--stop-patience"))
STOP = 10 * (PATIENCE + 1)  # the tiny run validates every 10 updates and its first is its best


def test_every_row_of_the_cpu_table_stops_by_the_recipe_rule():
    table = load_table("cpu")
    assert table.recipe.name == "cpu_converge" and table.pairs == ["de-en", "az-en"]
    assert [row.name for row in table.rows] == [
        BASELINE, "PreNorm + LayerNorm + warmup", "PreNorm + FixNorm + ScaleNorm + NoWarmup",
        "PreNorm + DyT + warmup", "PreNorm + FixNorm + DyT + NoWarmup"]
    train_flags = table.recipe.train
    assert int(last_flag_value(train_flags, "--stop-patience")) >= 2
    assert table.recipe.decoding["beam"] > 1 and table.recipe.decoding["gnmt_search"]
    for row in table.rows:
        assert table.schedules[row.schedule].flags[1] in ("inv_sqrt_decay", "val_decay")  # both know the rule


@pytest.fixture(scope="module", autouse=True)
def commands_forked():
    """The runs' fairseq commands run in forked children of this process (tests/inprocess.py's
    forked_commands): the runner's stopping and resuming logic is the subject here, not the process."""
    with forked_commands():
        yield


@pytest.fixture(scope="module")
def stalled_run(tiny_prepared, tmp_path_factory):
    """The baseline row on the tiny corpus, at the tiny size, with an lr so small that the
    model does not change (and no lr floor): dev BLEU is the same at every validation, so the
    run stalls from its first validation after warmup. Dev BLEU decodes greedily here, to keep
    the test short: the rule does not depend on the search."""
    root = tmp_path_factory.mktemp("converge")
    table = dataclasses.replace(load_table("cpu"), pairs=["src-tgt"])
    run = Run(table=table, pair="src-tgt", row=table.row(BASELINE), data_dir=tiny_prepared,
              run_dir=run_folder(str(root), table.name, "src-tgt", BASELINE))
    extra = ["--arch", "transformer_normplug_tiny", "--lr-lambda", "1e-9", "--stop-lr", "0",
             "--warmup-updates", "10", "--validate-interval-updates", "10", "--max-update", "200",
             "--eval-bleu-args", json.dumps({"beam": 1, "max_len_a": 1.2, "max_len_b": 10})]
    lines = []
    status = train(run, extra, echo=lines.append)
    return run, extra, status, lines


@pytest.mark.slow
def test_a_stalled_run_stops_by_its_patience_before_the_cap(stalled_run):
    run, _, status, _ = stalled_run
    assert status["status"] == "done"
    log = open(run.path("train.log"), encoding="utf-8").read()
    validations = [json.loads(line.split("| valid | ", 1)[1]) for line in log.splitlines() if "| valid | " in line]
    # validations at 10 (the best), 20, ..., STOP: PATIENCE without a gain
    assert [int(v["valid_num_updates"]) for v in validations] == list(range(10, STOP + 1, 10))
    assert len({v["valid_bleu"] for v in validations}) == 1
    assert f"stopping training after update {STOP}: no gain for {PATIENCE} validations" in log
    assert status["updates"] == STOP < 200
    assert status["stopped_by"].startswith(f"no gain for {PATIENCE} validations (best ")
    assert status["stopped_by"].endswith(f" at update 10, --stop-patience {PATIENCE})")
    last = checkpoint_safety.read_checkpoint(run.path("checkpoints", checkpoint_safety.LAST))
    assert last.updates == STOP
    assert f"no gain for {PATIENCE} validations" in checkpoint_safety.finished(last, 200)


@pytest.mark.slow
def test_a_stopped_run_is_not_trained_again(stalled_run):
    run, extra, _, _ = stalled_run
    run.set_status(status="running")  # as if killed after its final save
    lines = []
    status = train(run, extra, echo=lines.append)
    assert status["status"] == "done" and status["updates"] == STOP
    assert status["stopped_by"].startswith(f"no gain for {PATIENCE} validations")
    assert any(f"training was over (no gain for {PATIENCE} validations" in line for line in lines)
    assert checkpoint_safety.read_checkpoint(run.path("checkpoints", checkpoint_safety.LAST)).updates == STOP
    assert os.path.exists(run.path("checkpoints", checkpoint_safety.BEST))


@pytest.mark.slow
def test_more_patience_resumes_a_stopped_run_where_it_stopped(stalled_run):
    """The stopping rule of the command decides, not the checkpoint's: with 2 more validations
    of patience the stopped run resumes from its last checkpoint and stops 2 validations later
    (its log goes on from update STOP: no update is trained twice)."""
    run, extra, _, _ = stalled_run
    run.set_status(status="running")  # a finished run's status, reset by hand to train it on
    lines = []
    status = train(run, extra + ["--stop-patience", str(PATIENCE + 2)], echo=lines.append)
    assert any("training (resuming)" in line for line in lines)
    changed = f"the command has changed since this run started: --stop-patience {PATIENCE} -> {PATIENCE + 2}"
    assert any(changed in line for line in lines)
    assert status["status"] == "done" and status["updates"] == STOP + 20
    assert status["stopped_by"].endswith(f" at update 10, --stop-patience {PATIENCE + 2})")
    log = open(run.path("train.log"), encoding="utf-8").read()
    validations = [int(json.loads(line.split("| valid | ", 1)[1])["valid_num_updates"])
                   for line in log.splitlines() if "| valid | " in line]
    assert validations == list(range(10, STOP + 21, 10))
    assert log.count(changed) == 1 and log.index(changed) > log.index(f"after update {STOP}: no gain")
    # the recipe's own command again: the finished run is kept, and the reader told how it differs
    lines = []
    assert train(run, extra, echo=lines.append)["updates"] == STOP + 20
    assert lines == [f"[{run.label}] done: skipped (trained with --stop-patience {PATIENCE + 2} -> {PATIENCE}: "
                     f"delete {run.run_dir} to train it with this command)"]


def test_changed_flags_name_what_differs_but_not_paths():
    recorded = ["fairseq-train", "/old/data/bin", "--user-dir", "/old/repo/fairseq_normplug", "--stop-patience", "3",
                "--adam-betas", "(0.9,", "0.999)", "--cpu", "--lr", "1e-3", "--lr", "2e-3"]
    command = ["fairseq-train", "/new/data/bin", "--user-dir", "/new/repo/fairseq_normplug", "--stop-patience", "5",
               "--adam-betas", "(0.9,", "0.999)", "--max-update=10", "--lr", "2e-3"]
    assert changed_flags(recorded, command) == ["--stop-patience 3 -> 5", "--cpu (set) -> (none)",
                                                "--max-update (none) -> 10"]
    assert changed_flags(recorded, recorded) == []


def test_stopped_by_reads_the_last_rule_from_the_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("2026-12-01 10:00:00 | INFO | x | val_decay: stopping training after update 30: "
                   "lr 4e-05 < --stop-lr 5e-05\n"
                   "2026-12-01 10:05:00 | INFO | x | inv_sqrt_decay: stopping training after update 90: "
                   "no gain for 3 validations (best 7 at update 60, --stop-patience 3)\n")
    assert stopped_by(str(log), 90, "1000") == "no gain for 3 validations (best 7 at update 60, --stop-patience 3)"
    log.write_text("2026-12-01 | INFO | fairseq_cli.train | early stop since valid performance hasn't "
                   "improved for last 5 runs\n")
    assert stopped_by(str(log), 90, "1000") == "early stop since valid performance hasn't improved for last 5 runs"
    log.write_text("no rule\n")
    assert stopped_by(str(log), 1000, "1000") == "--max-update 1000"
    assert stopped_by(str(log), 999, "1000") is None and stopped_by(str(log), 999, None) is None
