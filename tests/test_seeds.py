"""Several seeds per cell (reproduce.sh --seeds 1 2): results.csv has one line per seed,
results.md shows mean ± sd, the significance test uses every seed. Built from hand-made run
folders (fairseq-generate output, scores.json, status.json): nothing is trained."""
import csv
import dataclasses
import json
import os
import statistics

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu, tables
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.reproduce import figure_folders, figure_logs, result_rows
from fairseq_normplug.experiments.runner import Run, run_folder

SENTENCES = 40
WORDS = 8
BASE, SYSTEM = "PostNorm + LayerNorm + warmup", "PreNorm + FixNorm + ScaleNorm + NoWarmup"
CONFIG = "--prenorm schedule=inv_sqrt_decay"


def reference(i):
    return " ".join(f"w{i}_{j}" for j in range(WORDS))


REFS = [reference(i) for i in range(SENTENCES)]


def hypotheses(correct):
    """The first ``correct`` sentences translated exactly, the others all wrong (same length)."""
    return [REFS[i] if i < correct else " ".join(f"x{i}_{j}" for j in range(WORDS)) for i in range(SENTENCES)]


def write_run(run, correct=None, status="done"):
    """A finished (scored) run whose test output gets ``correct`` sentences right, or an
    unscored one with ``status``."""
    os.makedirs(run.run_dir, exist_ok=True)
    with open(run.path("status.json"), "w") as f:
        json.dump({"status": status, "updates": 100, "minutes": 1.5}, f)
    if correct is None:
        return
    hyps = hypotheses(correct)
    with open(run.path("generate-test.txt"), "w") as f:
        for i, (hyp, ref) in enumerate(zip(hyps, REFS)):
            f.write(f"S-{i}\tsource {i}\nT-{i}\t{ref}\nH-{i}\t-0.5\t{hyp}\nD-{i}\t-0.5\t{hyp}\n")
    scores = {**bleu.score_translation(hyps, REFS), "selected_update": 100, "dev_bleu": 10.0}
    with open(run.path("scores.json"), "w") as f:
        json.dump(scores, f)


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """The demo table's baseline and one system row with seeds 1 and 2. Seed 1 of the system
    is far better than seed 1 of the baseline; seed 2 is far worse than seed 2 of the
    baseline, so that over both seeds the two rows are close."""
    root = tmp_path_factory.mktemp("seeds")
    data = root / "data"
    (data / "ref").mkdir(parents=True)
    (data / "ref" / "test.tok.tgt").write_text("\n".join(REFS) + "\n")
    table = load_table("demo")
    correct = {(BASE, 1): 15, (BASE, 2): 15, (SYSTEM, 1): 30, (SYSTEM, 2): 2}
    runs = {}
    for (row, seed), count in correct.items():
        run = Run(table=table, row=table.row(row), pair="src-tgt", data_dir=str(data), seed=seed,
                  run_dir=run_folder(str(root / "runs"), "demo", "src-tgt", row, seed))
        write_run(run, count)
        runs[(row, seed)] = run
    return table, runs


def test_seed_two_flips_the_significance(demo_runs):
    table, runs = demo_runs
    seed1 = [runs[(BASE, 1)], runs[(SYSTEM, 1)]]
    both = [runs[(BASE, 1)], runs[(BASE, 2)], runs[(SYSTEM, 1)], runs[(SYSTEM, 2)]]
    p_seed1 = next(r for r in result_rows(table, seed1) if r["row"] == SYSTEM)["p_value"]
    rows = result_rows(table, both)
    system = [r for r in rows if r["row"] == SYSTEM]
    assert p_seed1 < 0.01  # seed 1 alone: the system is better
    assert [r["seed"] for r in system] == [1, 2] and system[0]["p_value"] == system[1]["p_value"] > 0.05
    # it is the bootstrap over the concatenated test sets of both seeds, seed k against seed k
    pooled = bleu.paired_bootstrap_seeds([hypotheses(15), hypotheses(15)], [hypotheses(30), hypotheses(2)], REFS)
    assert system[0]["p_value"] == pooled.p_value
    assert pooled.baseline_score == bleu.tokenized_bleu(hypotheses(15) * 2, REFS * 2).score
    assert pooled.system_score == bleu.tokenized_bleu(hypotheses(30) + hypotheses(2), REFS * 2).score
    assert all(r["p_value"] is None for r in rows if r["row"] == BASE)


def test_two_seeds_give_mean_and_sd_cells_and_one_csv_line_per_seed(demo_runs, tmp_path):
    table, runs = demo_runs
    rows = result_rows(table, list(runs.values()))
    csv_path, md_path = tables.write_results(rows, str(tmp_path), title="Demo, seeds 1 2")
    with open(csv_path, newline="") as f:
        lines = list(csv.DictReader(f))
    assert [(line["row"], line["seed"]) for line in lines] == [(BASE, "1"), (BASE, "2"), (SYSTEM, "1"), (SYSTEM, "2")]
    bleus = {(line["row"], int(line["seed"])): float(line["tokenized_bleu"]) for line in lines}
    assert bleus[(SYSTEM, 1)] > bleus[(BASE, 1)] > bleus[(SYSTEM, 2)]
    system = [bleus[(SYSTEM, 1)], bleus[(SYSTEM, 2)]]
    cell = f"{statistics.mean(system):.2f} \u00b1 {statistics.stdev(system):.2f}"
    md = open(md_path, encoding="utf-8").read()
    assert f"| {SYSTEM} | {cell} |" in md  # no dagger: not significant over both seeds
    assert f"| {BASE} | {bleus[(BASE, 1)]:.2f} \u00b1 0.00 |" in md
    assert "| table | row | config | pair | seed | status |" in md
    assert md.count(f"| demo | {SYSTEM} |") == 2


def test_a_cell_with_diverged_seeds_shows_the_finished_ones_and_counts_the_others(demo_runs, tmp_path):
    table, runs = demo_runs
    folder = str(tmp_path / "runs")
    extra = []
    for seed, status in ((3, "diverged"), (4, "failed")):
        run = Run(table=table, row=table.row(SYSTEM), pair="src-tgt", data_dir=runs[(BASE, 1)].data_dir,
                  seed=seed, run_dir=run_folder(folder, "demo", "src-tgt", SYSTEM, seed))
        write_run(run, status=status)
        extra.append(run)
    rows = result_rows(table, [runs[(BASE, 1)], runs[(SYSTEM, 1)], *extra])
    system = {r["seed"]: r for r in rows if r["row"] == SYSTEM}
    assert [system[s]["status"] for s in (1, 3, 4)] == ["ok", "diverged", "failed"]
    assert system[1]["p_value"] < 0.01 and system[3]["p_value"] is None
    _, md_path = tables.write_results(rows, str(tmp_path / "out"))
    md = open(md_path, encoding="utf-8").read()
    assert f"| {SYSTEM} | {system[1]['tokenized_bleu']:.2f}\u2021 [1/3 diverged, 1/3 failed] |" in md


def run_row(row, seed, status="ok", **fields):
    return {"table": "t", "pair": "aa-bb", "row": row, "config": CONFIG, "seed": seed, "status": status, **fields}


def test_cells_of_several_seeds(tmp_path):
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb"]}}}
    rows = [run_row("Three", 1, tokenized_bleu=20.0, p_value=0.03, p_value_adjusted=0.03, length_ratio=1.0),
            run_row("Three", 2, tokenized_bleu=21.0, p_value=0.03, p_value_adjusted=0.03, length_ratio=2.5),
            run_row("Three", 3, tokenized_bleu=23.0, p_value=0.03, p_value_adjusted=0.03),
            run_row("Diverged", 1, "diverged"), run_row("Diverged", 2, "diverged"),
            run_row("Mixed", 1, "diverged"), run_row("Mixed", 2, "running"),
            run_row("Lone", 1, "diverged"), run_row("Lone", 2, tokenized_bleu=12.5)]
    _, md_path = tables.write_results(rows, str(tmp_path), paper)
    md = open(md_path, encoding="utf-8").read()
    assert f"| Three | 21.33 \u00b1 1.53\u2020{tables.LENGTH_MARK} |" in md  # sample sd of 20, 21, 23
    assert "| Diverged | *2/2 diverged* |" in md
    assert "| Mixed | *1/2 diverged, 1/2 running* |" in md
    assert "| Lone | 12.50 [1/2 diverged] |" in md
    assert "Three (t, aa-bb, seed 2): 2.50" in md  # the length footnote names the seed

    with pytest.raises(NormplugError, match="two results for t row 'Three' pair 'aa-bb' seed 2"):
        tables.write_results(rows + [run_row("Three", 2, tokenized_bleu=1.0)], str(tmp_path / "twice"), paper)


def test_one_seed_renders_as_without_seeds(tmp_path):
    """Seed 1 alone (or no seed field, as in a CSV written before seeds): no seed column, plain cells."""
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb"]}}}
    with_seed = [run_row("R", 1, tokenized_bleu=20.0, p_value=0.003, p_value_adjusted=0.003)]
    without = [{k: v for k, v in with_seed[0].items() if k != "seed"}]
    first, second = (tables.write_results(rows, str(tmp_path / name), paper)[1]
                     for name, rows in (("a", with_seed), ("b", without)))
    md = open(first, encoding="utf-8").read()
    assert md == open(second, encoding="utf-8").read()
    assert "| R | 20.00\u2021 |" in md and "\u00b1" not in md.split("## Runs")[0].split("Table T")[1]
    assert "| table | row | config | pair | status |" in md
    assert tables.read_results_csv(os.path.join(tmp_path, "b", "results.csv"))[0]["seed"] == 1


def test_figure_logs_group_the_seeds_of_a_row(demo_runs):
    table, runs = demo_runs
    for run in runs.values():
        open(run.path("train.log"), "w").close()
    logs = figure_logs(list(runs.values()))
    assert logs == {BASE: [runs[(BASE, 1)].path("train.log"), runs[(BASE, 2)].path("train.log")],
                    SYSTEM: [runs[(SYSTEM, 1)].path("train.log"), runs[(SYSTEM, 2)].path("train.log")]}


def test_a_table_of_several_pairs_draws_one_set_of_figures_per_pair(demo_runs, tmp_path):
    """Two pairs' BLEU share no scale: each pair's figures go into results_dir/PAIR, with the
    row names as labels; a one-pair table keeps its figures in results_dir."""
    table, runs = demo_runs
    mine = list(runs.values())
    other = [dataclasses.replace(run, pair="xx-yy", run_dir=str(tmp_path / f"{i}")) for i, run in enumerate(mine)]
    for run in other:
        os.makedirs(run.run_dir)
        open(run.path("train.log"), "w").close()
    assert figure_folders(mine, "out") == {"out": mine}
    folders = figure_folders(mine + other, "out")
    assert folders == {os.path.join("out", "src-tgt"): mine, os.path.join("out", "xx-yy"): other}
    assert figure_logs(folders[os.path.join("out", "xx-yy")]) == {
        BASE: [other[0].path("train.log"), other[1].path("train.log")],
        SYSTEM: [other[2].path("train.log"), other[3].path("train.log")]}


def test_copies_of_one_seed_are_no_more_evidence_than_that_seed():
    """Source sentences are resampled with all their seeds' translations: three identical seeds
    give exactly the one-seed p-value; resampling the 3 x 40 concatenated sentences as if
    independent (uniform) would make the same evidence look far more significant."""
    base, system = hypotheses(15), hypotheses(17)
    one = bleu.paired_bootstrap_seeds([base], [system], REFS)
    assert one == bleu.paired_bootstrap(base, system, REFS)  # sacreBLEU's test, to the last digit
    three = bleu.paired_bootstrap_seeds([base] * 3, [system] * 3, REFS)
    assert three.p_value == one.p_value and three.system_score == pytest.approx(one.system_score)
    assert "training_seeds:3" in three.signature
    uniform = bleu.paired_bootstrap(base * 3, system * 3, REFS * 3)
    assert uniform.p_value < one.p_value / 5


def test_bootstrap_over_seeds_and_in_other_metrics():
    refs = ["the rich-text editor works well today", "a well-known man came home late"]
    base = ["the rich-text editor works badly today", "a well-known woman came home late"]
    system = ["the rich-text editor works well today", "a well-known man went home late"]
    one = bleu.paired_bootstrap(base, system, refs, n_samples=100)
    assert bleu.paired_bootstrap_seeds([base], [system], refs, n_samples=100) == one
    split = bleu.paired_bootstrap(base, system, refs, n_samples=100, metric="compound_split_bleu")
    assert split.baseline_score == pytest.approx(bleu.compound_split_bleu(base, refs).score)
    assert split.baseline_score != pytest.approx(one.baseline_score)
    with pytest.raises(NormplugError, match="same number .* of baseline and system seeds, got 1 and 2"):
        bleu.paired_bootstrap_seeds([base], [system, system], refs)
    with pytest.raises(NormplugError, match="unknown metric 'ter'.*tokenized_bleu, compound_split_bleu"):
        bleu.paired_bootstrap(base, system, refs, metric="ter")
    assert set(bleu.METRIC_SCORERS) == set(tables.CELL_METRICS)


def test_the_seeds_test_counts_the_splits_of_the_pooled_scores():
    """Exact permutation test over seeds: p is the share of the C(n+m, n) splits of the pooled
    per-seed scores whose |mean difference| is at least the observed one."""
    assert bleu.seeds_permutation_test([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)  # the smallest with 3 vs 3
    assert bleu.seeds_permutation_test([4, 5, 6], [1, 2, 3]) == pytest.approx(2 / 20)  # two-sided
    assert bleu.seeds_permutation_test([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(2 / 70)
    # docs/results.md, de-en: the baseline's seeds against PreNorm + FixNorm + ScaleNorm + NoWarmup's
    assert bleu.seeds_permutation_test([36.11, 35.11, 37.95], [37.86, 38.53, 37.23]) == pytest.approx(6 / 20)
    assert bleu.seeds_permutation_test([1, 2], [2, 1]) == 1.0
    assert bleu.seeds_permutation_test([30.0], [31.0, 32.0]) is None  # one seed has no spread to test against
    assert bleu.seeds_permutation_test([30.0, 31.0], []) is None
    # 12 seeds a row: C(24, 12) = 2.7 million splits, sampled (reproducibly) instead of listed
    low, high = [30.0 + i / 10 for i in range(12)], [32.0 + i / 10 for i in range(12)]
    sampled = bleu.seeds_permutation_test(low, high)
    assert sampled == bleu.seeds_permutation_test(low, high) == pytest.approx(1 / (1 + bleu.EXACT_PERMUTATION_LIMIT))
    assert 0.9 < bleu.seeds_permutation_test(low, [x + 0.01 for x in low]) < 1.0  # no difference to speak of


def test_result_rows_carry_the_seeds_test_into_the_csv_and_the_runs_list(demo_runs, tmp_path):
    table, runs = demo_runs
    # BLEU 37.5 and 37.5 (baseline) against 75 and 5: no other split of the four has closer means
    rows = result_rows(table, list(runs.values()))
    assert [r["seeds_p_value"] for r in rows] == [None, None, 1.0, 1.0]
    # against 75 and 75 (a third seed as good as seed 1): 2 of the 6 splits are as far apart
    seed3 = Run(table=table, row=table.row(SYSTEM), pair="src-tgt", data_dir=runs[(BASE, 1)].data_dir, seed=3,
                run_dir=run_folder(str(tmp_path / "runs"), "demo", "src-tgt", SYSTEM, 3))
    write_run(seed3, 30)
    rows = result_rows(table, [runs[(BASE, 1)], runs[(BASE, 2)], runs[(SYSTEM, 1)], seed3])
    system = [r for r in rows if r["row"] == SYSTEM]
    assert [r["tokenized_bleu"] for r in rows] == pytest.approx([37.5, 37.5, 75.0, 75.0])
    assert [r["seeds_p_value"] for r in system] == pytest.approx([2 / 6, 2 / 6])
    assert all(r["seeds_p_value"] is None for r in result_rows(table, [runs[(BASE, 1)], runs[(SYSTEM, 1)]]))
    csv_path, md_path = tables.write_results(rows, str(tmp_path / "out"))
    assert [r["seeds_p_value"] for r in tables.read_results_csv(csv_path)] == pytest.approx([None, None, 1 / 3, 1 / 3])
    md = open(md_path, encoding="utf-8").read()
    assert "| hyp/ref | p | p (seeds) |" in md
    assert md.count(f"| {system[0]['p_value']:.3g} | 0.333 |") == 2
