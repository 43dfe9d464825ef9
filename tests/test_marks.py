"""Significance marks a reviewer accepts (issue 52): a cell's mark comes from a paired bootstrap
that resamples test sentences and training seeds together (bleu.seed_aware_bootstrap; with one
seed a row, sacreBLEU's paired bootstrap). Run folders are made by hand as in test_seeds.py
(fairseq-generate output, scores.json, status.json): nothing is trained."""
import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu, tables
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.reproduce import result_rows
from fairseq_normplug.experiments.runner import Run, run_folder

from test_seeds import REFS, hypotheses, write_run

BASE, SYSTEM = "PostNorm + LayerNorm + warmup", "PreNorm + FixNorm + ScaleNorm + NoWarmup"
#: sentences right per seed: the system beats the baseline on both seeds, by 15 and by 3
#: sentences; pooled over the seeds' test sets the difference looks certain (p = 0.001), but the
#: seeds disagree on its size, and with resampled seeds it is not significant (p 0.053)
CORRECT = {(BASE, 1): 15, (BASE, 2): 15, (SYSTEM, 1): 30, (SYSTEM, 2): 18}


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("marks")
    data = root / "data"
    (data / "ref").mkdir(parents=True)
    (data / "ref" / "test.tok.tgt").write_text("\n".join(REFS) + "\n")
    table = load_table("demo")
    runs = {}
    for (row, seed), count in CORRECT.items():
        run = Run(table=table, row=table.row(row), pair="src-tgt", data_dir=str(data), seed=seed,
                  run_dir=run_folder(str(root / "runs"), "demo", "src-tgt", row, seed))
        write_run(run, count)
        runs[(row, seed)] = run
    return table, runs


def test_one_seed_a_row_is_sacrebleus_paired_bootstrap():
    base, system = hypotheses(15), hypotheses(19)
    ours = bleu.seed_aware_bootstrap([base], [system], REFS, n_samples=2000)
    theirs = bleu.paired_bootstrap(base, system, REFS, n_samples=2000)  # sacrebleu.significance.PairedTest
    assert ours.p_value == theirs.p_value
    assert (ours.baseline_score, ours.system_score) == (theirs.baseline_score, theirs.system_score)
    assert ours.difference == pytest.approx(theirs.system_score - theirs.baseline_score)
    same = bleu.seed_aware_bootstrap([base], [base], REFS, n_samples=100)
    assert same.p_value == 1.0 and same.diff_ci_low == same.diff_ci_high == 0.0


def test_resampling_seeds_widens_the_test_of_seeds_that_disagree():
    base, system = [hypotheses(15)] * 2, [hypotheses(30), hypotheses(18)]
    pooled = bleu.paired_bootstrap_seeds(base, system, REFS)
    aware = bleu.seed_aware_bootstrap(base, system, REFS)
    assert pooled.p_value < 0.01 < 0.05 < aware.p_value
    assert aware.difference == pytest.approx((75.0 + 45.0) / 2 - 37.5)  # the cells' mean BLEU
    # seeds that agree: every resample keeps the system ahead
    agree = bleu.seed_aware_bootstrap(base, [hypotheses(30), hypotheses(29)], REFS)
    assert agree.p_value < 0.01
    # copies of one seed are no more evidence than that seed, with its own resamples
    one = bleu.seed_aware_bootstrap([hypotheses(15)], [hypotheses(18)], REFS, n_samples=500)
    three = bleu.seed_aware_bootstrap([hypotheses(15)] * 3, [hypotheses(18)] * 3, REFS, n_samples=500)
    assert three.p_value == one.p_value and three.difference == pytest.approx(one.difference)
    assert "training_seeds:3+3" in three.signature and "bs:500" in three.signature


def test_rows_with_different_numbers_of_seeds_and_bad_input():
    result = bleu.seed_aware_bootstrap([hypotheses(15)] * 3, [hypotheses(30), hypotheses(28)], REFS, n_samples=200)
    assert (result.baseline_seeds, result.system_seeds) == (3, 2) and result.p_value < 0.05
    with pytest.raises(NormplugError, match="needs >= 1 seed of each row, got 1 baseline and 0 system"):
        bleu.seed_aware_bootstrap([hypotheses(15)], [], REFS)
    with pytest.raises(NormplugError, match="n_samples >= 40 .* got 10"):
        bleu.seed_aware_bootstrap([hypotheses(15)], [hypotheses(16)], REFS, n_samples=10)
    with pytest.raises(NormplugError, match="unknown metric 'ter'"):
        bleu.seed_aware_bootstrap([hypotheses(15)], [hypotheses(16)], REFS, n_samples=100, metric="ter")


def test_the_mark_follows_the_seed_aware_test_not_the_pooled_bootstrap(seed_runs, tmp_path):
    table, runs = seed_runs
    rows = result_rows(table, list(runs.values()))
    system = [r for r in rows if r["row"] == SYSTEM]
    aware = bleu.seed_aware_bootstrap([hypotheses(15)] * 2, [hypotheses(30), hypotheses(18)], REFS)
    assert [r["p_value_seed_aware"] for r in system] == [aware.p_value] * 2
    assert system[0]["p_value"] < 0.01 < 0.05 < system[0]["p_value_seed_aware"]
    assert all(r["p_value_seed_aware"] is None for r in rows if r["row"] == BASE)
    csv_path, md_path = tables.write_results(rows, str(tmp_path))
    assert [r["p_value_seed_aware"] for r in tables.read_results_csv(csv_path)] == [None, None, aware.p_value, aware.p_value]
    md = open(md_path, encoding="utf-8").read()
    assert f"| {SYSTEM} | 60.00 \u00b1 21.21 |" in md  # no mark, though the pooled bootstrap gives 0.001
    # seed 1 alone: one seed a row, the paired bootstrap over sentences marks it
    one = result_rows(table, [runs[(BASE, 1)], runs[(SYSTEM, 1)]])
    assert one[1]["p_value_seed_aware"] == bleu.seed_aware_bootstrap([hypotheses(15)], [hypotheses(30)], REFS).p_value < 0.01
    _, md_path = tables.write_results(one, str(tmp_path / "one"))
    assert f"| {SYSTEM} | 75.00\u2021 |" in open(md_path, encoding="utf-8").read()


def test_holm_adjusts_step_down_and_keeps_the_order():
    # sorted 0.005, 0.01, 0.03, 0.04 of m = 4: x4, x3, x2, x1, each at least the one before
    assert bleu.holm_adjust([0.01, None, 0.04, 0.03, 0.005]) == pytest.approx([0.03, None, 0.06, 0.06, 0.02])
    assert bleu.holm_adjust([0.2, 0.9]) == pytest.approx([0.4, 0.9])
    assert bleu.holm_adjust([0.6, 0.7]) == [1.0, 1.0]
    assert bleu.holm_adjust([None]) == [None] and bleu.holm_adjust([]) == []
    with pytest.raises(NormplugError, match="p-value 1.5 outside"):
        bleu.holm_adjust([0.1, 1.5])


DYT = "PreNorm + DyT"


def _one_seed_runs(tmp_path, correct):
    data = tmp_path / "data"
    (data / "ref").mkdir(parents=True, exist_ok=True)
    (data / "ref" / "test.tok.tgt").write_text("\n".join(REFS) + "\n")
    table = load_table("demo")
    runs = []
    for row, count in correct.items():
        run = Run(table=table, row=table.row(row), pair="src-tgt", data_dir=str(data), seed=1,
                  run_dir=run_folder(str(tmp_path / "runs"), "demo", "src-tgt", row, 1))
        write_run(run, count)
        runs.append(run)
    return table, runs


def test_marks_use_the_holm_adjusted_p_over_the_tables_comparisons(tmp_path):
    """Two rows each 4 of 40 sentences ahead of the baseline: p = 0.045 each, a dagger alone,
    none once Holm's correction counts both comparisons (0.045 x 2 = 0.09)."""
    table, runs = _one_seed_runs(tmp_path, {BASE: 15, SYSTEM: 19, DYT: 19})
    rows = result_rows(table, runs)
    single = bleu.seed_aware_bootstrap([hypotheses(15)], [hypotheses(19)], REFS).p_value
    assert 0.01 < single < 0.05
    assert [r["p_value_seed_aware"] for r in rows] == [None, single, single]
    assert [r["p_value_adjusted"] for r in rows] == pytest.approx([None, 2 * single, 2 * single])
    assert [r["p_value"] for r in rows][1:] == [bleu.paired_bootstrap(hypotheses(15), hypotheses(19), REFS).p_value] * 2
    csv_path, md_path = tables.write_results(rows, str(tmp_path / "both"))
    assert [r["p_value_adjusted"] for r in tables.read_results_csv(csv_path)] == pytest.approx([None, 2 * single, 2 * single])
    md = open(md_path, encoding="utf-8").read()
    assert f"| {SYSTEM} | 47.50 |" in md and f"| {DYT} | 47.50 |" in md
    assert "Holm-adjusted over the 2 compared cells of this table" in md
    assert "| hyp/ref | p | p (adj.) |" in md and f"| {2 * single:.3g} |" in md
    assert "Holm-adjusted over all the table's compared cells" in md  # the legend
    # one comparison: nothing to adjust, the dagger stays
    alone = result_rows(table, runs[:2])
    assert alone[1]["p_value_adjusted"] == single
    _, md_path = tables.write_results(alone, str(tmp_path / "alone"))
    md = open(md_path, encoding="utf-8").read()
    assert f"| {SYSTEM} | 47.50\u2020 |" in md and "over the 1 compared cell of this table" in md


def test_every_mark_agrees_with_p_value_adjusted(seed_runs, tmp_path):
    """The 'Done when' check of issue 52 on a table: a cell is marked iff its adjusted p < 0.05."""
    table, runs = seed_runs
    extra = Run(table=table, row=table.row(DYT), pair="src-tgt", data_dir=runs[(BASE, 1)].data_dir, seed=1,
                run_dir=run_folder(str(tmp_path / "runs"), "demo", "src-tgt", DYT, 1))
    write_run(extra, 30)
    rows = result_rows(table, [*runs.values(), extra])
    _, md_path = tables.write_results(rows, str(tmp_path))
    md = open(md_path, encoding="utf-8").read().split("## Runs")[0]
    for row in (SYSTEM, DYT):
        p = next(r["p_value_adjusted"] for r in rows if r["row"] == row)
        line = next(line for line in md.splitlines() if line.startswith(f"| {row} |"))
        assert (tables.significance_mark(p) in line if p < 0.05 else "\u2020" not in line and "\u2021" not in line)
    assert next(r["p_value_adjusted"] for r in rows if r["row"] == DYT) < 0.01


def test_a_95_percent_interval_of_each_cells_difference(seed_runs, tmp_path):
    """diff_ci_low/high: the 2.5 and 97.5 percentiles of the seed-aware resamples' differences,
    in results.csv (each seed's line) and the runs list; it holds the observed difference."""
    one = bleu.seed_aware_bootstrap([hypotheses(15)], [hypotheses(19)], REFS, n_samples=400)
    assert one.difference == pytest.approx(10.0)  # BLEU 47.5 against 37.5
    assert one.diff_ci_low < one.difference < one.diff_ci_high
    # sacreBLEU's estimate_ci rule: the 10th and 390th of the 400 sorted resampled differences
    assert one.diff_ci_high - one.diff_ci_low == pytest.approx(2 * bleu.estimate_ci(
        _resampled_differences(400))[1])
    table, runs = seed_runs
    rows = result_rows(table, list(runs.values()))
    aware = bleu.seed_aware_bootstrap([hypotheses(15)] * 2, [hypotheses(30), hypotheses(18)], REFS)
    system = [r for r in rows if r["row"] == SYSTEM]
    assert [(r["diff_ci_low"], r["diff_ci_high"]) for r in system] == [(aware.diff_ci_low, aware.diff_ci_high)] * 2
    # seeds 37.5 and 7.5 BLEU ahead: the interval is as wide as the seeds disagree
    assert aware.diff_ci_low < 7.5 < 22.5 < 37.5 < aware.diff_ci_high
    assert all(r["diff_ci_low"] is None and r["diff_ci_high"] is None for r in rows if r["row"] == BASE)
    csv_path, md_path = tables.write_results(rows, str(tmp_path))
    read = tables.read_results_csv(csv_path)
    assert [(r["diff_ci_low"], r["diff_ci_high"]) for r in read] == [(None, None)] * 2 + [
        (aware.diff_ci_low, aware.diff_ci_high)] * 2
    md = open(md_path, encoding="utf-8").read()
    assert "| p (adj.) | diff 95% CI |" in md
    assert md.count(f"| [{aware.diff_ci_low:+.2f}, {aware.diff_ci_high:+.2f}] |") == 2


def _resampled_differences(n_samples):
    """The one-seed resampled BLEU differences (19 against 15 sentences right), as the test draws them."""
    import numpy as np
    rng = np.random.default_rng(12345)
    indices = rng.choice(len(REFS), size=(n_samples, len(REFS)), replace=True)
    right = np.array([i < 19 for i in range(len(REFS))]), np.array([i < 15 for i in range(len(REFS))])
    # a sentence is all right or all wrong (8 words): BLEU of a resample is 100 x its share of right sentences
    system, base = (100.0 * r[indices].mean(axis=1) for r in right)
    return system - base


COLLECTED = ("cpu", "beyond_cpu_short", "cpu_extension")  # the committed tables under docs/results/


@pytest.mark.parametrize("name", COLLECTED)
def test_every_mark_of_the_committed_tables_agrees_with_p_value_adjusted(name):
    """issue 52, "Done when": every \u2021/\u2020 in results.md is p_value_adjusted's, no unmarked cell
    has p_value_adjusted < 0.05, and every compared cell has one."""
    import os
    folder = os.path.join(os.path.dirname(__file__), "..", "docs", "results", name)
    rows = tables.read_results_csv(os.path.join(folder, "results.csv"))
    with open(os.path.join(folder, "results.md"), encoding="utf-8") as f:
        section = f.read().split("## Runs")[0]
    header = next(line for line in section.splitlines() if line.startswith("| |"))
    pairs = [label.strip().replace("\u2192", "-") for label in header.strip().strip("|").split("|")[1:]]
    checked = 0
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| |"):
            continue
        row, *cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for pair, cell in zip(pairs, cells):
            runs = [r for r in rows if r["row"] == row and r["pair"] == pair and r["status"] == "ok"]
            adjusted = {r["p_value_adjusted"] for r in runs}
            assert len(adjusted) <= 1, (row, pair, adjusted)
            p = adjusted.pop() if adjusted else None
            if runs and p is None:  # only a baseline has none
                assert all(r["p_value"] is None for r in runs), (row, pair)
            mark = "\u2021" if "\u2021" in cell else "\u2020" if "\u2020" in cell else ""
            assert mark == tables.significance_mark(p), (row, pair, cell, p)
            checked += 1
    assert checked >= 6
