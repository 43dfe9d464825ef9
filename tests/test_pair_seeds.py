"""Issue 54, the last part: ``reproduce.sh TABLE --seeds 1 2 3 az-en=1,2`` gives one pair other
seeds than the rest (de-en seeds 1-3, az-en seeds 1-2), in every mode (training,
--print-commands, --status, --preflight, --collect); a bad entry is refused in one line before
any work; a table collected that way shows no "pending" cell and says which seeds each pair's
cells are over; and no committed results.md under docs/results shows a pending run. Nothing is
trained: the data folders are fake and the finished runs hand-made (tests/test_seeds.py)."""
import csv
import glob
import json
import os

import pytest

from conftest import REPO
from fairseq_normplug.experiments import launchers, reproduce
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.runner import Run, run_folder
from test_seeds import BASE, REFS, SYSTEM, write_run

PER_PAIR = ["--seeds", "1", "2", "3", "az-en=1,2"]
#: the runs that --seeds 1 2 3 az-en=1,2 plans for every row of the cpu table
EXPECTED = [(pair, seed) for pair, seeds in (("de-en", (1, 2, 3)), ("az-en", (1, 2))) for seed in seeds]


def fake_pair(folder, pair):
    """A data folder of ``pair`` that passes the runner's checks, with REFS as test references."""
    src, tgt = pair.split("-")
    for path in (f"bin/dict.{src}.txt", f"bin/dict.{tgt}.txt", f"bin/train.{pair}.{src}.bin"):
        os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
        open(os.path.join(folder, path), "w").close()
    os.makedirs(os.path.join(folder, "ref"), exist_ok=True)
    with open(os.path.join(folder, "ref", f"test.tok.{tgt}"), "w") as f:
        f.write("\n".join(REFS) + "\n")
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"subword_method": "subword_nmt"}, f)
    return str(folder)


@pytest.fixture
def data(tmp_path):
    return {pair: fake_pair(tmp_path / "data" / pair, pair) for pair in ("de-en", "az-en")}


def argv(data, runs_dir, *more, pairs=()):
    return ["cpu", *pairs, "--data", f"de-en={data['de-en']}", "--data", f"az-en={data['az-en']}",
            "--runs-dir", str(runs_dir), *more]


def planned(runs):
    return sorted({(run.pair, run.seed) for run in runs}, key=EXPECTED.index)


def test_per_pair_seeds_plan_each_pairs_own_runs(data, tmp_path):
    seeds = reproduce.parse_seeds(["1", "2", "3", "az-en=1,2"])
    assert seeds.of("de-en") == (1, 2, 3) and seeds.of("az-en") == (1, 2)
    runs = reproduce.plan_runs(load_table("cpu"), ["de-en", "az-en"], data, str(tmp_path / "runs"), seeds=seeds)
    assert len(runs) == 5 * 5 and planned(runs) == EXPECTED
    assert not any(run.pair == "az-en" and run.seed == 3 for run in runs)
    # one list of seeds is every pair's, as before; a pair named alone keeps the default seed 1 elsewhere
    same = reproduce.plan_runs(load_table("cpu"), ["de-en", "az-en"], data, str(tmp_path / "runs"), seeds=[1, 2, 3])
    assert len(same) == 30 and {(r.pair, r.seed) for r in same} == {(p, s) for p in ("de-en", "az-en") for s in (1, 2, 3)}
    only = reproduce.parse_seeds(["az-en=2,4"])
    assert only.of("de-en") == (1,) and only.of("az-en") == (2, 4)


def test_print_commands_and_status_show_the_per_pair_runs(data, tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    reproduce.main(argv(data, runs_dir, *PER_PAIR, "--print-commands"))
    out = capsys.readouterr().out
    assert not runs_dir.exists()
    folders = [line.split("run folder: ")[1] for line in out.splitlines() if line.startswith("  run folder: ")]
    assert len(folders) == 25 and out.count("fairseq-train ") == 25
    assert sum("/az-en/" in f for f in folders) == 10 and not any("/az-en/" in f and f.endswith("-seed3")
                                                                    for f in folders)
    assert sum("/de-en/" in f and f.endswith("-seed3") for f in folders) == 5
    assert "[print-commands] 25 runs: 0 done (skipped), 0 to resume, 25 to train" in out
    reproduce.main(argv(data, runs_dir, *PER_PAIR, "--status"))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("[status] 25 runs: 25 pending")
    assert not any("az-en | " in line and "seed 3" in line for line in lines)


def test_preflight_and_training_plan_the_per_pair_runs(data, tmp_path, monkeypatch, capsys):
    seen = {}

    def preflight(self, runs, *args):
        seen["preflight"] = planned(runs)
        return {"problems": []}

    def execute(self, runs, extra, echo):
        seen["trained"] = planned(runs)

    monkeypatch.setattr(launchers.LocalLauncher, "preflight", preflight)
    monkeypatch.setattr(launchers.LocalLauncher, "execute", execute)
    reproduce.main(argv(data, tmp_path / "runs", *PER_PAIR, "--preflight"))
    with pytest.raises(SystemExit):  # nothing trained: every run failed
        reproduce.main(argv(data, tmp_path / "runs", *PER_PAIR, "--results-dir", str(tmp_path / "results")))
    assert seen == {"preflight": EXPECTED, "trained": EXPECTED}
    assert ("[reproduce] CPU convergence: the papers' main comparison, trained to convergence on 2 CPU cores: 25 "
            "runs (2 pairs x 5 rows; seeds de-en 1 2 3, az-en 1 2)") in capsys.readouterr().out


@pytest.mark.parametrize("seeds,message", [
    (["1", "az-en=1,x"], "--seeds az-en=1,x: 'x' is not a seed (a non-negative integer); write N ... or PAIR=N,N,..."),
    (["1", "az-en=-1"], "--seeds az-en=-1: '-1' is not a seed"),
    (["1", "az-en="], "--seeds az-en=: '' is not a seed"),
    (["two"], "--seeds two: 'two' is not a seed"),
    (["1", "1"], "--seeds must be distinct non-negative integers, got [1, 1]"),
    (["az-en=1,1"], "--seeds must be distinct non-negative integers, got az-en=1,1"),
    (["az-en=1,2", "az-en=1"], "--seeds names az-en twice (az-en=1,2 and az-en=1); give each pair one PAIR=N,N,... entry"),
    (["1", "fr-en=1,2"], "--seeds fr-en=1,2: fr-en is not a pair of this run; choose from de-en, az-en"),
    (["1", "../x=1"], "--seeds: bad language pair '../x'"),
])
def test_bad_seeds_are_refused_in_one_line_before_any_work(data, tmp_path, seeds, message):
    with pytest.raises(SystemExit) as exit_:
        reproduce.main(argv(data, tmp_path / "runs", "--seeds", *seeds, "--print-commands"))
    assert str(exit_.value.code).startswith(f"reproduce.sh: error: {message}") and "\n" not in str(exit_.value.code)
    assert not (tmp_path / "runs").exists()


def test_a_pair_not_run_here_is_refused(data, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        reproduce.main(argv(data, tmp_path / "runs", *PER_PAIR, "--collect", pairs=["de-en"]))
    assert str(exit_.value.code) == ("reproduce.sh: error: --seeds az-en=1,2: az-en is not a pair of this run; "
                                     "choose from de-en")
    assert not (tmp_path / "runs").exists()


def test_a_table_collected_with_per_pair_seeds_shows_no_pending_cell_and_names_its_seeds(data, tmp_path, capsys):
    """de-en has seeds 1-3 finished, az-en seeds 1-2 (seed 3 never trained), as docs/results/cpu."""
    table, runs_dir = load_table("cpu"), tmp_path / "runs"
    correct = {BASE: (15, 16, 14), SYSTEM: (30, 28, 31)}
    for pair, seed in EXPECTED:
        for row in (BASE, SYSTEM):
            write_run(Run(table=table, row=table.row(row), pair=pair, data_dir=data[pair], seed=seed,
                          run_dir=run_folder(str(runs_dir), "cpu", pair, row, seed)), correct[row][seed - 1])
    rows = ["--rows", BASE, SYSTEM]
    reproduce.main(argv(data, runs_dir, *rows, *PER_PAIR, "--collect", "--results-dir", str(tmp_path / "per-pair")))
    assert "collected 10 of 10 runs with a result" in capsys.readouterr().out
    md = (tmp_path / "per-pair" / "results.md").read_text(encoding="utf-8")
    assert "pending" not in md
    assert ("Seeds: de\u2192en cells over seeds 1, 2, 3; az\u2192en cells over seeds 1, 2 (the pairs were collected "
            "with different seeds: reproduce.sh --seeds PAIR=N,N,...).") in md
    with open(tmp_path / "per-pair" / "results.csv", encoding="utf-8") as f:
        lines = list(csv.DictReader(f))
    assert sorted((line["pair"], int(line["seed"])) for line in lines if line["row"] == BASE) == sorted(EXPECTED)
    assert {line["status"] for line in lines} == {"ok"}
    # the default, one list of seeds for both pairs: az-en seed 3 is a pending run, as before
    reproduce.main(argv(data, runs_dir, *rows, "--seeds", "1", "2", "3", "--collect",
                        "--results-dir", str(tmp_path / "same")))
    same = (tmp_path / "same" / "results.md").read_text(encoding="utf-8")
    assert same.count("[1/3 pending]") == 2 and "Seeds: every cell over seeds 1, 2, 3." in same
    # the cells and p-values of the finished runs are the same either way
    with open(tmp_path / "same" / "results.csv", encoding="utf-8") as f:
        assert [line for line in csv.DictReader(f) if line["status"] != "pending"] == lines


def test_no_committed_results_table_shows_a_pending_run():
    tables = glob.glob(os.path.join(REPO, "docs", "results", "**", "results.md"), recursive=True)
    assert len(tables) >= 3
    for path in tables:
        with open(path, encoding="utf-8") as f:
            assert "pending" not in f.read(), path
