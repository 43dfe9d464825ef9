"""chrF beside BLEU (issue 43): sacreBLEU's chrF2 (and chrF++) of the same detokenized lines as
sacreBLEU's BLEU, in scores.json with its signature, a column of results.csv and of the runs
list, re-scored from a kept generate-test.txt for a scores.json written before it, and a table
metric (``reproduce.sh --metric chrf``): cells, marks and both p-values in chrF. Run folders are
made by hand (fairseq-generate output, scores.json, status.json), nothing is trained."""
import csv
import json
import os
import subprocess

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu, reproduce, tables
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.reproduce import result_rows
from fairseq_normplug.experiments.runner import Run, run_folder, score_generation

from conftest import cli

SENTENCES = 30
BASE, SYSTEM = "PostNorm + LayerNorm + warmup", "PreNorm + FixNorm + ScaleNorm + NoWarmup"
PAIR, LANG = "de-en", "en"
WORDS = ("report", "council", "weather", "station", "garden", "library", "window", "river")


def _words(i):
    return [WORDS[(i + k) % len(WORDS)] + str(i) for k in range(5)]


#: tokenized references (Moses: split punctuation, &apos;) and their raw, detokenized lines
REFS_TOK = [f"the {a} &apos;s {b} , said {c} , is {d} of {e} ." for a, b, c, d, e in map(_words, range(SENTENCES))]
REFS_RAW = [f"The {a}'s {b}, said {c}, is {d} of {e}." for a, b, c, d, e in map(_words, range(SENTENCES))]


def hypothesis(i, kind):
    """Sentence ``i``: ``exact``, with a ``typo`` in each word (chrF gives partial credit, BLEU
    almost none) or ``wrong`` (other words)."""
    words = _words(i)
    if kind == "typo":
        words = [word[:-2] + "x" + word[-1] for word in words]
    elif kind == "wrong":
        words = [f"zz{i}q{k}" for k in range(5)]
    a, b, c, d, e = words
    return f"the {a} &apos;s {b} , said {c} , is {d} of {e} ."


def hypotheses(exact, rest):
    return [hypothesis(i, "exact" if i < exact else rest) for i in range(SENTENCES)]


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def sacrebleu_cli(ref, hyp, *options):
    """The score sacreBLEU's command line prints for ``-m chrf`` and ``options``, 10 decimals."""
    proc = subprocess.run([cli("sacrebleu"), str(ref), "-i", str(hyp), "-m", "chrf", "-b", "-w", "10", *options],
                          capture_output=True, text=True, check=True)
    return float(proc.stdout.strip())


def write_run(run, hyps):
    os.makedirs(run.run_dir, exist_ok=True)
    with open(run.path("status.json"), "w") as f:
        json.dump({"status": "done", "updates": 100, "minutes": 1.5}, f)
    with open(run.path("generate-test.txt"), "w", encoding="utf-8") as f:
        for i, (hyp, ref) in enumerate(zip(hyps, REFS_TOK)):
            f.write(f"S-{i}\tsource {i}\nT-{i}\t{ref}\nH-{i}\t-0.5\t{hyp}\nD-{i}\t-0.5\t{hyp}\n")
    scores = {**score_generation(run.path("generate-test.txt"), run.data_dir, run.tgt),
              "selected_update": 100, "dev_bleu": 10.0}
    with open(run.path("scores.json"), "w") as f:
        json.dump(scores, f)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp("chrf") / "data"
    (data / "ref").mkdir(parents=True)
    write_lines(data / "ref" / f"test.tok.{LANG}", REFS_TOK)
    write_lines(data / "ref" / f"test.detok.{LANG}", REFS_RAW)
    return data


@pytest.fixture(scope="module")
def demo_runs(data_dir):
    """The demo table's baseline and one system row, two seeds each. The system translates
    more sentences exactly; the baseline's other sentences have a typo in every word (close in
    chrF, far in BLEU), the system's are wrong."""
    table = load_table("demo")
    outputs = {(BASE, 1): hypotheses(5, "typo"), (BASE, 2): hypotheses(3, "typo"),
               (SYSTEM, 1): hypotheses(22, "wrong"), (SYSTEM, 2): hypotheses(20, "wrong")}
    runs = {}
    for (row, seed), hyps in outputs.items():
        run = Run(table=table, row=table.row(row), pair=PAIR, data_dir=str(data_dir), seed=seed,
                  run_dir=run_folder(str(data_dir.parent / "runs"), "demo", PAIR, row, seed))
        write_run(run, hyps)
        runs[(row, seed)] = run
    return table, runs, outputs


def detok(hyps):
    return bleu.detokenize(hyps, LANG)


@pytest.mark.slow
def test_chrf_is_the_sacrebleu_command_lines_on_the_same_files(tmp_path):
    hyps = detok(hypotheses(12, "typo"))
    hyp_file, ref_file = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    write_lines(hyp_file, hyps)
    write_lines(ref_file, REFS_RAW)
    chrf2, chrf_pp = bleu.chrf(hyps, REFS_RAW), bleu.chrf(hyps, REFS_RAW, word_order=2)
    assert chrf2.score == pytest.approx(sacrebleu_cli(ref_file, hyp_file), abs=1e-6)
    assert chrf_pp.score == pytest.approx(sacrebleu_cli(ref_file, hyp_file, "--chrf-word-order", "2"), abs=1e-6)
    assert chrf2.score != chrf_pp.score
    assert "nc:6|nw:0" in chrf2.signature and "nw:2" in chrf_pp.signature
    # score_translation scores the lines sacreBLEU's BLEU scores: Moses-detokenized hypotheses, raw references
    scores = bleu.score_translation(hypotheses(12, "typo"), REFS_TOK, lang=LANG, detok_refs=REFS_RAW)
    assert scores["chrf"] == pytest.approx(sacrebleu_cli(ref_file, hyp_file), abs=1e-6)
    assert scores["chrf++"] == pytest.approx(chrf_pp.score, abs=1e-12)
    assert scores["sacrebleu"] == pytest.approx(bleu.sacrebleu_detok(hyps, REFS_RAW, LANG).score, abs=1e-12)


def test_scores_json_has_chrf_and_its_signature(demo_runs):
    _, runs, outputs = demo_runs
    scores = json.loads(open(runs[(BASE, 1)].path("scores.json")).read())
    assert scores["chrf"] == pytest.approx(bleu.chrf(detok(outputs[(BASE, 1)]), REFS_RAW).score, abs=1e-12)
    assert scores["chrf_signature"] == bleu.chrf(detok(outputs[(BASE, 1)]), REFS_RAW).signature
    assert scores["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")
    assert "nw:2" in scores["chrf++_signature"] and scores["chrf++"] > 0
    assert scores["tokenized_bleu"] > 0 and scores["sacrebleu_signature"]  # BLEU's fields unchanged


@pytest.mark.slow
def test_results_csv_and_the_runs_list_have_a_chrf_column(demo_runs, tmp_path):
    table, runs, outputs = demo_runs
    reproduce.write_table(table, list(runs.values()), str(tmp_path), echo=lambda line: None)
    with open(tmp_path / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        lines = list(reader)
    assert {"chrf", "chrf++", "chrf_signature"} <= set(reader.fieldnames)
    write_lines(tmp_path / "ref.txt", REFS_RAW)
    for i, line in enumerate(lines):
        hyps = detok(outputs[(line["row"], int(line["seed"]))])
        expected = bleu.chrf(hyps, REFS_RAW)
        assert float(line["chrf"]) == pytest.approx(expected.score, abs=1e-9)
        assert line["chrf_signature"] == expected.signature
        write_lines(tmp_path / f"hyp{i}.txt", hyps)  # the command line on the run's detokenized output
        assert float(line["chrf"]) == pytest.approx(sacrebleu_cli(tmp_path / "ref.txt", tmp_path / f"hyp{i}.txt"), abs=1e-6)
    md = (tmp_path / "results.md").read_text(encoding="utf-8")
    assert "| BLEU | sacreBLEU | chrF |" in md and "chrF signature: `nrefs:1|" in md
    assert "Cells: tokenized BLEU" in md  # the demo table's cells stay BLEU


def test_an_old_scores_json_without_chrf_is_rescored_from_its_generate_output(demo_runs, tmp_path):
    table, runs, outputs = demo_runs
    old = Run(table=table, row=table.row(BASE), pair=PAIR, data_dir=runs[(BASE, 1)].data_dir, seed=1,
              run_dir=str(tmp_path / "old"))
    write_run(old, outputs[(BASE, 1)])
    scores = json.loads(open(old.path("scores.json")).read())
    for key in ("chrf", "chrf_signature", "chrf++", "chrf++_signature"):
        del scores[key]
    with open(old.path("scores.json"), "w") as f:
        json.dump(scores, f)
    (row,) = result_rows(table, [old])
    expected = bleu.chrf(detok(outputs[(BASE, 1)]), REFS_RAW)
    assert row["chrf"] == pytest.approx(expected.score, abs=1e-12) and row["chrf_signature"] == expected.signature
    assert row["chrf++"] == pytest.approx(bleu.chrf(detok(outputs[(BASE, 1)]), REFS_RAW, 2).score, abs=1e-12)
    os.remove(old.path("generate-test.txt"))  # nothing to re-score from: an empty cell, not an error
    (row,) = result_rows(table, [old])
    assert row["status"] == "ok" and row["chrf"] is None and row["tokenized_bleu"] == scores["tokenized_bleu"]


def _system(rows):
    return [row for row in rows if row["row"] == SYSTEM]


def test_metric_chrf_puts_cells_marks_and_both_p_values_in_chrf(demo_runs, tmp_path):
    table, runs, outputs = demo_runs
    bleu_rows = result_rows(table, list(runs.values()))
    paper = tables.with_cell_metric(tables.load_paper_results(), "demo", "chrf")
    chrf_rows = result_rows(table, list(runs.values()), paper)
    # the bootstrap resamples chrF's sufficient statistics over both seeds' detokenized lines
    pooled = bleu.paired_bootstrap_seeds([detok(outputs[(BASE, s)]) for s in (1, 2)],
                                         [detok(outputs[(SYSTEM, s)]) for s in (1, 2)], REFS_RAW, metric="chrf")
    assert pooled.baseline_score == pytest.approx(
        bleu.chrf(detok(outputs[(BASE, 1)] + outputs[(BASE, 2)]), REFS_RAW * 2).score, abs=1e-9)
    assert [r["p_value"] for r in _system(chrf_rows)] == [pooled.p_value] * 2
    bleu_p = _system(bleu_rows)[0]["p_value"]
    assert bleu_p < 0.01 < pooled.p_value  # far apart in BLEU, not in chrF (the typos' partial credit)
    seeds_p = bleu.seeds_permutation_test([r["chrf"] for r in chrf_rows if r["row"] == BASE],
                                          [r["chrf"] for r in _system(chrf_rows)])
    assert _system(chrf_rows)[0]["seeds_p_value"] == seeds_p
    assert _system(bleu_rows)[0]["seeds_p_value"] == bleu.seeds_permutation_test(
        [r["tokenized_bleu"] for r in bleu_rows if r["row"] == BASE], [r["tokenized_bleu"] for r in _system(bleu_rows)])
    # the cells: chrF mean +- sd, without the BLEU cell's mark
    reproduce.write_table(table, list(runs.values()), str(tmp_path), echo=lambda line: None, metric="chrf")
    md = (tmp_path / "results.md").read_text(encoding="utf-8")
    chrfs = [r["chrf"] for r in _system(chrf_rows)]
    assert f"| {SYSTEM} | {tables._mean_sd(chrfs)}{tables.significance_mark(_system(chrf_rows)[0]['p_value_adjusted'])} |" in md
    assert "Cells: chrF (sacreBLEU's chrF2" in md
    bleus = [r["tokenized_bleu"] for r in _system(bleu_rows)]
    assert f"{tables._mean_sd(bleus)}\u2021" not in md
    # chrF++ as the metric: its own column in the runs list, its own p-value
    reproduce.write_table(table, list(runs.values()), str(tmp_path), echo=lambda line: None, metric="chrf++")
    md = (tmp_path / "results.md").read_text(encoding="utf-8")
    assert "| chrF | chrF++ |" in md and "Cells: chrF++" in md


def test_paired_bootstrap_of_chrf_is_sacrebleus_on_one_seed():
    base, system = detok(hypotheses(12, "typo")), detok(hypotheses(18, "wrong"))
    for metric, word_order in bleu.CHRF_WORD_ORDERS.items():
        ours = bleu.paired_bootstrap_seeds([base], [system], REFS_RAW, n_samples=200, metric=metric)
        theirs = bleu.paired_bootstrap(base, system, REFS_RAW, n_samples=200, metric=metric)
        assert (ours.p_value, ours.system_mean) == pytest.approx((theirs.p_value, theirs.system_mean))
        assert ours.system_score == pytest.approx(bleu.chrf(system, REFS_RAW, word_order).score, abs=1e-9)
        assert f"nw:{word_order}" in theirs.signature and "bs:200" in theirs.signature


def test_an_unknown_metric_is_one_line_naming_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["demo", "--metric", "chrF3", "--collect", "--runs-dir", str(tmp_path)])
    message = str(exit_info.value.code)
    assert message == ("reproduce.sh: error: --metric: unknown metric 'chrF3'; choose from tokenized_bleu, "
                       "compound_split_bleu, multi_bleu_detok, chrf, chrf++")
    assert not os.listdir(tmp_path)  # nothing was collected
    bad = tmp_path / "paper.json"
    bad.write_text(json.dumps({"tables": {"t": {"pairs": ["aa-bb"], "metric": "chrF"}}}))
    with pytest.raises(NormplugError, match=r"^[^\n]*t: cell metric: unknown metric 'chrF'; choose from tokenized_bleu, "
                                            r"compound_split_bleu, multi_bleu_detok, chrf, chrf\+\+$"):
        tables.load_paper_results(str(bad))
    paper = tables.checked_paper_results({"tables": {"t": {"pairs": ["aa-bb"], "metric": "chrf"}}})
    assert tables.cell_metric(paper, "t") == "chrf"  # a table's config may name chrF itself
