"""The depth table (configs/experiments/depth.json, experiments/depths.py): every design at each
depth, compared at its own depth, the finished runs of another table reused, and the design x
depth table and figures."""
import json
import os

import pytest
from fairseq.models import ARCH_CONFIG_REGISTRY

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import depth_figures, reproduce
from fairseq_normplug.experiments.configs import Row, load_table
from fairseq_normplug.experiments.depths import (adopt_kept_runs, by_design, check_depths, depth_markdown,
                                                 expand_rows, rows_at_depths)
from fairseq_normplug.experiments.runs import run_folder
from fairseq_normplug.experiments.training_log import parse_training_log
from fairseq_normplug.models.placements import training_task
from model_helpers import build

TINY = "transformer_normplug_tiny"
DESIGNS = 13


def test_the_depth_table_trains_every_design_at_every_depth_against_its_baseline_at_that_depth():
    table = load_table("depth")
    assert table.depths == [3, 6, 12, 24] and table.pairs == ["de-en"] and table.recipe.name == "cpu_short"
    assert len(table.rows) == DESIGNS * 4
    designs = list(dict.fromkeys(row.design for row in table.rows))
    assert len(designs) == DESIGNS and designs[:2] == ["PostNorm + LayerNorm + warmup", "PreNorm + LayerNorm + warmup"]
    for row in table.rows:
        if row.layers == 3:  # the recipe's own depth: the row as other tables define it, no layer flags
            assert row.name == row.design and "--encoder-layers" not in row.model
        else:
            assert row.name == f"{row.design}, {row.layers} layers"
            assert row.model[-4:] == ["--encoder-layers", str(row.layers), "--decoder-layers", str(row.layers)]
        if row.baseline:
            assert table.row(row.baseline).layers == row.layers
    assert table.row("Keel + warmup, 24 layers").baseline == "PostNorm + LayerNorm + warmup, 24 layers"
    # the first row at each depth has no baseline: PostNorm + LayerNorm is the reference
    assert [row.name for row in table.rows if not row.baseline] == [
        "PostNorm + LayerNorm + warmup"] + [f"PostNorm + LayerNorm + warmup, {d} layers" for d in (6, 12, 24)]


def test_recipe_layers_is_what_the_recipes_arch_builds():
    """A row at ``recipe_layers`` gets no layer flags: its model must have that many layers."""
    import fairseq_normplug  # noqa: F401 (registers the plugin's architectures)
    from argparse import Namespace

    table = load_table("depth")
    args = Namespace()
    ARCH_CONFIG_REGISTRY[table.recipe.arch](args)
    assert args.encoder_layers == args.decoder_layers == 3


@pytest.mark.parametrize("design", [row.design for row in load_table("depth").rows if row.layers == 3])
def test_every_design_builds_a_tiny_model_at_six_layers(tiny_bin, design):
    flags = load_table("depth").row(f"{design}, 6 layers").model
    model, _, _ = build(tiny_bin, TINY, *flags, task=training_task(flags) or "translation")
    assert len(model.encoder.layers) == len(model.decoder.layers) == 6


@pytest.mark.parametrize("depths,recipe_layers,message", [
    ([], 3, "'depths' must list layer counts"),
    ([3, 0], 3, "'depths' must list layer counts"),
    ([3, "6"], 3, "'depths' must list layer counts"),
    ([3, True], 3, "'depths' must list layer counts"),
    ([3, 6, 3], 3, "lists a depth twice"),
    ([3, 6], None, "needs 'recipe_layers'"),
    ([3, 6], 0, "needs 'recipe_layers'"),
])
def test_bad_depths_are_one_line(depths, recipe_layers, message):
    with pytest.raises(NormplugError, match=message) as error:
        check_depths(depths, recipe_layers, "depth.json")
    assert "\n" not in str(error.value) and str(error.value).startswith("depth.json: ")


def test_expanded_rows_keep_their_flags_and_schedule():
    rows = [Row(name="A", model=["--prenorm"], schedule="s", train=["--lr", "1"]),
            Row(name="B", model=[], schedule="t", baseline="A")]
    expanded = expand_rows(rows, [2, 4], recipe_layers=2)
    assert [row.name for row in expanded] == ["A", "B", "A, 4 layers", "B, 4 layers"]
    assert expanded[3].baseline == "A, 4 layers" and expanded[3].schedule == "t" and expanded[2].train == ["--lr", "1"]
    assert expanded[2].model == ["--prenorm", "--encoder-layers", "4", "--decoder-layers", "4"]
    assert [(row.design, row.layers) for row in expanded] == [("A", 2), ("B", 2), ("A", 4), ("B", 4)]


def test_depths_select_rows_and_refuse_in_one_line():
    table = load_table("depth")
    assert len(rows_at_depths(table, [6])) == DESIGNS
    assert rows_at_depths(table, [3, 24], ["Keel + warmup"]) == ["Keel + warmup", "Keel + warmup, 24 layers"]
    assert rows_at_depths(table, [6], ["B2T + warmup, 6 layers"]) == ["B2T + warmup, 6 layers"]
    with pytest.raises(NormplugError, match=r"--depths 5: the table depth trains depths 3, 6, 12, 24"):
        rows_at_depths(table, [5])
    with pytest.raises(NormplugError, match=r"--rows 'Nope': the table depth has no such row"):
        rows_at_depths(table, [6], ["Nope"])
    with pytest.raises(NormplugError, match="not trained at several depths"):
        rows_at_depths(load_table("cpu"), [6])
    with pytest.raises(NormplugError, match="no run at depths 6 among --rows"):
        rows_at_depths(table, [6], ["Keel + warmup, 24 layers"])


def test_reproduce_refuses_a_depth_the_table_does_not_train(capsys):
    with pytest.raises(SystemExit) as stop:
        reproduce.main(["depth", "--depths", "5", "--print-commands"])
    assert "reproduce.sh: error: --depths 5: the table depth trains depths 3, 6, 12, 24" in str(stop.value)


def _runs(tmp_path, names):
    table = load_table("depth")
    return reproduce.plan_runs(table, ["de-en"], {"de-en": str(tmp_path / "data")}, str(tmp_path / "runs"),
                               rows=names, check_data=False)


def _kept(tmp_path, name, command, status="done"):
    folder = run_folder(str(tmp_path / "runs"), "beyond.cpu_short", "de-en", name)
    os.makedirs(folder)
    for record, text in (("train.log", "log\n"), ("generate-test.txt", "H-0\tx\n"),
                         ("scores.json", json.dumps({"tokenized_bleu": 20.0}))):
        with open(os.path.join(folder, record), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "status.json"), "w") as f:
        json.dump({"status": status, "command": command}, f)
    return folder


def test_a_finished_run_of_the_same_command_elsewhere_is_adopted_not_retrained(tmp_path):
    names = ["PostNorm + LayerNorm + warmup", "PreNorm + LayerNorm + warmup", "B2T + warmup", "Keel + warmup",
             "PostNorm + LayerNorm + warmup, 6 layers"]
    runs = _runs(tmp_path, names)
    same, changed, running, started, deeper = runs
    _kept(tmp_path, same.row.name, same.train_command())
    _kept(tmp_path, changed.row.name, changed.train_command() + ["--dropout", "0.3"])
    _kept(tmp_path, running.row.name, running.train_command(), status="running")
    _kept(tmp_path, started.row.name, started.train_command())
    os.makedirs(started.run_dir)
    with open(started.path("status.json"), "w") as f:
        json.dump({"status": "running"}, f)
    # the 6-layer run has no namesake: the beyond table's runs are at the recipe's 3 layers
    lines = []
    adopted = adopt_kept_runs(runs, str(tmp_path / "runs"), lines.append)
    assert adopted == [same] and same.status()["status"] == "done"
    assert sorted(os.listdir(same.run_dir)) == ["generate-test.txt", "scores.json", "status.json", "train.log"]
    assert open(same.path("generate-test.txt")).read() == "H-0\tx\n"
    assert not os.path.exists(changed.run_dir) and not os.path.exists(running.run_dir)
    assert started.status() == {"status": "running"} and not os.path.exists(deeper.run_dir)
    assert len(lines) == 1 and "its records are copied" in lines[0] and same.row.name in lines[0]
    assert adopt_kept_runs(runs, str(tmp_path / "runs"), lines.append) == []  # once only


def _result(row, status="ok", bleu=None, p=None):
    return {"row": row, "seed": 1, "status": status, "tokenized_bleu": bleu, "p_value_adjusted": p}


def test_the_design_by_depth_table_and_figure_mark_diverged_runs(tmp_path):
    table = load_table("depth")
    results = [_result("PostNorm + LayerNorm + warmup", bleu=20.0),
               _result("PostNorm + LayerNorm + warmup, 6 layers", bleu=18.5),
               _result("PostNorm + LayerNorm + warmup, 12 layers", status="diverged"),
               _result("PreNorm + LayerNorm + warmup, 6 layers", bleu=21.25, p=0.004),
               _result("PreNorm + LayerNorm + warmup, 24 layers", status="failed")]
    grid = by_design(results, table)
    assert list(grid) == ["PostNorm + LayerNorm + warmup", "PreNorm + LayerNorm + warmup"]
    text = depth_markdown(results, table)
    assert "| design | 3 | 6 | 12 | 24 |" in text
    assert "| PostNorm + LayerNorm + warmup | 20.00 | 18.50 | *diverged* | - |" in text
    assert "| PreNorm + LayerNorm + warmup | - | 21.25\u2021 | - | *failed* |" in text  # against PostNorm at 6
    drawn = depth_figures.plot_metric_against_depth(grid, table.depths, str(tmp_path / "d.png"))
    assert drawn["PostNorm + LayerNorm + warmup"] == {"scored": [(3, 20.0), (6, 18.5)], "unscored": [(12, "diverged")]}
    assert drawn["PreNorm + LayerNorm + warmup"] == {"scored": [(6, 21.25)], "unscored": [(24, "failed")]}
    assert open(tmp_path / "d.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _train_log(path, losses):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for update, loss in enumerate(losses, start=1):
            record = {"epoch": 1, "update": update / 10, "loss": str(loss), "num_updates": str(update * 10)}
            f.write(f"2026-12-06 08:35:38 | INFO | train_inner | {json.dumps(record)}\n")


def test_depth_outputs_are_written_from_the_runs_with_the_deepest_logs(tmp_path):
    names = ["PostNorm + LayerNorm + warmup", "PostNorm + LayerNorm + warmup, 6 layers",
             "PreNorm + LayerNorm + warmup, 6 layers", "Keel + warmup"]
    runs = _runs(tmp_path, names)
    for run, losses in zip(runs, ([9, 8], [9, 7.5, 7], [9, 6, 5], [8, 7])):
        _train_log(run.path("train.log"), losses)
    results = [_result(names[0], bleu=20.0), _result(names[1], status="diverged"), _result(names[2], bleu=19.0),
               _result(names[3], bleu=18.0)]
    lines = []
    written = depth_figures.write_depth_outputs(load_table("depth"), runs, results, str(tmp_path), "tokenized_bleu",
                                                lines.append)
    assert [os.path.basename(path) for path in written] == ["depth.md", "depth_bleu.png", "depth_train_loss.png"]
    text = open(tmp_path / "depth.md").read()
    assert "| PostNorm + LayerNorm + warmup | 20.00 | *diverged* | - | - |" in text
    assert "![tokenized_bleu against depth](depth_bleu.png)" in text
    # the loss figure: the 6-layer runs only, in the table's order
    drawn = depth_figures.plot_train_loss({"PostNorm + LayerNorm + warmup": parse_training_log(runs[1].path("train.log"))},
                                          6, str(tmp_path / "l.png"), ["PostNorm + LayerNorm + warmup"])
    assert drawn == {"PostNorm + LayerNorm + warmup": ([10, 20, 30], [9.0, 7.5, 7.0])}
    assert len(lines) == 3 and all(line.startswith("[reproduce] depth: ") for line in lines)
