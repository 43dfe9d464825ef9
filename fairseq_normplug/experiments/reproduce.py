"""``scripts/reproduce.sh TABLE [PAIR ...]``: run every row of a paper table on prepared data,
then write ``results/<TABLE>/results.{csv,md}`` and the figures.

Resumable: finished rows are skipped, interrupted ones resume from their last checkpoint,
diverged ones stay recorded as diverged. See docs/experiments.md.
"""
import argparse
import logging
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu, figures, tables
from fairseq_normplug.experiments.configs import REPO, Table, available_tables, load_data_locations, load_table
from fairseq_normplug.experiments.runner import (
    Run, check_data_dir, evaluate, read_json, run_folder, test_hypotheses, test_references, train,
)

#: run status (status.json) -> results-table status
RESULT_STATUS = {"done": "ok", "pending": "failed"}


def plan_runs(table: Table, pairs: List[str], data_dirs: Dict[str, str], runs_dir: str,
              rows: List[str] = (), seeds: Sequence[int] = (1,)) -> List[Run]:
    """All (pair, row, seed) runs, after checking every input (nothing is trained on bad input)."""
    selected = [table.row(name) for name in rows] if rows else table.rows
    runs = []
    for pair in pairs:
        if pair.count("-") != 1:
            raise NormplugError(f"bad language pair {pair!r}; write it as SRC-TGT, e.g. {table.pairs[0]}")
        if pair not in data_dirs:
            raise NormplugError(f"no data folder for {pair}: pass --data {pair}=DIR or add it to configs/data.json")
        check_data_dir(data_dirs[pair], pair)
        for row in selected:
            for seed in seeds:
                runs.append(Run(table=table, row=row, pair=pair, data_dir=data_dirs[pair], seed=seed,
                                run_dir=run_folder(runs_dir, table.name, pair, row.name, seed)))
    return runs


def _scored(run: Run) -> bool:
    return read_json(run.path("scores.json")) is not None


def cell_p_value(runs: Dict[int, Run], baseline: Dict[int, Run], metric: str = "tokenized_bleu") -> Optional[float]:
    """The p-value of one cell ({seed: run}) against its baseline row's cell on the same pair:
    paired bootstrap of ``metric`` over the concatenated test sets of the seeds that both
    finished, seed k of the row paired with seed k of the baseline (bleu.paired_bootstrap_seeds).
    None when no seed finished in both."""
    seeds = sorted(seed for seed in runs if seed in baseline and _scored(runs[seed]) and _scored(baseline[seed]))
    if not seeds:
        return None
    first = runs[seeds[0]]
    refs, _ = test_references(first.data_dir, first.tgt)
    return bleu.paired_bootstrap_seeds([test_hypotheses(baseline[seed], len(refs)) for seed in seeds],
                                       [test_hypotheses(runs[seed], len(refs)) for seed in seeds],
                                       refs, metric=metric).p_value


def result_rows(table: Table, runs: List[Run], paper: Optional[dict] = None) -> List[dict]:
    """One results-table row per run (per seed), with its cell's p-value against the baseline
    row on the same pair (:func:`cell_p_value`, in the table's cell metric of ``paper``,
    default configs/paper_results.json), the same on every seed's row."""
    metric = tables.cell_metric(tables.load_paper_results() if paper is None else paper, table.name)
    cells: Dict[tuple, Dict[int, Run]] = {}
    for run in runs:
        cells.setdefault((run.pair, run.row.name), {})[run.seed] = run
    p_values = {}
    for (pair, row_name), cell in cells.items():
        baseline_name = next(iter(cell.values())).row.baseline
        baseline = cells.get((pair, baseline_name)) if baseline_name else None
        p_values[(pair, row_name)] = cell_p_value(cell, baseline, metric) if baseline else None
    out = []
    for run in runs:
        status = run.status()
        scores = read_json(run.path("scores.json")) or {}
        out.append({
            "table": table.name, "pair": run.pair, "row": run.row.name, "seed": run.seed,
            "config": tables.config_string(run.row.model + run.row.train, run.row.schedule),
            "tokenized_bleu": scores.get("tokenized_bleu"), "sacrebleu": scores.get("sacrebleu"),
            "sacrebleu_signature": scores.get("sacrebleu_signature"),
            "compound_split_bleu": scores.get("compound_split_bleu"),
            "multi_bleu_detok": scores.get("multi_bleu_detok"),
            "p_value": p_values[(run.pair, run.row.name)] if scores else None,
            "length_ratio": bleu.length_ratio(scores),
            "status": RESULT_STATUS.get(status["status"], status["status"]),
            "updates": status.get("updates"), "minutes": status.get("minutes"),
            "selected_update": scores.get("selected_update"), "dev_bleu": scores.get("dev_bleu"),
        })
    return out


def figure_logs(runs: List[Run], pairs: Sequence[str]) -> Dict[str, List[str]]:
    """{figure label: the train.log of each of its seeds}: one label per row (per row and pair
    when the table runs several pairs); figures draw several seeds as a band."""
    logs: Dict[str, List[str]] = {}
    for run in runs:
        if os.path.exists(run.path("train.log")):
            label = f"{run.row.name} ({run.pair})" if len(pairs) > 1 else run.row.name
            logs.setdefault(label, []).append(run.path("train.log"))
    return logs


def run_table(table: Table, pairs: List[str], data_dirs: Dict[str, str], runs_dir: str, results_dir: str,
              rows: List[str] = (), extra_train: List[str] = (), echo: Callable[[str], None] = print) -> List[dict]:
    runs = plan_runs(table, pairs, data_dirs, runs_dir, rows)
    echo(f"[reproduce] {table.title}: {len(runs)} runs ({len(pairs)} pairs x {len(runs) // len(pairs)} rows)")
    for index, run in enumerate(runs, 1):
        echo(f"[reproduce] run {index}/{len(runs)}: {run.label}")
        train(run, extra_train, echo=echo)
        evaluate(run, echo=echo)
    results = result_rows(table, runs)
    os.makedirs(results_dir, exist_ok=True)
    tables.write_results(results, results_dir, title=table.title)
    for name, outcome in figures.make_figures(figures.load_logs(figure_logs(runs, pairs)), results_dir).items():
        echo(f"[reproduce] figure {name}: {outcome}")
    echo(f"[reproduce] results: {os.path.join(results_dir, 'results.md')}, "
         f"{os.path.join(results_dir, 'results.csv')}")
    return results


def parse_data_overrides(values: List[str]) -> Dict[str, str]:
    out = {}
    for value in values:
        if "=" not in value:
            raise NormplugError(f"--data takes PAIR=DIR, got {value!r}")
        pair, folder = value.split("=", 1)
        out[pair] = os.path.abspath(folder)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="reproduce.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"tables: {', '.join(available_tables())}")
    parser.add_argument("table", help="table to run, e.g. table3")
    parser.add_argument("pairs", nargs="*", help="language pairs (default: all of the table's)")
    parser.add_argument("--data", action="append", default=[], metavar="PAIR=DIR",
                        help="prepared data folder of a pair (default: configs/data.json)")
    parser.add_argument("--rows", nargs="+", default=[], metavar="NAME", help="only these rows")
    parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs"))
    parser.add_argument("--results-dir", help="default: results/TABLE")
    parser.add_argument("--train-flags", default="", help="extra fairseq-train flags, one string")
    args = parser.parse_args(argv)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        table = load_table(args.table)
        data_dirs = {**load_data_locations(), **parse_data_overrides(args.data)}
        run_table(table, args.pairs or table.pairs, data_dirs, args.runs_dir,
                  args.results_dir or os.path.join(REPO, "results", table.name), args.rows,
                  args.train_flags.split())
    except NormplugError as error:
        sys.exit(f"reproduce.sh: error: {error}")


if __name__ == "__main__":
    main()
