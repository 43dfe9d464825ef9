"""Result tables: ``results.csv`` (one line per run) and ``results.md`` (laid out like the
paper's tables: one row per configuration, one column per language pair, cells
"ours (paper)"), both written atomically.

A result row is a dict with the keys of :data:`FIELDS`:

* ``table``: the paper table it belongs to (``table3``, as configs/experiments/<table>.json);
* ``pair``: ``src-tgt`` as fairseq names it (``gl-en``, ``en-vi``, ``en-de``);
* ``row``: the row name, as in configs/experiments/<table>.json (``PreNorm + FixNorm +
  ScaleNorm``); rows of configs/paper_results.json pick up the paper's number;
* ``config``: the run's configuration name;
* ``tokenized_bleu``: the paper's metric; ``sacrebleu`` + ``sacrebleu_signature``;
* ``p_value``: paired bootstrap p-value against the row's baseline row (None for a baseline);
* ``length_ratio``: test hypotheses' token length over the references' (``sys_len / ref_len``);
  outside :data:`LENGTH_RATIO_RANGE` the BLEU is flagged with :data:`LENGTH_MARK`;
* ``status``: one of :data:`STATUSES`; ``updates``, ``minutes``: training length;
* ``paper_bleu``: the paper's number (filled from configs/paper_results.json when None).
"""
import contextlib
import csv
import io
import json
import os
import re
import tempfile
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from fairseq_normplug.errors import NormplugError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER_RESULTS_PATH = os.path.join(REPO, "configs", "paper_results.json")
STATUSES = ("ok", "diverged", "failed", "running")
FIELDS = ("table", "pair", "row", "config", "tokenized_bleu", "sacrebleu", "sacrebleu_signature",
          "p_value", "status", "updates", "minutes", "paper_bleu", "length_ratio")
REQUIRED_FIELDS = ("table", "pair", "row", "config", "status")
FLOAT_FIELDS = ("tokenized_bleu", "sacrebleu", "p_value", "minutes", "paper_bleu", "length_ratio")
INT_FIELDS = ("updates",)
SIGNIFICANCE_MARKS = ((0.01, "\u2021"), (0.05, "\u2020"))  # double dagger, dagger
#: a BLEU whose hypotheses are this much shorter or longer than the references is flagged
LENGTH_RATIO_RANGE = (0.5, 2.0)
LENGTH_MARK = "\u00a7"  # section sign
LEGEND = (
    "Cells: our test BLEU (tokenized, multi-bleu.perl equivalent), the paper's number in "
    "parentheses where the paper reports one; `-` no run. "
    "\u2020 p < 0.05, \u2021 p < 0.01 against the table's baseline row (paired bootstrap "
    "resampling, 1000 resamples). *diverged*, *failed*, *running*: the run's status, no score.")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, rename it to
    ``path`` (readers never see a half-written file), else delete it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                                   suffix=".tmp")
    os.close(handle)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` through :func:`atomic_output`."""
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def load_paper_results(path: str = PAPER_RESULTS_PATH) -> dict:
    """The paper's numbers: ``{"tables": {table: {"title": str, "pairs": [pair, ...],
    "rows": {row name: {pair: BLEU or null}}}}}``."""
    if not os.path.isfile(path):
        raise NormplugError(f"no such paper-results file: {path}")
    with open(path, encoding="utf-8") as f:
        paper = json.load(f)
    for table, spec in paper.get("tables", {}).items():
        for row, numbers in spec.get("rows", {}).items():
            unknown = set(numbers) - set(spec.get("pairs", []))
            if unknown:
                raise NormplugError(f"{path}: {table}/{row} has numbers for pairs "
                                    f"{sorted(unknown)} not in the table's pairs")
    return paper


def paper_bleu(paper: dict, table: str, row: str, pair: str) -> Optional[float]:
    """The paper's BLEU for one cell, None where the paper (as we have it) has no number."""
    return paper.get("tables", {}).get(table, {}).get("rows", {}).get(row, {}).get(pair)


def _convert(field: str, value):
    if value is None or value == "":
        return None
    try:
        return int(float(value)) if field in INT_FIELDS else float(value)
    except (TypeError, ValueError):
        raise NormplugError(f"result field {field}={value!r} is not a number") from None


def normalize_row(row: dict, paper: Optional[dict] = None) -> dict:
    """A checked copy of ``row`` with every key of :data:`FIELDS` (missing ones None),
    numbers converted, and ``paper_bleu`` looked up in ``paper`` when not given."""
    unknown = set(row) - set(FIELDS)
    if unknown:
        raise NormplugError(f"unknown result field(s) {sorted(unknown)}; fields are {', '.join(FIELDS)}")
    missing = [field for field in REQUIRED_FIELDS if not row.get(field)]
    if missing:
        raise NormplugError(f"result row {row} lacks {', '.join(missing)}")
    out = {field: row.get(field) for field in FIELDS}
    for field in FLOAT_FIELDS + INT_FIELDS:
        out[field] = _convert(field, out[field])
    if out["status"] not in STATUSES:
        raise NormplugError(f"unknown status {out['status']!r}; choose from {', '.join(STATUSES)}")
    if out["status"] == "ok" and out["tokenized_bleu"] is None:
        raise NormplugError(f"status ok but no tokenized_bleu for {out['table']}/{out['row']}/{out['pair']}")
    if out["paper_bleu"] is None and paper is not None:
        out["paper_bleu"] = paper_bleu(paper, out["table"], out["row"], out["pair"])
    return out


def render_csv(rows: Sequence[dict]) -> str:
    """results.csv: a header of :data:`FIELDS`, one line per normalized row, None as empty."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def read_results_csv(path: str) -> List[dict]:
    """Rows of a results.csv written by :func:`write_results` (e.g. to update and rewrite it)."""
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


def _length_note(rows: Sequence[dict]) -> List[str]:
    """The footnote of :data:`LENGTH_MARK`, naming each flagged run and its ratio."""
    flagged = [r for r in rows if r["tokenized_bleu"] is not None and length_mark(r["length_ratio"])]
    if not flagged:
        return []
    low, high = LENGTH_RATIO_RANGE
    ratios = "; ".join(f"{r['row']} ({r['table']}, {r['pair']}): {r['length_ratio']:.2f}" for r in flagged)
    return [f"{LENGTH_MARK} test hypotheses far shorter or longer than the references (hypothesis/"
            f"reference token-length ratio outside {low:g}-{high:g}): such a BLEU mostly measures "
            f"truncated or run-on output, not translation quality. Ratios: {ratios}.", ""]


def _pair_label(pair: str) -> str:
    return pair.replace("-", "\u2192") if re.fullmatch(r"[a-z]{2,3}-[a-z]{2,3}", pair) else pair


def _md(text) -> str:
    return str(text).replace("|", "\\|")


def _num(value: Optional[float], digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _cell(run: Optional[dict], paper_number: Optional[float]) -> str:
    if run is None:
        ours = "-"
    elif run["status"] == "ok":
        ours = (f"{run['tokenized_bleu']:.2f}{significance_mark(run['p_value'])}"
                f"{length_mark(run['length_ratio'])}")
    else:
        ours = f"*{run['status']}*"
    return ours if paper_number is None else f"{ours} ({paper_number:.2f})"


def _ordered(first: Sequence[str], seen: Sequence[str]) -> List[str]:
    """``seen`` ordered: the names also in ``first`` in that order, then the rest as seen."""
    present = set(seen)
    rest = list(dict.fromkeys(name for name in seen if name not in first))
    return [name for name in first if name in present] + rest


def _table_section(table: str, runs: List[dict], paper: dict) -> List[str]:
    spec = paper.get("tables", {}).get(table, {})
    pairs = _ordered(spec.get("pairs", []), [run["pair"] for run in runs])
    row_ids = _ordered(list(spec.get("rows", {})), [run["row"] for run in runs])
    cells: Dict[Tuple[str, str], dict] = {}
    for run in runs:
        key = (run["row"], run["pair"])
        if key in cells:
            raise NormplugError(f"two results for {table} row {run['row']!r} pair {run['pair']!r} "
                                f"(configs {cells[key]['config']!r}, {run['config']!r})")
        cells[key] = run
    lines = [f"## {_md(spec.get('title', table))}", "",
             "| | " + " | ".join(_pair_label(p) for p in pairs) + " |",
             "|---|" + "---:|" * len(pairs)]
    for row_id in row_ids:
        row_cells = []
        for pair in pairs:
            run = cells.get((row_id, pair))
            number = run["paper_bleu"] if run else paper_bleu(paper, table, row_id, pair)
            row_cells.append(_cell(run, number))
        lines.append(f"| {_md(row_id)} | " + " | ".join(_md(c) for c in row_cells) + " |")
    return lines + [""]


def _runs_section(rows: List[dict]) -> List[str]:
    signatures = list(dict.fromkeys(r["sacrebleu_signature"] for r in rows if r["sacrebleu_signature"]))
    lines = ["## Runs", "",
             "| table | row | config | pair | status | updates | minutes | BLEU | sacreBLEU | p |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        sacre, bleu = _num(r["sacrebleu"]), _num(r["tokenized_bleu"])
        bleu += length_mark(r["length_ratio"]) if bleu else ""
        if sacre and len(signatures) > 1:
            sacre += f" [{signatures.index(r['sacrebleu_signature']) + 1}]"
        values = [r["table"], r["row"], r["config"], r["pair"], r["status"],
                  "" if r["updates"] is None else r["updates"], _num(r["minutes"], 1),
                  bleu, sacre, "" if r["p_value"] is None else f"{r['p_value']:.3g}"]
        lines.append("| " + " | ".join(_md(v) for v in values) + " |")
    lines.append("")
    if len(signatures) == 1:
        lines += [f"sacreBLEU signature: `{signatures[0]}`", ""]
    elif signatures:
        lines += [f"[{i}] sacreBLEU signature: `{sig}`  " for i, sig in enumerate(signatures, 1)] + [""]
    return lines


def render_markdown(rows: Sequence[dict], paper: dict, title: str = "Results") -> str:
    """The Markdown report of normalized ``rows``: one section per paper table, then every run."""
    lines = [f"# {title}", "", LEGEND, ""] + _length_note(rows)
    for table in dict.fromkeys(row["table"] for row in rows):
        lines += _table_section(table, [row for row in rows if row["table"] == table], paper)
    return "\n".join(lines + _runs_section(list(rows)))


def write_results(rows: Sequence[dict], out_dir: str, paper: Optional[dict] = None,
                  title: str = "Results") -> Tuple[str, str]:
    """Write ``out_dir/results.csv`` and ``out_dir/results.md`` (headed ``title``)
    atomically; return their paths. ``paper`` defaults to configs/paper_results.json."""
    paper = load_paper_results() if paper is None else paper
    normalized = [normalize_row(row, paper) for row in rows]
    csv_path, md_path = os.path.join(out_dir, "results.csv"), os.path.join(out_dir, "results.md")
    markdown = render_markdown(normalized, paper, title)
    write_text_atomic(csv_path, render_csv(normalized))
    write_text_atomic(md_path, markdown)
    return csv_path, md_path
