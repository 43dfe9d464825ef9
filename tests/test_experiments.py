"""reproduce/train/evaluate on a tiny prepared corpus: results produced, resume skips
finished rows, a forced divergence is recorded as such."""
import csv
import json
import os
import shutil

import pytest

from conftest import REPO, run_cli
from fairseq_normplug.experiments.configs import CONFIG_DIR, load_table
from fairseq_normplug.experiments.reproduce import run_table

TINY_TABLE = {
    "title": "Two tiny rows and a forced divergence",
    "recipe": "test_tiny",
    "pairs": ["src-tgt"],
    "rows": [
        {"name": "PostNorm + LayerNorm", "model": [], "schedule": "inv_sqrt_decay"},
        {"name": "PreNorm + FixNorm + ScaleNorm", "model": ["--prenorm", "--fixnorm", "--scalenorm"],
         "schedule": "no_warmup", "baseline": "PostNorm + LayerNorm", "train": ["--lr", "3e-3"]},
        {"name": "Diverging", "model": [], "schedule": "no_warmup", "baseline": "PostNorm + LayerNorm",
         "train": ["--lr", "1e4"]},
    ],
}


@pytest.fixture(scope="module")
def prepared(tiny_raw, tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("prepared") / "src-tgt")
    run_cli([os.path.join(REPO, "scripts", "prepare_corpus.sh"), tiny_raw, "--src", "src", "--tgt", "tgt",
             "--tokenized", "--bpe-merges", "30", "--dest", dest, "--workers", "1"])
    return dest


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    config_dir = tmp_path_factory.mktemp("configs") / "configs"
    shutil.copytree(CONFIG_DIR, config_dir)
    recipes = json.loads((config_dir / "recipes.json").read_text())
    recipe = dict(recipes["cpu_tiny"])
    recipe["train"] = [f for f in recipe["train"]] + ["--max-update", "40", "--validate-interval-updates", "20",
                                                      "--log-interval", "10", "--norm-stats-interval", "10"]
    recipe["generate"] = ["--beam", "2", "--max-tokens", "4000"]
    recipes["test_tiny"] = recipe
    (config_dir / "recipes.json").write_text(json.dumps(recipes))
    (config_dir / "experiments" / "tiny.json").write_text(json.dumps(TINY_TABLE))
    return load_table("tiny", str(config_dir))


@pytest.fixture(scope="module")
def reproduced(tiny_table, prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    messages = []
    results = run_table(tiny_table, ["src-tgt"], {"src-tgt": prepared}, str(out / "runs"), str(out / "results"),
                        echo=messages.append)
    return out, results, messages


def test_results_table_and_figures(reproduced):
    out, results, messages = reproduced
    by_row = {r["row"]: r for r in results}
    assert by_row["PostNorm + LayerNorm"]["status"] == "ok"
    assert by_row["PreNorm + FixNorm + ScaleNorm"]["status"] == "ok"
    with open(out / "results" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    for row in rows:
        if row["status"] == "ok":
            assert 0 <= float(row["tokenized_bleu"]) <= 100 and 0 <= float(row["sacrebleu"]) <= 100
            assert int(row["updates"]) == 40
            assert float(row["length_ratio"]) > 0
    scaled = next(r for r in rows if r["row"] == "PreNorm + FixNorm + ScaleNorm")
    assert 0 < float(scaled["p_value"]) <= 1
    assert "tok:13a" in scaled["sacrebleu_signature"]
    markdown = (out / "results" / "results.md").read_text()
    assert "PreNorm + FixNorm + ScaleNorm" in markdown and "diverged" in markdown
    pngs = [f for f in os.listdir(out / "results") if f.endswith(".png")]
    assert len(pngs) >= 2
    assert any("update 20" in m and "dev BLEU" in m for m in messages)


def test_forced_divergence_is_a_result(reproduced):
    out, results, _ = reproduced
    diverged = next(r for r in results if r["row"] == "Diverging")
    assert diverged["status"] == "diverged" and diverged["tokenized_bleu"] is None
    status = json.loads((out / "runs" / "tiny" / "src-tgt" / "diverging" / "status.json").read_text())
    assert status["status"] == "diverged" and status["exit_code"] != 0


def test_rerun_skips_finished_and_diverged_rows(reproduced, tiny_table, prepared):
    out, _, _ = reproduced
    log = out / "runs" / "tiny" / "src-tgt" / "postnorm-layernorm" / "train.log"
    before = log.read_text()
    messages = []
    results = run_table(tiny_table, ["src-tgt"], {"src-tgt": prepared}, str(out / "runs"), str(out / "results"),
                        echo=messages.append)
    skipped = [m for m in messages if m.endswith(("] done: skipped", "] diverged: skipped"))]
    assert len(skipped) == 3
    assert not any("training (" in m for m in messages)
    assert log.read_text() == before
    assert [r["status"] for r in results] == ["ok", "ok", "diverged"]


def test_interrupted_run_resumes(tiny_table, prepared, tmp_path):
    from fairseq_normplug.experiments.runner import Run, train

    run = Run(table=tiny_table, row=tiny_table.rows[0], pair="src-tgt", data_dir=prepared,
              run_dir=str(tmp_path / "run"))
    first = train(run, ["--max-update", "10"], echo=lambda m: None)
    assert first["status"] == "done" and first["updates"] == 10
    run.set_status(status="running")  # as if it had been killed
    second = train(run, [], echo=lambda m: None)
    assert second["status"] == "done" and second["updates"] == 40
    assert "Loaded checkpoint" in (tmp_path / "run" / "train.log").read_text()
