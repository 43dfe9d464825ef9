"""A table trained at several depths (``configs/experiments/depth.json``, docs/depth.md): each
row of the file is one design, trained once per depth of the table's ``depths`` with
``--encoder-layers N --decoder-layers N``, and compared with its baseline at the same depth.

* At the recipe's own depth (the table's ``recipe_layers``: what its ``--arch`` builds) a row
  keeps its name and flags, so its runs are those of any other table with that row on that
  recipe: ``reuse_runs_from`` names such a table's runs folder (``beyond.cpu_short``), and a
  finished run there whose recorded command equals this run's is copied in instead of trained
  again (:func:`adopt_kept_runs`).
* At any other depth N the row is ``NAME, N layers``.
"""
import os
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

from fairseq_normplug.atomic_files import copy_atomic
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.tables import significance_mark

#: the records a finished run folder holds (checkpoints are not kept, docs/results/runs/README.md)
KEPT_RECORDS = ("train.log", "generate-test.txt", "scores.json", "status.json")  # status.json last: it marks done


def depth_name(name: str, layers: int, recipe_layers: int) -> str:
    """The row ``name`` at ``layers`` layers per stack: its own name at the recipe's depth."""
    return name if layers == recipe_layers else f"{name}, {layers} layers"


def check_depths(depths, recipe_layers, where: str) -> List[int]:
    """``depths`` if it is a list of distinct positive layer counts and ``recipe_layers`` one,
    else a one-line NormplugError."""
    if not isinstance(depths, list) or not depths or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in depths):
        raise NormplugError(f"{where}: 'depths' must list layer counts per stack (integers >= 1), got {depths!r}")
    if len(set(depths)) != len(depths):
        raise NormplugError(f"{where}: 'depths' lists a depth twice: {depths!r}")
    if isinstance(recipe_layers, bool) or not isinstance(recipe_layers, int) or recipe_layers < 1:
        raise NormplugError(f"{where}: a table with 'depths' needs 'recipe_layers', the layers per stack its "
                            f"recipe's --arch builds (an integer >= 1), got {recipe_layers!r}")
    return list(depths)


def expand_rows(rows: Sequence, depths: Sequence[int], recipe_layers: int) -> List:
    """Each row of ``rows`` once per depth (depth by depth, in the file's row order), its
    baseline the baseline row at the same depth."""
    expanded = []
    for layers in depths:
        flags = [] if layers == recipe_layers else ["--encoder-layers", str(layers), "--decoder-layers", str(layers)]
        for row in rows:
            baseline = depth_name(row.baseline, layers, recipe_layers) if row.baseline else None
            expanded.append(replace(row, name=depth_name(row.name, layers, recipe_layers), model=row.model + flags,
                                    baseline=baseline, design=row.name, layers=layers))
    return expanded


def rows_at_depths(table, depths: Sequence[int], rows: Sequence[str] = ()) -> List[str]:
    """The names of ``table``'s rows at ``depths`` (``reproduce.sh --depths``), of those in
    ``rows`` when given (designs or expanded names); a one-line NormplugError for a table without
    depths or a depth it does not train."""
    if not table.depths:
        raise NormplugError(f"--depths: the table {table.name} is not trained at several depths")
    unknown = [d for d in depths if d not in table.depths]
    if unknown:
        raise NormplugError(f"--depths {unknown[0]}: the table {table.name} trains depths "
                            f"{', '.join(map(str, table.depths))}")
    unknown = [name for name in rows if not any(name in (row.name, row.design) for row in table.rows)]
    if unknown:
        raise NormplugError(f"--rows {unknown[0]!r}: the table {table.name} has no such row; rows: "
                            f"{', '.join(dict.fromkeys(row.design for row in table.rows))}")
    selected = [row.name for row in table.rows
                if row.layers in depths and (not rows or row.name in rows or row.design in rows)]
    if not selected:
        raise NormplugError(f"--depths: no run at depths {', '.join(map(str, depths))} among --rows "
                            f"{', '.join(repr(name) for name in rows)}")
    return selected


def adopt_kept_runs(runs: List, runs_dir: str, echo: Callable[[str], None] = print) -> List:
    """Copy into each not-started run of a table with ``reuse_runs_from`` the records of the same
    row's finished (done or diverged) run in that runs folder, when that run's recorded
    fairseq-train command equals this run's (run folder and data paths aside); returns the
    adopted runs. Only rows at the recipe's depth can match (elsewhere the layer flags differ)."""
    # imported here: runs and run_commands import configs, which imports this module
    from fairseq_normplug.experiments.run_commands import changed_flags
    from fairseq_normplug.experiments.run_records import read_json
    from fairseq_normplug.experiments.runs import run_folder

    adopted = []
    for run in runs:
        source_table = run.table.reuse_runs_from
        if not source_table or os.path.exists(run.path("status.json")):
            continue
        source = run_folder(runs_dir, source_table, run.pair, run.row.name, run.seed)
        status = read_json(os.path.join(source, "status.json")) or {}
        if status.get("status") not in ("done", "diverged") or not status.get("command"):
            continue
        if changed_flags(status["command"], run.train_command()):
            continue
        os.makedirs(run.run_dir, exist_ok=True)
        for name in KEPT_RECORDS:
            if os.path.exists(os.path.join(source, name)):
                copy_atomic(os.path.join(source, name), run.path(name))
        echo(f"[reproduce] {run.label}: the finished run {source} has this command; its records are copied")
        adopted.append(run)
    return adopted


def by_design(results: Sequence[dict], table) -> Dict[str, Dict[int, dict]]:
    """{design: {layers: its results row}} of a depth table's results rows (seed 1)."""
    rows = {row.name: row for row in table.rows}
    grid: Dict[str, Dict[int, dict]] = {}
    for result in results:
        row = rows.get(result["row"])
        if row is not None and row.layers is not None and result.get("seed", 1) == 1:
            grid.setdefault(row.design, {})[row.layers] = result
    return grid


def _cell(result: Optional[dict], metric: str) -> str:
    if result is None:
        return "-"
    if result.get("status") != "ok":
        return f"*{result.get('status')}*"
    value = result.get(metric)
    return "-" if value is None else f"{value:.2f}{significance_mark(result.get('p_value_adjusted'))}"


def depth_markdown(results: Sequence[dict], table, metric: str = "tokenized_bleu") -> str:
    """results.md's design x depth section: one line per design, one column per depth."""
    grid = by_design(results, table)
    depths = list(table.depths)
    lines = [f"## {metric} by depth (layers per stack)", "",
             "| design | " + " | ".join(str(d) for d in depths) + " |",
             "|---|" + "---:|" * len(depths)]
    for design, cells in grid.items():
        lines.append(f"| {design} | " + " | ".join(_cell(cells.get(d), metric) for d in depths) + " |")
    lines.append("")
    lines.append("\u2020 p < 0.05, \u2021 p < 0.01 against the design's baseline at the same depth (p (adj.) of "
                 "results.md). *diverged*: the run's dev loss became NaN, over twice a uniform guess's, or "
                 "worse than a uniform guess after it had been better (docs/experiments.md); it is a result, "
                 "drawn as x in the figure. *pending*: not trained yet.")
    return "\n".join(lines) + "\n"
