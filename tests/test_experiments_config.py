"""Experiment configs: every shipped table loads, and typos are errors naming the key."""
import json
import shutil

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import CONFIG_DIR, available_tables, load_table
from fairseq_normplug.experiments.runner import progress_line, scaled_schedule_flags

NORM_FLAGS = {"--scalenorm", "--rmsnorm", "--dyt"}


@pytest.mark.parametrize("name", available_tables())
def test_shipped_tables_load(name):
    table = load_table(name)
    assert table.rows and table.pairs
    if any(not NORM_FLAGS & set(row.model) for row in table.rows):  # a LayerNorm row
        assert any("--dyt" in row.model for row in table.rows), "DyT rows belong beside LayerNorm rows"


def test_paper_tables_are_all_there():
    assert {f"table{i}" for i in range(2, 8)} | {"demo"} <= set(available_tables())
    table3 = load_table("table3")
    assert table3.pairs == ["gl-en", "sk-en", "en-vi", "en-he", "ar-en"]
    full = table3.row("PreNorm + FixNorm + ScaleNorm")
    assert set(full.model) == {"--prenorm", "--fixnorm", "--scalenorm", "--smallinit"}
    assert full.baseline == "PostNorm + LayerNorm"


def test_warmup_scaling_for_cpu_recipes():
    table = load_table("demo")
    recipe = load_table("demo").recipe
    flags = scaled_schedule_flags(table.schedules["inv_sqrt_decay"], recipe)
    assert flags[flags.index("--warmup-updates") + 1] == str(round(8000 * recipe.warmup_scale))
    assert float(flags[flags.index("--lr-lambda") + 1]) == pytest.approx(recipe.lr_lambda_scale)
    flags = scaled_schedule_flags(table.schedules["no_warmup"], recipe)
    assert flags[flags.index("--warmup-updates") + 1] == "0"
    assert flags[flags.index("--lr") + 1] == "3e-4"


@pytest.fixture
def config_copy(tmp_path):
    dest = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, dest)
    return dest


def edit_table(config_dir, name, change):
    path = config_dir / "experiments" / f"{name}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change,message", [
    (lambda d: d["rows"][1].update(flgas=["--prenorm"]), "row 2: unknown key 'flgas'; valid keys: baseline, model"),
    (lambda d: d.update(recipee="ted"), "unknown key 'recipee'"),
    (lambda d: d["rows"][0].update(schedule="val_decayy"), "unknown schedule 'val_decayy'; choose from"),
    (lambda d: d["rows"][1].update(baseline="PostNorm"), "unknown baseline 'PostNorm'"),
    (lambda d: d.update(recipe="gpu"), "unknown recipe 'gpu'"),
    (lambda d: d["rows"].append(dict(d["rows"][0])), "duplicate row name"),
    (lambda d: d["rows"][0].update(model="--prenorm"), "expected a list of strings"),
    (lambda d: d.update(pairs=["glen"]), "'pairs' must list language pairs"),
])
def test_config_errors_name_the_problem(config_copy, change, message):
    edit_table(config_copy, "table3", change)
    with pytest.raises(NormplugError, match=".*") as error:
        load_table("table3", str(config_copy))
    assert message in str(error.value) and "table3.json" in str(error.value)


def test_unknown_table_and_recipe_key(config_copy):
    with pytest.raises(NormplugError, match="unknown table 'table9'; choose from beyond, demo, table2"):
        load_table("table9", str(config_copy))
    recipes = json.loads((config_copy / "recipes.json").read_text())
    recipes["ted"]["generte"] = []
    (config_copy / "recipes.json").write_text(json.dumps(recipes))
    with pytest.raises(NormplugError, match="recipe 'ted': unknown key 'generte'"):
        load_table("table3", str(config_copy))


def test_progress_line_summarises_validation_records():
    run = type("FakeRun", (), {"label": "demo | row"})()
    prefix = "2026-11-30 08:26:27 | INFO | valid | "
    record = {"valid_loss": "4.608", "valid_bleu": "4.48", "valid_num_updates": "200"}
    assert progress_line(run, prefix + json.dumps(record)) == (
        "[demo | row] update 200, dev loss 4.608, dev BLEU 4.48")
    record["valid_best_bleu"] = "5.1"
    assert progress_line(run, prefix + json.dumps(record)).endswith("dev BLEU 4.48 (best 5.1)")
    assert progress_line(run, "2026-11-30 | INFO | train_inner | {}") is None
