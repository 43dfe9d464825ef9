"""Result tables: ``results.csv`` (one line per run, i.e. per seed) and ``results.md`` (laid
out like the paper's tables: one row per configuration, one column per language pair, cells
"ours (published)"), both written atomically.

A result row is a dict with the keys of :data:`FIELDS`:

* ``table``: the paper table it belongs to (``table3``, as configs/experiments/<table>.json);
* ``pair``: ``src-tgt`` as fairseq names it (``gl-en``, ``en-vi``, ``en-de``);
* ``row``: the row name, as in configs/experiments/<table>.json (``PreNorm + FixNorm +
  ScaleNorm``);
* ``config``: the row's configuration, :func:`config_string` of its flags and schedule (the
  published numbers of configs/paper_results.json are matched against it);
* ``seed``: the training seed (1 when absent); a cell of results.md is every seed of one
  (row, pair);
* ``tokenized_bleu``: tokenized BLEU; ``sacrebleu`` + ``sacrebleu_signature``; ``chrf`` (chrF2)
  and ``chrf++`` (chrF++) of the same detokenized lines as sacreBLEU, ``chrf_signature`` (chrF2's;
  chrF++'s is the same with ``nw:2``);
  ``compound_split_bleu`` (German targets), ``multi_bleu_detok``: the other metrics of
  :data:`METRICS`. A table's cells show its ``metric`` (configs/paper_results.json, default
  tokenized BLEU; Table 6: compound-split BLEU);
* ``p_value``: the cell's paired bootstrap p-value (in the table's metric, over the seeds both
  rows finished) against the row's baseline row, the same on each seed's line; None for a baseline;
* ``seeds_p_value``: the cell's p-value over training seeds against the same baseline (exact
  permutation test of the per-seed scores in the table's metric); None unless both cells have
  2 or more finished seeds;
* ``p_value_seed_aware``: the cell's p-value of the test behind its mark, against the same
  baseline: test sentences and training seeds resampled together (bleu.seed_aware_bootstrap,
  every finished seed of both rows; with one seed each, the paired bootstrap); None for a baseline;
* ``p_value_adjusted``: ``p_value_seed_aware`` Holm-adjusted over every compared cell of the
  table (bleu.holm_adjust): the p of the cell's mark (\u2021 < 0.01, \u2020 < 0.05);
* ``diff_ci_low``, ``diff_ci_high``: the 95% bootstrap interval of the cell's difference from its
  baseline cell (mean over seeds, system - baseline, in the table's metric), from the resamples of
  the seed-aware test; None for a baseline;
* ``length_ratio``: test hypotheses' token length over the references' (``sys_len / ref_len``);
  outside :data:`LENGTH_RATIO_RANGE` the BLEU is flagged with :data:`LENGTH_MARK`;
* ``status``: one of :data:`STATUSES`; ``updates``, ``minutes``: training length;
  ``stopped_by``: the rule that ended training (``--stop-patience``, ``--stop-lr``, fairseq's
  ``--patience``, ``--max-update N``), read from its log, or why a diverged run diverged;
* ``selected_update``, ``dev_bleu``: the validation whose checkpoint (best dev BLEU) was
  tested, and its dev BLEU (tokenized, same decoder as the test BLEU);
* ``paper_bleu``: the published number beside this row (filled when None: a reference of the
  row's configuration in the table's metric, :func:`~.paper_results.matching_reference`).
"""
import csv
import io
import os
import re
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from fairseq_normplug.atomic_files import write_text_atomic
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.paper_results import (  # noqa: F401 (tables.cell_metric, ...)
    cell_metric, CELL_METRICS, checked_paper_results, config_string, CONFIGURATION_KEYS, load_paper_results,
    METRICS, paper_bleu, references, row_configuration, with_cell_metric,
)

STATUSES = ("ok", "diverged", "failed", "running", "pending")  # pending: not started (--collect)
FIELDS = ("table", "pair", "row", "config", "tokenized_bleu", "sacrebleu", "sacrebleu_signature",
          "chrf", "chrf++", "chrf_signature", "p_value", "status", "updates", "minutes", "paper_bleu", "length_ratio", "selected_update", "dev_bleu",
          "seed", "compound_split_bleu", "multi_bleu_detok", "stopped_by", "seeds_p_value", "p_value_seed_aware",
          "p_value_adjusted", "diff_ci_low", "diff_ci_high")
REQUIRED_FIELDS = ("table", "pair", "row", "config", "status")
FLOAT_FIELDS = ("tokenized_bleu", "sacrebleu", "chrf", "chrf++", "p_value", "minutes", "paper_bleu", "length_ratio", "dev_bleu",
                "compound_split_bleu", "multi_bleu_detok", "seeds_p_value", "p_value_seed_aware", "p_value_adjusted",
                "diff_ci_low", "diff_ci_high")
INT_FIELDS = ("updates", "selected_update", "seed")
DEFAULT_SEED = 1
#: column headers of the metrics in the runs list
METRIC_COLUMNS = {"tokenized_bleu": "BLEU", "compound_split_bleu": "compound-split",
                  "multi_bleu_detok": "multi-bleu-detok", "sacrebleu": "sacreBLEU", "chrf": "chrF",
                  "chrf++": "chrF++"}
#: the results.csv field whose p-value decides a cell's mark
MARK_P_FIELD = "p_value_adjusted"
SIGNIFICANCE_MARKS = ((0.01, "\u2021"), (0.05, "\u2020"))  # double dagger, dagger
#: a BLEU whose hypotheses are this much shorter or longer than the references is flagged
LENGTH_RATIO_RANGE = (0.5, 2.0)
LENGTH_MARK = "\u00a7"  # section sign
LEGEND = (
    "Cells: our test score in the metric named under each table, the published number in "
    "parentheses where configs/paper_results.json has one for a row of that configuration in that "
    "metric (other published numbers are listed under the table, with the reason); `-` no run. "
    "With several seeds a cell is the mean \u00b1 sample standard deviation over the seeds that "
    "finished, and [k/n diverged] (failed, running) counts the others. "
    "\u2020 p < 0.05, \u2021 p < 0.01 against the table's baseline row, p being p (adj.) of the runs "
    "list (p_value_adjusted in results.csv): a paired bootstrap in the table's metric that resamples "
    "test sentences and training seeds together (10,000 resamples, every finished seed of both rows; "
    "with one seed a row, the paired bootstrap over test sentences), Holm-adjusted over all the "
    "table's compared cells (the number is under each table; docs/evaluation.md); the same resamples "
    "give diff 95% CI, the interval of the cell's difference from its baseline. The runs list adds p, the paired bootstrap over the "
    "concatenated test sets of the seeds both rows finished (test-set sampling only), and with "
    "several seeds p (seeds), an exact permutation test of the two rows' per-seed scores (its "
    "smallest value is 0.1 with 3 seeds against 3). "
    "*diverged*, *failed*, *running*: the run's status, no score.")


def _convert(field: str, value):
    if value is None or value == "":
        return None
    try:
        return int(float(value)) if field in INT_FIELDS else float(value)
    except (TypeError, ValueError):
        raise NormplugError(f"result field {field}={value!r} is not a number") from None


def normalize_row(row: dict, paper: Optional[dict] = None) -> dict:
    """A checked copy of ``row`` with every key of :data:`FIELDS` (missing ones None, ``seed``
    1), numbers converted, and ``paper_bleu`` looked up in ``paper`` when not given."""
    unknown = set(row) - set(FIELDS)
    if unknown:
        raise NormplugError(f"unknown result field(s) {sorted(unknown)}; fields are {', '.join(FIELDS)}")
    missing = [field for field in REQUIRED_FIELDS if not row.get(field)]
    if missing:
        raise NormplugError(f"result row {row} lacks {', '.join(missing)}")
    out = {field: row.get(field) for field in FIELDS}
    for field in FLOAT_FIELDS + INT_FIELDS:
        out[field] = _convert(field, out[field])
    if out["seed"] is None:
        out["seed"] = DEFAULT_SEED
    if out["status"] not in STATUSES:
        raise NormplugError(f"unknown status {out['status']!r}; choose from {', '.join(STATUSES)}")
    if out["status"] == "ok" and out["tokenized_bleu"] is None:
        raise NormplugError(f"status ok but no tokenized_bleu for {out['table']}/{out['row']}/{out['pair']}")
    if out["paper_bleu"] is None and paper is not None:
        out["paper_bleu"] = paper_bleu(paper, out["table"], out["config"], out["pair"])
    return out


def render_csv(rows: Sequence[dict]) -> str:
    """results.csv: a header of :data:`FIELDS`, one line per normalized row (one per seed),
    None as empty."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def read_results_csv(path: str) -> List[dict]:
    """Rows of a results.csv written by :func:`write_results` (e.g. to update and rewrite it);
    a CSV written before seeds existed reads as seed 1."""
    if not os.path.isfile(path):
        raise NormplugError(f"no such results file: {path}")
    with open(path, encoding="utf-8", newline="") as f:
        return [normalize_row({k: (v or None) for k, v in row.items()}) for row in csv.DictReader(f)]


def significance_mark(p_value: Optional[float]) -> str:
    """``\u2021`` for p < 0.01, ``\u2020`` for p < 0.05, else nothing."""
    for threshold, mark in SIGNIFICANCE_MARKS:
        if p_value is not None and p_value < threshold:
            return mark
    return ""


def length_mark(ratio: Optional[float]) -> str:
    """:data:`LENGTH_MARK` when the hypothesis/reference length ratio lies outside
    :data:`LENGTH_RATIO_RANGE` (a BLEU of run-on or truncated output), else nothing."""
    low, high = LENGTH_RATIO_RANGE
    return LENGTH_MARK if ratio is not None and not low <= ratio <= high else ""


def _several_seeds(rows: Sequence[dict]) -> bool:
    return any(row["seed"] != DEFAULT_SEED for row in rows)


def _run_name(row: dict, seeds: bool) -> str:
    seed = f", seed {row['seed']}" if seeds else ""
    return f"{row['row']} ({row['table']}, {row['pair']}{seed})"


def _length_note(rows: Sequence[dict]) -> List[str]:
    """The footnote of :data:`LENGTH_MARK`, naming each flagged run and its ratio."""
    flagged = [r for r in rows if r["tokenized_bleu"] is not None and length_mark(r["length_ratio"])]
    if not flagged:
        return []
    low, high = LENGTH_RATIO_RANGE
    seeds = _several_seeds(rows)
    ratios = "; ".join(f"{_run_name(r, seeds)}: {r['length_ratio']:.2f}" for r in flagged)
    return [f"{LENGTH_MARK} test hypotheses far shorter or longer than the references (hypothesis/"
            f"reference token-length ratio outside {low:g}-{high:g}): such a BLEU mostly measures "
            f"truncated or run-on output, not translation quality. Ratios: {ratios}.", ""]


def _pair_label(pair: str) -> str:
    return pair.replace("-", "\u2192") if re.fullmatch(r"[a-z]{2,3}-[a-z]{2,3}", pair) else pair


def _md(text) -> str:
    return str(text).replace("|", "\\|")


def _num(value: Optional[float], digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _mean_sd(values: Sequence[float]) -> str:
    """``x.xx`` for one value, ``mean \u00b1 sd`` (sample standard deviation) for several."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.fmean(values):.2f} \u00b1 {statistics.stdev(values):.2f}"


def _status_counts(runs: Sequence[dict]) -> str:
    """``1/3 diverged, 1/3 running``: the seeds of a cell that did not finish, by status."""
    counts = [(status, sum(run["status"] == status for run in runs)) for status in STATUSES[1:]]
    return ", ".join(f"{count}/{len(runs)} {status}" for status, count in counts if count)


def _cell(runs: Sequence[dict], metric: str, paper_number: Optional[float]) -> str:
    """One cell: the seeds of a (row, pair) in ``metric``, with the published number."""
    finished = [run for run in runs if run["status"] == "ok"]
    if not runs:
        ours = "-"
    elif not finished:
        ours = f"*{runs[0]['status']}*" if len(runs) == 1 else f"*{_status_counts(runs)}*"
    else:
        values = [run[metric] for run in finished if run[metric] is not None]
        p_value = next((run[MARK_P_FIELD] for run in finished if run[MARK_P_FIELD] is not None), None)
        flagged = any(length_mark(run["length_ratio"]) for run in finished)
        ours = (f"{_mean_sd(values)}{significance_mark(p_value)}{LENGTH_MARK if flagged else ''}"
                if values else "n/a")
        if len(finished) < len(runs):
            ours += f" [{_status_counts(runs)}]"
    return ours if paper_number is None else f"{ours} ({paper_number:.2f})"


def _ordered(first: Sequence[str], seen: Sequence[str]) -> List[str]:
    """``seen`` ordered: the names also in ``first`` in that order, then the rest as seen."""
    present = set(seen)
    rest = list(dict.fromkeys(name for name in seen if name not in first))
    return [name for name in first if name in present] + rest


def _cells(table: str, runs: Sequence[dict]) -> Dict[Tuple[str, str], List[dict]]:
    """{(row, pair): its runs, one per seed}; two results for one seed are an error."""
    cells: Dict[Tuple[str, str], List[dict]] = {}
    for run in runs:
        cell = cells.setdefault((run["row"], run["pair"]), [])
        twin = next((other for other in cell if other["seed"] == run["seed"]), None)
        if twin is not None:
            seed = f" seed {run['seed']}" if run["seed"] != DEFAULT_SEED else ""
            raise NormplugError(f"two results for {table} row {run['row']!r} pair {run['pair']!r}{seed} "
                                f"(configs {twin['config']!r}, {run['config']!r})")
        cell.append(run)
    return cells


def _ours_in(runs: Sequence[dict], metric: str) -> Optional[str]:
    values = [run[metric] for run in runs if run["status"] == "ok" and run.get(metric) is not None]
    return _mean_sd(values) if values else None


def _unshown_references(table: str, runs: Sequence[dict], pairs: Sequence[str], paper: dict) -> List[str]:
    """Lines naming every published number of ``table`` (for the pairs shown) that no cell shows,
    and why: another metric than the cells', or no row of its configuration."""
    metric = cell_metric(paper, table)
    configs = {run["row"]: run["config"] for run in runs}
    lines = []
    for reference in references(paper, table):
        shown_pairs = [pair for pair in pairs if pair in reference.bleu]
        same = [row for row, config in configs.items() if reference.matches(row_configuration(config))]
        if not shown_pairs or (same and reference.metric == metric):
            continue
        numbers = ", ".join(f"{_pair_label(pair)} {reference.bleu[pair]:.2f}" for pair in shown_pairs)
        what = reference.description or ", ".join(f"{k} {v}" for k, v in reference.configuration.items())
        reasons = []
        if not same:
            reasons.append("different configuration: no row here has it")
        if reference.metric != metric:
            reasons.append(f"different metric: the cells are {METRICS[metric].split(' (')[0]}")
        ours = []
        for row in same:
            for pair in shown_pairs:
                value = _ours_in([r for r in runs if r["row"] == row and r["pair"] == pair], reference.metric)
                if value is not None:
                    ours.append(f"{row} ({_pair_label(pair)}) {value}")
        if ours:
            reasons.append(f"ours in that metric: {'; '.join(ours)}")
        lines.append(f"* {numbers}, {METRICS[reference.metric]}; {reference.source}; configuration: {what}. "
                     f"Not beside a row: {'; '.join(reasons)}.")
    if not lines:
        return []
    return ["Published numbers not beside a row (configs/paper_results.json):", ""] + lines + [""]


def _marks_line(runs: Sequence[dict]) -> List[str]:
    """How many comparisons the marks of a table are Holm-adjusted over (its cells with a p)."""
    compared = {(run["row"], run["pair"]) for run in runs if run[MARK_P_FIELD] is not None}
    if not compared:
        return []
    return [f"Marks: p (adj.), the seed-aware bootstrap's p Holm-adjusted over the {len(compared)} compared "
            f"cell{'s' if len(compared) > 1 else ''} of this table; \u2020 p < 0.05, \u2021 p < 0.01.", ""]


def _seeds_line(runs: Sequence[dict], pairs: Sequence[str]) -> List[str]:
    """Which seeds the cells of each pair are over (a table of several seeds): ``Seeds: de→en
    cells over seeds 1, 2, 3; az→en cells over seeds 1, 2`` when the pairs differ (reproduce.sh
    --seeds PAIR=N,N,...), ``Seeds: every cell over seeds 1, 2, 3`` when they do not."""
    if not _several_seeds(runs):
        return []
    seeds = {pair: sorted({run["seed"] for run in runs if run["pair"] == pair}) for pair in pairs}
    listed = {pair: ", ".join(map(str, numbers)) for pair, numbers in seeds.items()}
    if len(set(listed.values())) == 1:
        return [f"Seeds: every cell over seeds {next(iter(listed.values()))}.", ""]
    return ["Seeds: " + "; ".join(f"{_pair_label(pair)} cells over seeds {listed[pair]}" for pair in pairs)
            + " (the pairs were collected with different seeds: reproduce.sh --seeds PAIR=N,N,...).", ""]


def _table_section(table: str, runs: List[dict], paper: dict) -> List[str]:
    spec = paper.get("tables", {}).get(table, {})
    metric = cell_metric(paper, table)
    pairs = _ordered(spec.get("pairs", []), [run["pair"] for run in runs])
    row_ids = list(dict.fromkeys(run["row"] for run in runs))
    cells = _cells(table, runs)
    configs = {run["row"]: run["config"] for run in runs}
    lines = [f"## {_md(spec.get('title', table))}", "", f"Cells: {METRICS[metric]}.", ""] + _seeds_line(runs, pairs) + \
        _marks_line(runs) + [
             "| | " + " | ".join(_pair_label(p) for p in pairs) + " |",
             "|---|" + "---:|" * len(pairs)]
    for row_id in row_ids:
        row_cells = []
        for pair in pairs:
            cell = cells.get((row_id, pair), [])
            explicit = next((run["paper_bleu"] for run in cell if run["paper_bleu"] is not None), None)
            number = explicit if explicit is not None else paper_bleu(paper, table, configs[row_id], pair)
            row_cells.append(_cell(cell, metric, number))
        lines.append(f"| {_md(row_id)} | " + " | ".join(_md(c) for c in row_cells) + " |")
    return lines + [""] + _unshown_references(table, runs, pairs, paper)


def _extra_metrics(rows: Sequence[dict], paper: dict) -> List[str]:
    """Metrics the runs list shows beside tokenized BLEU, sacreBLEU and chrF: each table's cell
    metric and the metrics of its published numbers."""
    tables = list(dict.fromkeys(row["table"] for row in rows))
    wanted = [cell_metric(paper, table) for table in tables]
    wanted += [reference.metric for table in tables for reference in references(paper, table)]
    return [metric for metric in METRICS if metric in wanted and metric not in ("tokenized_bleu", "sacrebleu", "chrf")]


def _p(p_value: Optional[float]) -> str:
    return "" if p_value is None else f"{p_value:.3g}"


def _interval(low: Optional[float], high: Optional[float]) -> str:
    """``[-0.52, +2.10]``: a difference's interval, signed; empty when unknown."""
    return "" if low is None or high is None else f"[{low:+.2f}, {high:+.2f}]"


def _runs_section(rows: List[dict], paper: dict) -> List[str]:
    signatures = list(dict.fromkeys(r["sacrebleu_signature"] for r in rows if r["sacrebleu_signature"]))
    seeds = _several_seeds(rows)
    extra = _extra_metrics(rows, paper)
    intro = ("Selected: the update of the tested checkpoint (best dev BLEU); dev BLEU and test BLEU "
             "are both tokenized BLEU of that checkpoint with the same decoder.")
    if seeds:
        intro += (" One line per seed; p (bootstrap over test sentences), p (seeds), p (adj.) and the "
                  "diff 95% CI are the cell's, over all its seeds.")
    stops = any(r["stopped_by"] for r in rows)  # the rule that ended each training, when known
    head = ["table", "row", "config", "pair"] + (["seed"] if seeds else []) + [
        "status", "updates"] + (["stopped by"] if stops else []) + [
        "minutes", "selected", "dev BLEU", "BLEU", "sacreBLEU", "chrF"] + [
        METRIC_COLUMNS[m] for m in extra] + ["hyp/ref", "p"] + (["p (seeds)"] if seeds else []) + ["p (adj.)", "diff 95% CI"]
    align = ["---"] * (5 if seeds else 4) + ["---", "---:"] + (["---"] if stops else []) + \
        ["---:"] * (len(head) - (7 if seeds else 6) - stops)
    lines = ["## Runs", "", intro, "", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        sacre, bleu = _num(r["sacrebleu"]), _num(r["tokenized_bleu"])
        bleu += length_mark(r["length_ratio"]) if bleu else ""
        if sacre and len(signatures) > 1:
            sacre += f" [{signatures.index(r['sacrebleu_signature']) + 1}]"
        values = [r["table"], r["row"], r["config"], r["pair"]] + ([r["seed"]] if seeds else []) + [
            r["status"], "" if r["updates"] is None else r["updates"]] + ([r["stopped_by"] or ""] if stops else []) + [
            _num(r["minutes"], 1), "" if r["selected_update"] is None else r["selected_update"], _num(r["dev_bleu"]),
            bleu, sacre, _num(r["chrf"])] + [_num(r[m]) for m in extra] + [
            _num(r["length_ratio"], 3), _p(r["p_value"])] + ([_p(r["seeds_p_value"])] if seeds else []) + [_p(r["p_value_adjusted"]), _interval(r["diff_ci_low"], r["diff_ci_high"])]
        lines.append("| " + " | ".join(_md(v) for v in values) + " |")
    lines.append("")
    if len(signatures) == 1:
        lines += [f"sacreBLEU signature: `{signatures[0]}`", ""]
    elif signatures:
        lines += [f"[{i}] sacreBLEU signature: `{sig}`  " for i, sig in enumerate(signatures, 1)] + [""]
    chrf_signatures = list(dict.fromkeys(r["chrf_signature"] for r in rows if r["chrf_signature"]))
    if chrf_signatures:
        lines += [f"chrF signature{'s' if len(chrf_signatures) > 1 else ''}: "
                  + ", ".join(f"`{sig}`" for sig in chrf_signatures)
                  + (" (chrF++: the same with `nw:2`)" if "chrf++" in extra else ""), ""]
    return lines


def render_markdown(rows: Sequence[dict], paper: dict, title: str = "Results") -> str:
    """The Markdown report of normalized ``rows``: one section per paper table, then every run."""
    paper = checked_paper_results(paper)
    lines = [f"# {title}", "", LEGEND, ""] + _length_note(rows)
    for table in dict.fromkeys(row["table"] for row in rows):
        lines += _table_section(table, [row for row in rows if row["table"] == table], paper)
    return "\n".join(lines + _runs_section(list(rows), paper))


#: the file beside results.csv naming the table whose results the folder holds
OWNER_FILE = "table.txt"


def results_owner(out_dir: str) -> Optional[str]:
    """The table whose results ``out_dir`` holds: its :data:`OWNER_FILE`, or, for a folder written
    before that file existed, the tables its results.csv names; None when it holds no results."""
    try:
        with open(os.path.join(out_dir, OWNER_FILE), encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return None
    try:
        with open(os.path.join(out_dir, "results.csv"), encoding="utf-8", newline="") as f:
            names = [row.get("table") for row in csv.DictReader(f)]
    except (OSError, ValueError, csv.Error):
        return None
    return ", ".join(dict.fromkeys(name for name in names if name)) or None


def results_owner_problem(out_dir: str, table: str) -> Optional[str]:
    """Why ``table``'s results cannot go into ``out_dir`` (another table's results are there: one
    would replace the other's results.md and results.csv and sit beside its figures), else None."""
    owner = results_owner(out_dir)
    if owner is None or owner == table:
        return None
    return (f"the results folder {out_dir} holds the results of table {owner}, not {table}: "
            f"give {table} its own --results-dir, or delete {out_dir}")


def write_results(rows: Sequence[dict], out_dir: str, paper: Optional[dict] = None,
                  title: str = "Results") -> Tuple[str, str]:
    """Write ``out_dir/results.csv`` and ``out_dir/results.md`` (headed ``title``)
    atomically; return their paths. ``paper`` defaults to configs/paper_results.json. A folder
    belongs to one table (:data:`OWNER_FILE`): another table's results there are refused."""
    paper = load_paper_results() if paper is None else checked_paper_results(paper)
    normalized = [normalize_row(row, paper) for row in rows]
    owner = ", ".join(dict.fromkeys(row["table"] for row in normalized))
    problem = results_owner_problem(out_dir, owner)
    if problem:
        raise NormplugError(problem)
    csv_path, md_path = os.path.join(out_dir, "results.csv"), os.path.join(out_dir, "results.md")
    markdown = render_markdown(normalized, paper, title)
    if owner:
        write_text_atomic(os.path.join(out_dir, OWNER_FILE), owner + "\n")
    write_text_atomic(csv_path, render_csv(normalized))
    write_text_atomic(md_path, markdown)
    return csv_path, md_path
