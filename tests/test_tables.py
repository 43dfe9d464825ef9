"""Result tables (fairseq_normplug.experiments.tables) and the paper's numbers they cite."""
import json
import os

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import tables

FINAL = "PreNorm + FixNorm + ScaleNorm"
BASE = "PostNorm + LayerNorm"
NOTES_NUMBERS = {("table3", FINAL, "gl-en"): 20.91, ("table3", FINAL, "sk-en"): 30.25,
                 ("table3", FINAL, "en-vi"): 32.79, ("table3", FINAL, "en-he"): 28.44,
                 ("table3", FINAL, "ar-en"): 34.35, ("table6", FINAL, "en-de"): 27.57}
# stated in the paper's text (Section 3.1): PostNorm, default init, 16k warmup, en->vi
TEXT_NUMBERS = {("table2", "PostNorm Xavier warmup 16k", "en-vi"): 5.76}
# QKNorm (Henry et al. 2020), as issue 12 quotes it
LATER_NUMBERS = {("beyond", "PreNorm + FixNorm + ScaleNorm + NoWarmup + QKNorm", "en-vi"): 33.24}


def run(table, row, pair, status="ok", **fields):
    return {"table": table, "row": row, "config": f"{table}/{pair}/{row}", "pair": pair, "status": status,
            **fields}


ROWS = [
    run("table3", FINAL, "gl-en", tokenized_bleu=21.5, p_value=0.004, updates=12000, minutes=95.25,
        selected_update=11000, dev_bleu=23.4, sacrebleu=20.1,
        sacrebleu_signature="nrefs:1|case:mixed|tok:13a"),
    run("table3", BASE, "sk-en", tokenized_bleu=29.0, updates=30000, minutes=200.0),
    run("table3", BASE, "gl-en", tokenized_bleu=19.0, updates=11000, minutes=80.0),
    run("table3", FINAL, "sk-en", status="diverged", updates=800),
    run("table3", FINAL, "en-he", tokenized_bleu=27.0, p_value=0.03),
    run("table3", "PreNorm + DyT", "gl-en", status="running"),
    run("table6", FINAL, "en-de", tokenized_bleu=26.9, p_value=0.2),
]


def test_paper_results_hold_exactly_the_numbers_of_the_papers_folder():
    paper = tables.load_paper_results()
    numbers = {(table, row, pair): value
               for table, spec in paper["tables"].items()
               for row, row_numbers in spec["rows"].items()
               for pair, value in row_numbers.items() if value is not None}
    assert numbers == {**NOTES_NUMBERS, **TEXT_NUMBERS, **LATER_NUMBERS}
    assert tables.paper_bleu(paper, "table3", FINAL, "ar-en") == 34.35
    assert tables.paper_bleu(paper, "table3", BASE, "ar-en") is None
    assert tables.paper_bleu(paper, "table9", "anything", "xx-yy") is None


def test_write_results_csv_and_markdown(tmp_path):
    csv_path, md_path = tables.write_results(ROWS, str(tmp_path / "results"), title="Table 3 and 6")
    assert sorted(os.listdir(tmp_path / "results")) == ["results.csv", "results.md"]  # no temp files

    rows = tables.read_results_csv(csv_path)
    assert [(r["table"], r["row"], r["pair"], r["status"]) for r in rows] == \
        [(r["table"], r["row"], r["pair"], r["status"]) for r in ROWS]
    assert rows[0]["tokenized_bleu"] == 21.5 and rows[0]["updates"] == 12000 and rows[0]["minutes"] == 95.25
    assert rows[0]["paper_bleu"] == 20.91 and rows[1]["paper_bleu"] is None
    assert rows[3]["tokenized_bleu"] is None and rows[3]["paper_bleu"] == 30.25
    assert rows[6]["paper_bleu"] == 27.57

    md = open(md_path, encoding="utf-8").read()
    assert md.startswith("# Table 3 and 6\n")
    # Table 3 in the paper's row and column order; cells "ours (paper)"
    assert "## Table 3: TED pairs and IWSLT'15 en\u2192vi (tokenized BLEU)" in md
    assert "| | gl\u2192en | sk\u2192en | en\u2192he |" in md
    assert "| PostNorm + LayerNorm | 19.00 | 29.00 | - |" in md
    assert f"| {FINAL} | 21.50\u2021 (20.91) | *diverged* (30.25) | 27.00\u2020 (28.44) |" in md
    assert md.index("| PostNorm + LayerNorm |") < md.index(f"| {FINAL} |") < md.index("| PreNorm + DyT |")
    assert "| PreNorm + DyT | *running* | - | - |" in md
    assert f"| {FINAL} | 26.90 (27.57) |" in md
    assert "\u2020 p < 0.05, \u2021 p < 0.01" in md
    # every run; the sacreBLEU signature's pipes stay out of the table
    assert f"| table3 | {FINAL} | table3/gl-en/{FINAL} | gl-en | ok | 12000 | 95.2 | 11000 | 23.40 | 21.50 | 20.10 | 0.004 |" in md
    assert "sacreBLEU signature: `nrefs:1|case:mixed|tok:13a`" in md


def test_runs_with_run_on_or_truncated_output_are_flagged(tmp_path):
    """Hypothesis/reference length ratio outside 0.5-2: the BLEU gets the mark in both the
    paper-style table and the run list, a footnote gives the ratio; the CSV keeps the ratio."""
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb", "cc-dd"], "rows": {}}}}
    rows = [run("t", "Long", "aa-bb", tokenized_bleu=0.63, length_ratio=2.2, p_value=0.001),
            run("t", "Short", "aa-bb", tokenized_bleu=3.5, length_ratio=0.45),
            run("t", "Fine", "aa-bb", tokenized_bleu=20.0, length_ratio=1.1),
            run("t", "Edges", "aa-bb", tokenized_bleu=10.0, length_ratio=2.0),
            run("t", "Edges", "cc-dd", tokenized_bleu=11.0, length_ratio=0.5),
            run("t", "Unknown", "aa-bb", tokenized_bleu=12.0),
            run("t", "Diverged", "aa-bb", status="diverged", length_ratio=3.0)]
    csv_path, md_path = tables.write_results(rows, str(tmp_path), paper)
    assert [r["length_ratio"] for r in tables.read_results_csv(csv_path)] == [2.2, 0.45, 1.1, 2.0, 0.5, None, 3.0]
    md = open(md_path, encoding="utf-8").read()
    mark = tables.LENGTH_MARK
    assert "| Long | 0.63\u2021" + mark + " | - |" in md and "| Short | 3.50" + mark + " | - |" in md
    assert "| Fine | 20.00 | - |" in md and "| Edges | 10.00 | 11.00 |" in md
    assert "| Unknown | 12.00 | - |" in md and "| Diverged | *diverged* | - |" in md
    assert "| t | Long | t/aa-bb/Long | aa-bb | ok |  |  |  |  | 0.63" + mark + " |  | 0.001 |" in md
    assert md.count(mark) == 5  # two table cells, two run-list cells, one footnote
    note = next(line for line in md.splitlines() if line.startswith(mark + " "))
    assert "outside 0.5-2" in note and "Long (t, aa-bb): 2.20; Short (t, aa-bb): 0.45." in note
    assert md.index(note) < md.index("## Table T")

    _, clean_md = tables.write_results(rows[2:4], str(tmp_path / "clean"), paper)
    assert mark not in open(clean_md, encoding="utf-8").read()


def test_an_explicit_paper_number_wins_and_rows_outside_the_paper_are_kept(tmp_path):
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb"], "rows": {"Row R": {"aa-bb": 1.0}}}}}
    rows = [run("t", "Row R", "aa-bb", tokenized_bleu=2.0, paper_bleu=3.0), run("t", "other", "cc-dd", tokenized_bleu=4.0)]
    _, md_path = tables.write_results(rows, str(tmp_path), paper)
    md = open(md_path, encoding="utf-8").read()
    assert "## Table T" in md
    assert "| | aa\u2192bb | cc\u2192dd |" in md
    assert "| Row R | 2.00 (3.00) | - |" in md
    assert "| other | - | 4.00 |" in md


@pytest.mark.parametrize("row, message", [
    (run("table3", "r", "gl-en", status="done"), "unknown status 'done'"),
    (run("table3", "r", "gl-en", tokenized_bleu=1.0, score=2.0), r"unknown result field\(s\) \['score'\]"),
    (run("table3", "r", "gl-en"), "status ok but no tokenized_bleu for table3/r/gl-en"),
    (run("table3", "r", "gl-en", tokenized_bleu="high"), "tokenized_bleu='high' is not a number"),
    ({"table": "table3", "row": "r", "pair": "gl-en", "status": "ok", "tokenized_bleu": 1.0}, "lacks config"),
])
def test_bad_rows_are_rejected(row, message, tmp_path):
    with pytest.raises(NormplugError, match=message):
        tables.write_results([row], str(tmp_path))
    assert not os.listdir(tmp_path)


def test_two_results_for_one_cell_are_rejected(tmp_path):
    rows = [run("table3", "r", "gl-en", tokenized_bleu=1.0), {**run("table3", "r", "gl-en", tokenized_bleu=2.0), "config": "again"}]
    with pytest.raises(NormplugError, match="two results for table3 row 'r' pair 'gl-en'"):
        tables.write_results(rows, str(tmp_path))


def test_significance_marks():
    assert [tables.significance_mark(p) for p in (None, 0.2, 0.05, 0.049, 0.01, 0.0099)] == \
        ["", "", "", "\u2020", "\u2020", "\u2021"]


def test_atomic_output_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "results.md"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with tables.atomic_output(str(target)) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == ["results.md"] and target.read_text() == "old"


def test_bad_paper_results_file(tmp_path):
    with pytest.raises(NormplugError, match="no such paper-results file"):
        tables.load_paper_results(str(tmp_path / "none.json"))
    bad = tmp_path / "paper.json"
    bad.write_text(json.dumps({"tables": {"t": {"pairs": ["aa-bb"], "rows": {"r": {"x-y": 1.0}}}}}))
    with pytest.raises(NormplugError, match=r"t/r has numbers for pairs \['x-y'\]"):
        tables.load_paper_results(str(bad))
