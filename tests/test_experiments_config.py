"""Experiment configs: every shipped table loads, and typos are errors naming the key."""
import json
import shutil

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import CONFIG_DIR, available_tables, load_recipes, load_table
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


def test_lr_scale_scales_nowarmup_lr_and_keeps_the_eq7_peak():
    """cpu_converge: NoWarmup's 3e-4 times 2 sqrt(512/64); the warmup rows' peak is eq. 7's
    2xLR peak at d=64 (lambda 2, 8k warmup), reached over a 20x shorter warmup."""
    table = load_table("cpu")
    recipe = table.recipe
    flags = scaled_schedule_flags(table.schedules["no_warmup"], recipe)
    assert float(flags[flags.index("--lr") + 1]) == pytest.approx(2 * 3e-4 * (512 / 64) ** 0.5, rel=1e-3)
    flags = scaled_schedule_flags(table.schedules["inv_sqrt_decay"], recipe)
    warmup, lam = int(flags[flags.index("--warmup-updates") + 1]), float(flags[flags.index("--lr-lambda") + 1])
    assert warmup == 400
    assert lam * (64 * warmup) ** -0.5 == pytest.approx(2 * (64 * 8000) ** -0.5, rel=1e-3)


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
    (lambda d: d.update(pairs=["glen"]), "'pairs': bad language pair 'glen'"),
])
def test_config_errors_name_the_problem(config_copy, change, message):
    edit_table(config_copy, "table3", change)
    with pytest.raises(NormplugError, match=".*") as error:
        load_table("table3", str(config_copy))
    assert message in str(error.value) and "table3.json" in str(error.value)


def test_unknown_table_and_recipe_key(config_copy):
    with pytest.raises(NormplugError, match="unknown table .table9.; choose from beyond, cpu, demo, depth, table2"):
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


# --- recipes: base + differences, per pair; what the runner derives from them ------------

def _run(table_name, pair, data_dir, row=0):
    from fairseq_normplug.experiments.runner import Run

    table = load_table(table_name)
    return Run(table=table, row=table.rows[row], pair=pair, data_dir=str(data_dir), run_dir=str(data_dir / "run"))


def _value(command, flag):
    from fairseq_normplug.experiments.runner import last_flag_value

    return last_flag_value(command, flag)


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt", "versions": {
        "sentencepiece": "0.2.0"}}))  # a method's name elsewhere in the text does not count
    return tmp_path


def test_recipes_are_a_base_plus_differences():
    recipes = load_recipes()
    ted, iwslt = recipes["ted"], recipes["iwslt15"]
    assert iwslt.base == "ted" and iwslt.pairs == ["en-vi"] and iwslt.decoding == ted.decoding
    differ = {f for f in ted.train if f.startswith("--") and _value(ted.train, f) != _value(iwslt.train, f)}
    assert differ == {"--max-update", "--validate-interval-updates"}
    assert _value(iwslt.train, "--validate-interval-updates") == "1500"
    assert "--word-dropout" in ted.train and "--word-dropout" not in recipes["wmt14"].train
    assert ted.decoding == {"beam": 4, "gnmt_alpha": 0.6, "gnmt_search": True, "max_len_a": 1, "max_len_b": 50}
    assert recipes["wmt14"].decoding == {"beam": 4, "lenpen": 0.6, "max_len_a": 0, "max_len_b": 200}


@pytest.mark.parametrize("name", [t for t in available_tables() if "en-vi" in load_table(t).pairs])
def test_en_vi_rows_use_the_iwslt15_recipe_in_every_table(name, data_dir):
    run = _run(name, "en-vi", data_dir)
    assert run.recipe.name == "iwslt15"
    command = run.train_command()
    assert _value(command, "--validate-interval-updates") == "1500"
    assert _value(command, "--save-interval-updates") == "1500" and _value(command, "--max-update") == "300000"
    if "gl-en" in load_table(name).pairs:
        assert _run(name, "gl-en", data_dir).recipe.name == "ted"


def test_dev_and_test_share_one_decoder_and_the_manifest_post_processing(data_dir):
    from fairseq_normplug.experiments.runner import generate_command

    for method in ("subword_nmt", "sentencepiece"):
        (data_dir / "manifest.json").write_text(json.dumps({"subword_method": method}))
        run = _run("table3", "gl-en", data_dir)
        train, test = run.train_command(), generate_command(run, "best.pt")
        dev_args = json.loads(_value(train, "--eval-bleu-args"))
        assert dev_args == {"beam": 4, "max_len_a": 1, "max_len_b": 50}  # source + 50, per sentence
        test_args = {k: _value(test, f"--{k.replace('_', '-')}") for k in dev_args}
        assert test_args == {k: str(v) for k, v in dev_args.items()}
        assert _value(train, "--gnmt-alpha") == _value(test, "--gnmt-alpha") == "0.6"
        assert "--gnmt-search" in train and "--gnmt-search" in test
        assert "--batch-length-cap" not in train + test
        assert "--eval-tokenized-bleu" in train and "--lenpen" not in test
        assert _value(train, "--eval-bleu-remove-bpe") == _value(test, "--remove-bpe") == method
        assert _value(train, "--task") == _value(test, "--task") == "translation_normplug"


def test_post_processing_of_older_and_bad_manifests(data_dir):
    from fairseq_normplug.experiments.runner import subword_method

    assert subword_method(str(data_dir)) == "subword_nmt"
    (data_dir / "manifest.json").write_text(json.dumps({"recipe": {"bpe": "sentencepiece"}}))  # version 1
    assert subword_method(str(data_dir)) == "sentencepiece"
    (data_dir / "manifest.json").write_text(json.dumps({"recipe": {}}))
    with pytest.raises(NormplugError, match="subword_method None is not one of subword_nmt, sentencepiece"):
        subword_method(str(data_dir))
    (data_dir / "manifest.json").unlink()
    with pytest.raises(NormplugError, match="no readable manifest.json"):
        subword_method(str(data_dir))


def test_checkpoints_are_saved_at_every_effective_validation(data_dir):
    run = _run("table3", "gl-en", data_dir)
    assert _value(run.train_command(), "--save-interval-updates") == "1000"
    command = run.train_command(["--validate-interval-updates=250"])
    assert _value(command, "--save-interval-updates") == "250" and _value(command, "--keep-interval-updates") == "1"


@pytest.mark.parametrize("extra,gpus,update_freq", [
    ([], 0, "7"), ([], 1, "7"), ([], 8, "1"), (["--distributed-world-size", "2"], 8, "4"),
    (["--max-tokens", "3584", "--distributed-world-size", "8"], 0, "1"),
])
def test_wmt14_update_freq_follows_the_world_size(data_dir, monkeypatch, extra, gpus, update_freq):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    run = _run("table6", "en-de", data_dir)
    command = run.train_command(extra)
    assert _value(command, "--update-freq") == update_freq
    world = int(_value(command, "--distributed-world-size") or max(gpus, 1))
    assert int(_value(command, "--max-tokens")) * world * int(update_freq) >= 28672
    assert _value(_run("table3", "gl-en", data_dir).train_command(), "--update-freq") == "1"


@pytest.mark.parametrize("change,message", [
    (lambda r: r["iwslt15"].update(base="tedd"), "recipe 'iwslt15': unknown base 'tedd'; choose from"),
    (lambda r: r["wmt14"].update(unset=["--word-dropot"]), "cannot unset '--word-dropot'"),
    (lambda r: r["ted"].update(base="cpu_small"), "base recipes form a cycle"),
    (lambda r: r["ted"]["decoding"].update(beem=4), "'decoding': unknown key 'beem'"),
    (lambda r: r["cpu_small"].update(pairs=["en-vi"]), "both replace 'ted' for en-vi"),
    (lambda r: r["ted"]["train"].update({"--max-update": 5}), "bad flag '--max-update': 5"),
])
def test_recipe_errors_name_the_problem(config_copy, change, message):
    recipes = json.loads((config_copy / "recipes.json").read_text())
    change(recipes)
    (config_copy / "recipes.json").write_text(json.dumps(recipes))
    with pytest.raises(NormplugError) as error:
        load_recipes(str(config_copy))
    assert message in str(error.value) and "recipes.json" in str(error.value)
