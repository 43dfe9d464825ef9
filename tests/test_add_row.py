"""``reproduce.sh TABLE --add-row "NAME=FLAGS" --normplug-modules PATH``: a researcher's own row
(here the example extension's partial RMSNorm, from outside the package) beside a table's rows,
with the table's recipe and seeds, compared with its baseline; the table's finished runs are
reused, so only the new row trains, and one results.md holds them all. The runner's fairseq
commands run in forked children of this process (tests/inprocess.py's forked_commands)."""
import csv
import json
import os

import pytest

from conftest import REPO, write_configs
from inprocess import forked_commands
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import reproduce
from fairseq_normplug.experiments.configs import load_table, with_added_rows
from fairseq_normplug.experiments.reproduce import run_table

EXTENSION = os.path.join(REPO, "examples", "normplug_extension", "normplug_extension_example")
BASELINE = "PostNorm + LayerNorm"
OURS = "PreNorm + pRMSNorm"
TABLE = {"title": "A baseline", "recipe": "test_add_row", "pairs": ["src-tgt"],
         "rows": [{"name": BASELINE, "model": [], "schedule": "inv_sqrt_decay"},
                  {"name": "PreNorm", "model": ["--prenorm"], "schedule": "inv_sqrt_decay", "baseline": BASELINE}]}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    recipe = {"base": "cpu_tiny", "decoding": {"beam": 2}, "generate": {"--max-tokens": "4000"},
              "train": {"--max-update": "10", "--validate-interval-updates": "10"}}
    config_dir = write_configs(tmp_path_factory.mktemp("configs") / "configs", {"test_add_row": recipe},
                               {"small": TABLE})
    return load_table("small", config_dir)


def test_added_rows_get_the_recipe_the_baseline_and_the_extension(table):
    added = with_added_rows(table, [f"{OURS}=--prenorm --norm-type prmsnorm --prms-p '0.5'"], [EXTENSION])
    row = added.row(OURS)
    assert row.model == ["--prenorm", "--norm-type", "prmsnorm", "--prms-p", "0.5", "--normplug-modules", EXTENSION]
    assert row.baseline == BASELINE and row.schedule == "inv_sqrt_decay"
    assert [r.name for r in added.rows] == [BASELINE, "PreNorm", OURS] and added.recipe == table.recipe
    assert with_added_rows(table, ["X=--prenorm"], schedule="no_warmup").row("X").schedule == "no_warmup"


def test_a_table_names_its_extensions(table, tmp_path):
    """``"normplug_modules"`` on a table (every row) or a row, relative to the project folder."""
    data = {**TABLE, "recipe": "cpu_tiny", "normplug_modules": ["examples/normplug_extension/normplug_extension_example"],
            "rows": [TABLE["rows"][0], {**TABLE["rows"][1], "normplug_modules": ["my_pkg.norms"]}]}
    write_configs(tmp_path / "configs", tables={"own": data})
    own = load_table("own", str(tmp_path / "configs"))
    assert own.rows[0].model == ["--normplug-modules", EXTENSION]
    assert own.rows[1].model == ["--prenorm", "--normplug-modules", f"{EXTENSION},my_pkg.norms"]
    data["rows"][0]["normplug_modules"] = "x.py"
    (tmp_path / "configs" / "experiments" / "own.json").write_text(json.dumps(data))
    with pytest.raises(NormplugError, match="row 1: normplug_modules: expected a list of strings"):
        load_table("own", str(tmp_path / "configs"))


@pytest.mark.parametrize("spec,schedule,message", [
    ("PreNorm=--prenorm", None, "--add-row 'PreNorm': the table small already has a row of that name"),
    ("--prenorm", None, "--add-row '--prenorm': write it as \"NAME=FLAGS\""),
    ("X=--prenorm 'oops", None, "--add-row 'X': its flags do not parse as a shell line"),
    ("X=--prenorm", "warmupp", "unknown --add-row-schedule 'warmupp'; choose from"),
])
def test_bad_added_rows_are_refused_in_one_line(table, spec, schedule, message):
    with pytest.raises(NormplugError) as error:
        with_added_rows(table, [spec], schedule=schedule)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("argv,message", [
    (["--normplug-modules", EXTENSION], "--normplug-modules names the extensions of rows added with --add-row"),
    (["--add-row", "X=--prenorm", "--normplug-modules", "/no/such/ext.py"], "the extension module /no/such/ext.py "
                                                                            "does not exist"),
])
def test_the_command_line_refuses_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        reproduce.main(["cpu", "--print-commands", *argv])
    assert message in str(exit_.value) and "\n" not in str(exit_.value)


@pytest.mark.slow
def test_only_the_new_row_trains_and_one_table_holds_all(table, tiny_data_dir, tmp_path):
    runs, data = str(tmp_path / "runs"), {"src-tgt": tiny_data_dir}
    with forked_commands():
        run_table(table, ["src-tgt"], data, runs, str(tmp_path / "before"), echo=lambda message: None)
    kept = {name: os.path.getmtime(os.path.join(runs, "small", "src-tgt", name, "train.log"))
            for name in os.listdir(os.path.join(runs, "small", "src-tgt"))}
    messages = []
    added = with_added_rows(table, [f"{OURS}=--prenorm --norm-type prmsnorm --prms-p 0.5"], [EXTENSION])
    with forked_commands():
        run_table(added, ["src-tgt"], data, runs, str(tmp_path / "after"), echo=messages.append)
    trained = [m for m in messages if "training" in m]
    assert len(trained) == 1 and OURS in trained[0], messages
    for name, mtime in kept.items():
        assert os.path.getmtime(os.path.join(runs, "small", "src-tgt", name, "train.log")) == mtime, name
    with open(tmp_path / "after" / "results.csv") as f:
        rows = {row["row"]: row for row in csv.DictReader(f)}
    assert set(rows) == {BASELINE, "PreNorm", OURS} and rows[OURS]["status"] == "ok"
    assert 0 <= float(rows[OURS]["p_value"]) <= 1 and "--norm-type prmsnorm" in rows[OURS]["config"]
    assert OURS in (tmp_path / "after" / "results.md").read_text()


# --------------------------------------------------------------------------- issue 50: no two results in one place


def test_an_added_row_that_maps_to_a_table_rows_folder_is_refused_in_one_line(table, capsys):
    """``--rows "PreNorm + DyT" --add-row "PreNorm DyT=--prenorm"``: both are ``prenorm-dyt``; the
    added row would be skipped as done and given the DyT run's score. Refused before any work,
    naming both rows and the folder."""
    with pytest.raises(NormplugError) as error:
        with_added_rows(table, ["PRENORM=--prenorm --scalenorm"])
    assert str(error.value).startswith("--add-row 'PRENORM' and the row 'PreNorm' of small map to one run folder "
                                       "('prenorm')") and "\n" not in str(error.value)
    with pytest.raises(NormplugError, match="--add-row 'B b' and the row 'b-B' of small map to one run folder"):
        with_added_rows(table, ["b-B=--prenorm", "B b=--prenorm --scalenorm"])
    with pytest.raises(NormplugError, match=r"--add-row '\+\+': its name needs letters or digits"):
        with_added_rows(table, ["++=--prenorm"])
    with pytest.raises(SystemExit) as exit_:
        reproduce.main(["table3", "--rows", "PreNorm + DyT", "--add-row", "PreNorm DyT=--prenorm", "--print-commands"])
    assert str(exit_.value) == ("reproduce.sh: error: --add-row 'PreNorm DyT' and the row 'PreNorm + DyT' of table3 "
                                "map to one run folder ('prenorm-dyt'): one run's result would be reported for both; "
                                "rename the added row")
    assert capsys.readouterr().out == ""


def test_a_seed_folder_or_a_repeated_row_that_clashes_is_refused_before_any_work(table, tmp_path):
    """Row ``PreNorm`` seed 2 and a row ``PreNorm seed2`` are both ``prenorm-seed2``; ``--rows A A``
    would run one folder twice: both refused in one line, naming the runs and the folder."""
    clashing = with_added_rows(table, ["PreNorm seed2=--prenorm --scalenorm"])
    data = {"src-tgt": str(tmp_path / "data")}
    with pytest.raises(NormplugError) as error:
        reproduce.plan_runs(clashing, ["src-tgt"], data, str(tmp_path / "runs"), seeds=(1, 2), check_data=False)
    folder = os.path.join(str(tmp_path / "runs"), "small", "src-tgt", "prenorm-seed2")
    assert str(error.value) == (f"runs 'small src-tgt | PreNorm | seed 2' and 'small src-tgt | PreNorm seed2' map to "
                                f"one run folder ({folder}): one run's result would be reported for both; "
                                f"rename one row")
    assert not (tmp_path / "runs").exists()
    assert len(reproduce.plan_runs(clashing, ["src-tgt"], data, str(tmp_path / "runs"), check_data=False)) == 3
    with pytest.raises(NormplugError, match="^--rows names 'PreNorm' twice; name each row once$"):
        reproduce.plan_runs(table, ["src-tgt"], data, str(tmp_path / "runs"), ["PreNorm", "PreNorm"],
                            check_data=False)
