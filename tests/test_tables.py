"""Result tables (fairseq_normplug.experiments.tables) and the published numbers they cite."""
import json
import os
import re

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu, tables
from fairseq_normplug.experiments.configs import load_table

FINAL = "PreNorm + FixNorm + ScaleNorm"
BASE = "PostNorm + LayerNorm"
QKNORM_ROW = "PreNorm + FixNorm + ScaleNorm + NoWarmup + QKNorm"
NOTES_NUMBERS = {("table3", FINAL, "gl-en"): 20.91, ("table3", FINAL, "sk-en"): 30.25,
                 ("table3", FINAL, "en-vi"): 32.79, ("table3", FINAL, "en-he"): 28.44,
                 ("table3", FINAL, "ar-en"): 34.35, ("table6", FINAL, "en-de"): 27.57}
# stated in the paper's text (Section 3.1): PostNorm, default init, 16k warmup, en->vi
TEXT_NUMBERS = {("table2", "PostNorm Xavier warmup 16k", "en-vi"): 5.76}


def config_of(table, row):
    """The result-row config of a row of configs/experiments/<table>.json, as the runner writes it."""
    spec = load_table(table).row(row)
    return tables.config_string(spec.model + spec.train, spec.schedule)


FINAL3, BASE3, FINAL6 = config_of("table3", FINAL), config_of("table3", BASE), config_of("table6", FINAL)
# the QKNorm authors' en2vi configuration (CyndxAI/QKNorm), as plugin flags
QKNORM_AUTHORS = "--prenorm --fixnorm --smallinit --qknorm --stop-lr 1e-5 schedule=val_decay"


def run(table, row, pair, status="ok", config=None, **fields):
    return {"table": table, "row": row, "config": config or f"{table}/{pair}/{row}", "pair": pair,
            "status": status, **fields}


ROWS = [
    run("table3", BASE, "sk-en", config=BASE3, tokenized_bleu=29.0, updates=30000, minutes=200.0),
    run("table3", FINAL, "gl-en", config=FINAL3, tokenized_bleu=21.5, p_value=0.004, p_value_adjusted=0.004, updates=12000,
        minutes=95.25, selected_update=11000, dev_bleu=23.4, sacrebleu=20.1,
        sacrebleu_signature="nrefs:1|case:mixed|tok:13a"),
    run("table3", BASE, "gl-en", config=BASE3, tokenized_bleu=19.0, updates=11000, minutes=80.0),
    run("table3", FINAL, "sk-en", config=FINAL3, status="diverged", updates=800),
    run("table3", FINAL, "en-he", config=FINAL3, tokenized_bleu=27.0, p_value=0.03, p_value_adjusted=0.03),
    run("table3", "PreNorm + DyT", "gl-en", config=config_of("table3", "PreNorm + DyT"), status="running"),
    run("table6", FINAL, "en-de", config=FINAL6, tokenized_bleu=26.9, compound_split_bleu=27.8, p_value=0.2, p_value_adjusted=0.2,
        sacrebleu=26.1, sacrebleu_signature="nrefs:1|case:mixed|tok:13a"),
]


def test_paper_results_hold_exactly_the_numbers_of_the_papers_folder():
    """Every published number with its metric, beside the experiment row of its configuration."""
    paper = tables.load_paper_results()
    shown = {}
    for table, spec in paper["tables"].items():
        for row in load_table(table).rows:
            for pair in spec["pairs"]:
                number = tables.paper_bleu(paper, table, tables.config_string(row.model + row.train, row.schedule),
                                           pair)
                if number is not None:
                    shown[(table, row.name, pair)] = number
    assert shown == {**NOTES_NUMBERS, **TEXT_NUMBERS}
    metrics = {table: [(ref.metric, sorted(ref.bleu.items())) for ref in tables.references(paper, table)]
               for table in paper["tables"]}
    assert metrics["table6"] == [("compound_split_bleu", [("en-de", 27.57)])]
    assert metrics["beyond"] == [("multi_bleu_detok", [("en-vi", 33.24)])]
    assert {table: tables.cell_metric(paper, table) for table in paper["tables"]} == {
        "table2": "tokenized_bleu", "table3": "tokenized_bleu", "table6": "compound_split_bleu",
        "beyond": "tokenized_bleu"}
    assert all(ref.source and ref.description and ref.recipe for table in paper["tables"]
               for ref in tables.references(paper, table))
    assert tables.paper_bleu(paper, "table3", BASE3, "ar-en") is None
    assert tables.paper_bleu(paper, "table9", FINAL3, "xx-yy") is None


def test_the_qknorm_number_is_its_authors_configuration_and_metric():
    """33.24 en-vi: FixNorm + LayerNorm + QKNorm, warmup then ValDecay, stop lr 1e-5, scored with
    multi-bleu-detok.perl. Not beside the beyond table's ScaleNorm + NoWarmup QKNorm row; and not
    in a cell of the tokenized-BLEU beyond table even beside its authors' configuration."""
    paper = tables.load_paper_results()
    (qknorm,) = tables.references(paper, "beyond")
    assert qknorm.configuration == {"placement": "prenorm", "norm": "layernorm", "fixnorm": True, "qknorm": True,
                                    "init": "smallinit", "residual_scale": "none", "layers": None,
                                    "schedule": "val_decay", "stop_lr": 1e-5}
    assert not qknorm.matches(tables.row_configuration(config_of("beyond", QKNORM_ROW)))
    assert qknorm.matches(tables.row_configuration(QKNORM_AUTHORS))
    assert not qknorm.matches(tables.row_configuration(QKNORM_AUTHORS.replace("1e-5", "5e-5")))
    assert not qknorm.matches(tables.row_configuration(QKNORM_AUTHORS.replace("--qknorm", "--scalenorm")))
    assert tables.paper_bleu(paper, "beyond", config_of("beyond", QKNORM_ROW), "en-vi") is None
    assert tables.paper_bleu(paper, "beyond", QKNORM_AUTHORS, "en-vi") is None  # other metric

    rows = [run("beyond", QKNORM_ROW, "en-vi", config=config_of("beyond", QKNORM_ROW), tokenized_bleu=30.0,
                multi_bleu_detok=30.3),
            run("beyond", "QKNorm authors", "en-vi", config=QKNORM_AUTHORS, tokenized_bleu=31.0, multi_bleu_detok=31.4)]
    md = tables.render_markdown([tables.normalize_row(r, paper) for r in rows], paper)
    assert f"| {QKNORM_ROW} | 30.00 |" in md and "| QKNorm authors | 31.00 |" in md
    cells = [line for line in md.split("## Runs")[0].splitlines() if line.startswith("| ")]
    assert len(cells) == 3 and not any("33.24" in line for line in cells)
    note = next(line for line in md.splitlines() if line.startswith("* en\u2192vi 33.24"))
    assert "multi-bleu-detok.perl" in note and "LayerNorm + QKNorm" in note
    assert "different metric: the cells are tokenized BLEU" in note
    assert "ours in that metric: QKNorm authors (en\u2192vi) 31.40" in note
    assert "| multi-bleu-detok | hyp/ref | p |" in md  # the metric of the reference beside BLEU in the runs list


def test_a_reference_is_shown_only_beside_a_row_of_its_configuration(tmp_path):
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb", "cc-dd"], "references": [
        {"source": "Paper P", "metric": "tokenized_bleu", "description": "PreNorm + ScaleNorm",
         "configuration": {"placement": "prenorm", "norm": "scalenorm", "schedule": "s"},
         "bleu": {"aa-bb": 30.0, "cc-dd": None}}]}}}
    rows = [run("t", "Same name", "aa-bb", config="--scalenorm schedule=s", tokenized_bleu=10.0),  # PostNorm
            run("t", "Other name", "aa-bb", config="--smallinit --prenorm --norm-type=scalenorm schedule=s",
                tokenized_bleu=11.0),
            run("t", "Other name", "cc-dd", config="--smallinit --prenorm --norm-type=scalenorm schedule=s",
                tokenized_bleu=12.0)]
    csv_path, md_path = tables.write_results(rows, str(tmp_path), paper)
    md = open(md_path, encoding="utf-8").read()
    assert "| Same name | 10.00 | - |" in md
    assert "| Other name | 11.00 (30.00) | 12.00 |" in md  # null: unknown, never guessed
    assert [r["paper_bleu"] for r in tables.read_results_csv(csv_path)] == [None, 30.0, None]
    assert "Published numbers not beside a row" not in md

    _, md_path = tables.write_results(rows[:1], str(tmp_path / "alone"), paper)
    md = open(md_path, encoding="utf-8").read()
    assert "| Same name | 10.00 |" in md and "(30.00)" not in md
    assert ("* aa\u2192bb 30.00, tokenized BLEU (multi-bleu.perl on the tokenized test set); Paper P; "
            "configuration: PreNorm + ScaleNorm. Not beside a row: different configuration: no row here has it.") in md


def test_table6_cells_are_compound_split_bleu(tmp_path):
    _, md_path = tables.write_results(ROWS, str(tmp_path))
    md = open(md_path, encoding="utf-8").read()
    table6 = md.split("## Table 6")[1].split("## ")[0]
    assert "(compound-split BLEU)" in table6.splitlines()[0]
    assert "Cells: compound-split BLEU (tokenized BLEU after fairseq's compound_split_bleu.sh" in table6
    assert f"| {FINAL} | 27.80 (27.57) |" in table6  # compound-split, not the tokenized 26.90
    table3 = md.split("## Table 3")[1].split("## ")[0]
    assert "Cells: tokenized BLEU (multi-bleu.perl on the tokenized test set)." in table3
    # plain tokenized BLEU and sacreBLEU beside it in the runs list
    assert "| dev BLEU | BLEU | sacreBLEU | chrF | compound-split | hyp/ref | p |" in md
    assert f"| table6 | {FINAL} | {FINAL6} | en-de | ok |  |  |  |  | 26.90 | 26.10 |  | 27.80 |  | 0.2 |" in md
    assert f"| table3 | {BASE} | {BASE3} | gl-en | ok | 11000 | 80.0 |  |  | 19.00 |  |  |  |" in md


def test_write_results_csv_and_markdown(tmp_path):
    csv_path, md_path = tables.write_results(ROWS, str(tmp_path / "results"), title="Table 3 and 6")
    assert sorted(os.listdir(tmp_path / "results")) == ["results.csv", "results.md", "table.txt"]  # no temp files
    assert (tmp_path / "results" / "table.txt").read_text() == "table3, table6\n"  # the folder's owner

    rows = tables.read_results_csv(csv_path)
    assert [(r["table"], r["row"], r["pair"], r["status"]) for r in rows] == \
        [(r["table"], r["row"], r["pair"], r["status"]) for r in ROWS]
    assert rows[1]["tokenized_bleu"] == 21.5 and rows[1]["updates"] == 12000 and rows[1]["minutes"] == 95.25
    assert rows[1]["paper_bleu"] == 20.91 and rows[0]["paper_bleu"] is None
    assert rows[3]["tokenized_bleu"] is None and rows[3]["paper_bleu"] == 30.25
    assert rows[6]["paper_bleu"] == 27.57 and rows[6]["compound_split_bleu"] == 27.8
    assert {r["seed"] for r in rows} == {1}

    md = open(md_path, encoding="utf-8").read()
    assert md.startswith("# Table 3 and 6\n")
    # Table 3 in the pairs' paper order, rows in the runs' order; cells "ours (paper)"
    assert "## Table 3: TED pairs and IWSLT'15 en\u2192vi (tokenized BLEU)" in md
    assert "| | gl\u2192en | sk\u2192en | en\u2192he |" in md
    assert "| PostNorm + LayerNorm | 19.00 | 29.00 | - |" in md
    assert f"| {FINAL} | 21.50\u2021 (20.91) | *diverged* (30.25) | 27.00\u2020 (28.44) |" in md
    assert md.index("| PostNorm + LayerNorm |") < md.index(f"| {FINAL} |") < md.index("| PreNorm + DyT |")
    assert "| PreNorm + DyT | *running* | - | - |" in md
    assert "\u2020 p < 0.05, \u2021 p < 0.01" in md
    # every run; the sacreBLEU signature's pipes stay out of the table
    assert (f"| table3 | {FINAL} | {FINAL3} | gl-en | ok | 12000 | 95.2 | 11000 | 23.40 | 21.50 | 20.10 |  |  "
            f"|  | 0.004 |") in md
    assert "sacreBLEU signature: `nrefs:1|case:mixed|tok:13a`" in md


def test_runs_with_run_on_or_truncated_output_are_flagged(tmp_path):
    """Hypothesis/reference length ratio outside 0.5-2: the BLEU gets the mark in both the
    paper-style table and the run list, a footnote gives the ratio; the CSV keeps the ratio."""
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb", "cc-dd"]}}}
    rows = [run("t", "Long", "aa-bb", tokenized_bleu=0.63, length_ratio=2.2, p_value=0.001, p_value_adjusted=0.001),
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
    assert "| t | Long | t/aa-bb/Long | aa-bb | ok |  |  |  |  | 0.63" + mark + " |  |  | 2.200 | 0.001 |" in md
    assert md.count(mark) == 5  # two table cells, two run-list cells, one footnote
    assert "stopped by" not in md  # no run says which rule ended its training

    note = next(line for line in md.splitlines() if line.startswith(mark + " "))
    assert "outside 0.5-2" in note and "Long (t, aa-bb): 2.20; Short (t, aa-bb): 0.45." in note
    assert md.index(note) < md.index("## Table T")

    _, clean_md = tables.write_results(rows[2:4], str(tmp_path / "clean"), paper)
    assert mark not in open(clean_md, encoding="utf-8").read()


def test_the_runs_list_names_the_rule_that_stopped_each_run(tmp_path):
    rows = [run("t", "A", "aa-bb", tokenized_bleu=20.0, length_ratio=0.98, updates=2400,
                stopped_by="no gain for 3 validations (best 30 at update 1800, --stop-patience 3)"),
            run("t", "B", "aa-bb", tokenized_bleu=21.0, updates=3000, stopped_by="--max-update 3000")]
    csv_path, md_path = tables.write_results(rows, str(tmp_path), {})
    assert [r["stopped_by"] for r in tables.read_results_csv(csv_path)] == [
        "no gain for 3 validations (best 30 at update 1800, --stop-patience 3)", "--max-update 3000"]
    md = open(md_path, encoding="utf-8").read()
    assert "| status | updates | stopped by | minutes |" in md
    assert ("| t | A | t/aa-bb/A | aa-bb | ok | 2400 | no gain for 3 validations (best 30 at update 1800, "
            "--stop-patience 3) |") in md
    assert "| ok | 3000 | --max-update 3000 |" in md and "| 0.980 |" in md


def test_an_explicit_paper_number_wins_and_rows_outside_the_paper_are_kept(tmp_path):
    paper = {"tables": {"t": {"title": "Table T", "pairs": ["aa-bb"], "references": [
        {"source": "S", "metric": "tokenized_bleu", "configuration": {"schedule": "s"}, "bleu": {"aa-bb": 1.0}}]}}}
    rows = [run("t", "Row R", "aa-bb", config="schedule=s", tokenized_bleu=2.0, paper_bleu=3.0),
            run("t", "other", "cc-dd", tokenized_bleu=4.0)]
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


def test_two_results_for_one_cell_and_seed_are_rejected(tmp_path):
    rows = [run("table3", "r", "gl-en", tokenized_bleu=1.0), {**run("table3", "r", "gl-en", tokenized_bleu=2.0), "config": "again"}]
    with pytest.raises(NormplugError, match="two results for table3 row 'r' pair 'gl-en'"):
        tables.write_results(rows, str(tmp_path))


def test_significance_marks():
    assert [tables.significance_mark(p) for p in (None, 0.2, 0.05, 0.049, 0.01, 0.0099)] == \
        ["", "", "", "\u2020", "\u2020", "\u2021"]


GOOD_REFERENCE = {"source": "S", "metric": "tokenized_bleu", "configuration": {"norm": "scalenorm"},
                  "bleu": {"aa-bb": 1.0}}


@pytest.mark.parametrize("change, message", [
    ({"bleu": {"x-y": 1.0}}, r"t: reference 1: bleu \(pairs of the table\): unknown key 'x-y'; valid keys: aa-bb"),
    ({"metric": "bleu"}, "t: reference 1: unknown metric 'bleu'; choose from tokenized_bleu, compound_split_bleu"),
    ({"metric": None}, "unknown metric None"),
    ({"configuration": {"norm_type": "scalenorm"}}, "configuration: unknown key 'norm_type'; valid keys: fixnorm"),
    ({"configuration": {}}, "t: reference 1: empty configuration"),
    ({"bleu": {"aa-bb": "high"}}, "bleu aa-bb='high' is not a number"),
    ({"row": "r"}, "t: reference 1: unknown key 'row'; valid keys: bleu, configuration"),
])
def test_bad_paper_results_file(tmp_path, change, message):
    bad = tmp_path / "paper.json"
    bad.write_text(json.dumps({"tables": {"t": {"pairs": ["aa-bb"], "references": [{**GOOD_REFERENCE, **change}]}}}))
    with pytest.raises(NormplugError, match=message):
        tables.load_paper_results(str(bad))


def test_paper_results_file_errors(tmp_path):
    with pytest.raises(NormplugError, match="no such paper-results file"):
        tables.load_paper_results(str(tmp_path / "none.json"))
    bad = tmp_path / "paper.json"
    bad.write_text(json.dumps({"tables": {"t": {"pairs": ["aa-bb"], "references": [
        {k: v for k, v in GOOD_REFERENCE.items() if k != "metric"}]}}}))
    with pytest.raises(NormplugError, match="t: reference 1: missing key 'metric' .*records its source, metric"):
        tables.load_paper_results(str(bad))
    bad.write_text(json.dumps({"tables": {"t": {"pairs": ["aa-bb"], "metric": "sacrebleu"}}}))
    with pytest.raises(NormplugError, match="t: cell metric: unknown metric 'sacrebleu'; choose from tokenized_bleu, "
                                            "compound_split_bleu, multi_bleu_detok"):
        tables.load_paper_results(str(bad))
    bad.write_text(json.dumps({"tables": {"t": {"pairs": ["aa-bb"], "rows": {}}}}))
    with pytest.raises(NormplugError, match="t: unknown key 'rows'; valid keys: metric, pairs, references, title"):
        tables.load_paper_results(str(bad))


def test_row_configuration_reads_the_flags():
    assert tables.row_configuration("--prenorm --norm-type=dyt --dyt-alpha-init 0.5 --weight-init xavier "
                                    "--encoder-layers 12 --decoder-layers 12 --stop-lr 0 schedule=no_warmup") == {
        "placement": "prenorm", "norm": "dyt", "fixnorm": False, "qknorm": False, "init": "xavier",
        "residual_scale": "none", "layers": "12/12", "schedule": "no_warmup", "stop_lr": 0.0}
    assert tables.row_configuration("--fixnorm --rmsnorm --residual-scale rezero schedule=s") == {
        "placement": "postnorm", "norm": "rmsnorm", "fixnorm": True, "qknorm": False, "init": "fairseq",
        "residual_scale": "rezero", "layers": None, "schedule": "s", "stop_lr": 5e-5}
    assert tables.row_configuration("table3/gl-en/row") is None and tables.row_configuration(None) is None
    assert tables.config_string(["--prenorm", "--lr", "3e-3"], "no_warmup") == "--prenorm --lr 3e-3 schedule=no_warmup"
    assert set(tables.CONFIGURATION_KEYS) == set(tables.row_configuration("schedule=s"))
    placements = {"--norm-placement pre": "prenorm", "--norm-placement sandwich": "sandwich",
                  "--norm-placement post": "postnorm", "--encoder-normalize-before --decoder-normalize-before": "prenorm",
                  "--prenorm --normformer": "prenorm+normformer"}
    for flags, label in placements.items():
        assert tables.row_configuration(f"{flags} schedule=s")["placement"] == label, flags
    # read as its model would be built: a placement no loaded module defines has no configuration
    assert tables.row_configuration("--norm-placement mine schedule=s") is None


def test_multi_bleu_detok_is_13a_tokenization_of_the_tokenized_lines():
    """multi-bleu-detok.perl tokenizes its input with mteval-v13a: ``end.`` is split, so
    an output that differs from the reference only there scores 100, while tokenized
    BLEU (whitespace tokens, unsmoothed) has no matching 4-gram and scores 0."""
    hyps, refs = ["we saw the end."], ["we saw the end ."]
    assert bleu.multi_bleu_detok(hyps, refs).score == pytest.approx(100.0)
    assert bleu.tokenized_bleu(hyps, refs).score == 0.0
    assert "tok:13a" in bleu.multi_bleu_detok(hyps, refs).signature
    assert "smooth:none" in bleu.multi_bleu_detok(hyps, refs).signature
    assert bleu.score_translation(hyps, refs)["multi_bleu_detok"] == pytest.approx(100.0)


def test_a_paper_results_file_is_read_as_every_json_config(tmp_path):
    """experiments/json_config.py reads paper_results.json as it reads configs/: a file that is not
    JSON, or holds a number that is not finite, is one line naming it."""
    bad = tmp_path / "paper.json"
    bad.write_text('{"tables": {"t": {"pairs": ["aa-bb"], "references": [{"bleu": {"aa-bb": NaN}}]}}}')
    with pytest.raises(NormplugError, match=f"^{re.escape(str(bad))}: invalid JSON .*NaN is not a number"):
        tables.load_paper_results(str(bad))
    bad.write_text('{"tables": ')
    with pytest.raises(NormplugError, match=f"^{re.escape(str(bad))}: invalid JSON"):
        tables.load_paper_results(str(bad))


def test_row_configuration_is_the_rows_resolved_model_configuration():
    """Read as the row's model is built (resolved_config.resolve_flags): an extension named by
    its portable path is loaded and its norm type named; flags of components the row does not
    choose (an optimizer's --weight-decay) are left aside; fairseq's mixed normalize-before model
    is the resolver's PostNorm."""
    extension = ("--prenorm --norm-type prmsnorm --normplug-modules "
                 "$CHECKOUT/examples/normplug_extension/normplug_extension_example schedule=inv_sqrt_decay")
    assert tables.row_configuration(extension)["norm"] == "prmsnorm"
    assert tables.row_configuration("--prenorm --weight-decay 0.1 --stop-lr 1e-5 schedule=s")["placement"] == "prenorm"
    assert tables.row_configuration("--encoder-normalize-before schedule=s")["placement"] == "postnorm"
    assert tables.row_configuration("--prenorm --smallinit --fixnorm schedule=s")["init"] == "smallinit"
