"""A table's results from its run folders: each run's results.csv row (status, scores, the
cell's p-values against its baseline cell), the training logs behind the figures, results.csv,
results.md and the figures written, and the failed runs named with their errors."""
import errno
import os
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.depth_figures import write_depth_outputs
from fairseq_normplug.experiments import bleu, figures, launchers, tables
from fairseq_normplug.experiments.configs import PAIR_PATTERN, Table
from fairseq_normplug.experiments.ownership import live_holder
from fairseq_normplug.experiments.run_records import read_scores
from fairseq_normplug.experiments.runs import Run
from fairseq_normplug.experiments.scoring import test_hypotheses, test_references
from fairseq_normplug.experiments.training_log import TrainingLog, parse_training_log


def result_status(run: Run, collecting: bool = False) -> str:
    """A run's one results.csv status: ``ok`` (trained and scored), ``diverged`` (a result),
    ``running`` (a live launcher owns it, or the table is still running: ``collecting``), or
    ``failed``: it failed, or trained without a score, or its process ended without a result, or
    a record of it is bad (runner.record_problem: named when the table is written).
    ``pending``: not started, in a table collected while it runs (``--collect``)."""
    state = run.status()["status"]
    if state == "done":
        return "ok" if read_scores(run.path("scores.json")) is not None else "failed"
    if state == "diverged":
        return "diverged"
    if live_holder(run.run_dir) is not None:
        return "running"
    if collecting and state in ("running", "pending") and not run.record_problems():
        return state
    return "failed"


def _scored(run: Run) -> bool:
    return read_scores(run.path("scores.json")) is not None


def _cell_lines(seeds_of_row: Sequence[List[Run]], metric: str) -> Tuple[List[List[List[str]]], List[str]]:
    """The test hypotheses of each row's given runs (one list per seed) and the references, as
    ``metric`` scores them: tokenized, or for chrF the detokenized lines sacreBLEU scores."""
    first = seeds_of_row[0][0]
    refs, detok_refs = test_references(first.data_dir, first.tgt)
    by_seed = [[test_hypotheses(run, len(refs)) for run in row] for row in seeds_of_row]
    if bleu.METRIC_SCORERS[metric].detokenized:  # chrF: the detokenized lines sacreBLEU scores
        by_seed = [[bleu.detokenize(hyps, first.tgt) for hyps in row] for row in by_seed]
        refs = bleu.detokenized_pair([], refs, first.tgt, detok_refs)[1]
    return by_seed, refs


def cell_p_value(runs: Dict[int, Run], baseline: Dict[int, Run], metric: str = "tokenized_bleu") -> Optional[float]:
    """The p-value of one cell ({seed: run}) against its baseline row's cell on the same pair:
    paired bootstrap of ``metric`` over the concatenated test sets of the seeds that both
    finished, seed k of the row paired with seed k of the baseline (bleu.paired_bootstrap_seeds).
    None when no seed finished in both."""
    seeds = sorted(seed for seed in runs if seed in baseline and _scored(runs[seed]) and _scored(baseline[seed]))
    if not seeds:
        return None
    by_seed, refs = _cell_lines([[cell[seed] for seed in seeds] for cell in (baseline, runs)], metric)
    return bleu.paired_bootstrap_seeds(*by_seed, refs, metric=metric).p_value


def cell_seed_aware_test(runs: Dict[int, Run], baseline: Dict[int, Run],
                         metric: str = "tokenized_bleu") -> Optional[bleu.SeedAwareBootstrapResult]:
    """The test behind a cell's mark (bleu.seed_aware_bootstrap): every finished seed of the
    cell against every finished seed of its baseline row's cell on the same pair, test sentences
    and training seeds resampled together (with one seed each, sacreBLEU's paired bootstrap).
    None when either cell has no finished seed."""
    finished = [[cell[seed] for seed in sorted(cell) if _scored(cell[seed])] for cell in (baseline, runs)]
    if not all(finished):
        return None
    by_seed, refs = _cell_lines(finished, metric)
    return bleu.seed_aware_bootstrap(*by_seed, refs, metric=metric)


def chrf_fields(run: Run, scores: dict) -> dict:
    """``chrf``, ``chrf++`` and ``chrf_signature`` of a scored run: from its scores.json, or, for a
    scores.json written before chrF was recorded, re-scored from its kept generate-test.txt and the
    data folder's references (the lines sacreBLEU scores); None where neither is there."""
    if not scores or "chrf" in scores:
        return {name: scores.get(name) for name in ("chrf", "chrf++", "chrf_signature")}
    try:
        refs, detok_refs = test_references(run.data_dir, run.tgt)
        hyps = test_hypotheses(run, len(refs))
    except NormplugError:
        return {"chrf": None, "chrf++": None, "chrf_signature": None}
    rescored = bleu.chrf_scores(*bleu.detokenized_pair(hyps, refs, run.tgt, detok_refs))
    return {name: rescored[name] for name in ("chrf", "chrf++", "chrf_signature")}


def result_rows(table: Table, runs: List[Run], paper: Optional[dict] = None, collecting: bool = False) -> List[dict]:
    """One results-table row per run (per seed), with its cell's p-values against the baseline
    row on the same pair (:func:`cell_p_value` over test sentences; over training seeds,
    bleu.seeds_permutation_test of the cells' per-seed scores; :func:`cell_seed_aware_test` over
    both, and that p Holm-adjusted over every compared cell of the table, bleu.holm_adjust: the
    marks'; its 95% interval of the cell's difference from the baseline; in the table's cell metric of ``paper``, default configs/paper_results.json),
    the same on every seed's row. ``collecting``: the table is still running, so a run not
    started yet is ``pending``, not ``failed``."""
    metric = tables.cell_metric(tables.load_paper_results() if paper is None else paper, table.name)
    cells: Dict[tuple, Dict[int, Run]] = {}
    for run in runs:
        cells.setdefault((run.pair, run.row.name), {})[run.seed] = run
    p_values, seed_aware = {}, {}
    for (pair, row_name), cell in cells.items():
        baseline_name = next(iter(cell.values())).row.baseline
        baseline = cells.get((pair, baseline_name)) if baseline_name else None
        p_values[(pair, row_name)] = cell_p_value(cell, baseline, metric) if baseline else None
        seed_aware[(pair, row_name)] = cell_seed_aware_test(cell, baseline, metric) if baseline else None
    compared = list(seed_aware)
    adjusted = dict(zip(compared, bleu.holm_adjust([_field(seed_aware[cell], "p_value") for cell in compared])))
    out = []
    for run in runs:
        status, state = run.status(), result_status(run, collecting)
        scores = (read_scores(run.path("scores.json")) or {}) if state == "ok" else {}  # a failed run's: not shown
        out.append({
            "table": table.name, "pair": run.pair, "row": run.row.name, "seed": run.seed,
            "config": tables.config_string(run.row.model + run.row.train, run.row.schedule),
            "tokenized_bleu": scores.get("tokenized_bleu"), "sacrebleu": scores.get("sacrebleu"),
            "sacrebleu_signature": scores.get("sacrebleu_signature"), **chrf_fields(run, scores),
            "compound_split_bleu": scores.get("compound_split_bleu"),
            "multi_bleu_detok": scores.get("multi_bleu_detok"),
            "p_value": p_values[(run.pair, run.row.name)] if scores else None,
            "seeds_p_value": None,
            "p_value_seed_aware": _field(seed_aware[(run.pair, run.row.name)], "p_value") if scores else None,
            "p_value_adjusted": adjusted[(run.pair, run.row.name)] if scores else None,
            "diff_ci_low": _field(seed_aware[(run.pair, run.row.name)], "diff_ci_low") if scores else None,
            "diff_ci_high": _field(seed_aware[(run.pair, run.row.name)], "diff_ci_high") if scores else None,
            "length_ratio": bleu.length_ratio(scores),
            "status": state,
            "updates": status.get("updates"), "minutes": status.get("minutes"),
            "stopped_by": status.get("stopped_by") or status.get("diverged"),
            "selected_update": scores.get("selected_update"), "dev_bleu": scores.get("dev_bleu"),
        })
    seed_scores: Dict[tuple, List[float]] = {}
    for row in out:
        if row[metric] is not None:
            seed_scores.setdefault((row["pair"], row["row"]), []).append(row[metric])
    seeds_p_values: Dict[tuple, Optional[float]] = {}
    for run, row in zip(runs, out):
        cell = (run.pair, run.row.name)
        if row[metric] is not None and run.row.baseline:
            if cell not in seeds_p_values:
                seeds_p_values[cell] = bleu.seeds_permutation_test(
                    seed_scores.get((run.pair, run.row.baseline), []), seed_scores[cell])
            row["seeds_p_value"] = seeds_p_values[cell]
    return out


def _field(result, name: str):
    return None if result is None else getattr(result, name)


class TableResults(list):
    """The rows :func:`run_table` wrote (a list of row dicts), with the ``runs`` of the table and
    the ``failed`` ones: ``[(run, reason, log path)]`` (a diverged run is a result, not a failure)."""

    def __init__(self, rows: List[dict], runs: List[Run], failed: List[Tuple[Run, str, str]]):
        super().__init__(rows)
        self.runs, self.failed = runs, failed


def log_problem(run: Run, log: Optional[TrainingLog]) -> Optional[str]:
    """Why the parsed train.log ``log`` of ``run`` cannot be drawn: no training record in the log
    of a run that trained (garbage, another file's content), else None."""
    status = run.status()
    updates = status.get("updates") or 0
    if log is not None and not log.records and (updates > 0 or status["status"] == "done"):
        return (f"{run.path('train.log')} holds no training record, but the run trained "
                f"({updates} updates): not a fairseq-train log")
    return None


def readable_logs(runs: List[Run], echo: Callable[[str], None] = print) -> Tuple[dict, List[str]]:
    """({figure label: the parsed train.log of each of its seeds}, [the logs left out]): a log that
    cannot be read or holds no record of a run that trained is named in one line and left out
    (a figure it would be missing from says so, instead of advising flags the run had)."""
    logs: Dict[str, list] = {}
    left_out = []
    for label, paths in figure_logs(runs).items():
        for path in paths:
            run = next(run for run in runs if run.path("train.log") == path)
            try:
                parsed = parse_training_log(path)
                problem = log_problem(run, parsed)
            except NormplugError as error:  # it names the log
                parsed, problem = None, str(error)
            except OSError as error:
                parsed, problem = None, f"{path} cannot be read: {error.strerror or error}"
            if problem:
                echo(f"[reproduce] {run.label}: {problem}; left out of the figures")
                left_out.append(path)
            else:
                logs.setdefault(label, []).append(parsed)
    return logs, left_out


def figure_logs(runs: List[Run]) -> Dict[str, List[str]]:
    """{figure label (the row's name): the train.log of each of its seeds}, for the runs of one
    pair; figures draw several seeds as a band."""
    logs: Dict[str, List[str]] = {}
    for run in runs:
        if os.path.exists(run.path("train.log")):
            logs.setdefault(run.row.name, []).append(run.path("train.log"))
    return logs


def figure_folders(runs: List[Run], results_dir: str) -> Dict[str, List[Run]]:
    """{folder: its runs}: the figures of a one-pair table go into ``results_dir``, those of a
    table with several pairs into ``results_dir/PAIR`` (one scale of BLEU per figure)."""
    pairs = list(dict.fromkeys(run.pair for run in runs))
    if len(pairs) == 1:
        return {results_dir: runs}
    return {os.path.join(results_dir, pair): [run for run in runs if run.pair == pair] for pair in pairs}


def write_table(table: Table, runs: List[Run], results_dir: str, echo: Callable[[str], None] = print,
                collecting: bool = False, metric: Optional[str] = None) -> List[dict]:
    """results.csv, results.md and the figures from whatever the runs' folders hold now; the
    cells and p-values in ``metric`` (--metric) instead of the table's configs/paper_results.json one."""
    paper = tables.with_cell_metric(tables.load_paper_results(), table.name, metric)
    repairs = {"status.json": "resumes it from its checkpoints", "scores.json": "decodes its test set again"}
    for run in runs:  # a bad record is never tabulated: named in one line, and the run is failed
        for problem in run.record_problems():
            repair = next(text for name, text in repairs.items() if problem.startswith(run.path(name)))
            echo(f"[reproduce] {run.label}: {problem}; the run is failed, a re-run {repair}")
    results = result_rows(table, runs, paper, collecting=collecting)
    try:
        os.makedirs(results_dir, exist_ok=True)
        tables.write_results(results, results_dir, paper, title=table.title)
    except OSError as error:  # a read-only or full results folder: one line, the runs are kept
        raise NormplugError(f"cannot write the results table to {results_dir}: {error.strerror or error}; "
                            f"the runs are kept: fix it and run --collect") from None
    drawn = []
    folders = figure_folders(runs, results_dir)
    for folder, folder_runs in folders.items():
        logs, left_out = readable_logs(folder_runs, echo)
        if not logs:
            continue
        os.makedirs(folder, exist_ok=True)
        for name, outcome in figures.make_figures(logs, folder).items():
            unread = f"; left out as unreadable: {', '.join(left_out)}" if left_out else ""
            echo(f"[reproduce] figure {name}: {outcome}{unread if outcome.startswith('skipped') else ''}")
            drawn.append(outcome)
    if table.depths:  # a table trained at several depths: depth.md and its figures
        drawn += write_depth_outputs(table, runs, results, results_dir, tables.cell_metric(paper, table.name), echo)
    # a figure of an earlier write (other pairs, rows or logs) never sits beside this table
    pair_folders = [os.path.join(results_dir, name) for name in sorted(os.listdir(results_dir))
                    if PAIR_PATTERN.fullmatch(name) and os.path.isdir(os.path.join(results_dir, name))]
    for folder in dict.fromkeys([results_dir, *folders, *pair_folders]):
        for path in figures.remove_stale_figures(folder, drawn):
            echo(f"[reproduce] removed the stale figure {path}")
    echo(f"[reproduce] results: {os.path.join(results_dir, 'results.md')}, "
         f"{os.path.join(results_dir, 'results.csv')}")
    return results


def failed_runs(runs: List[Run], logs: Optional[Dict[str, str]] = None,
                errors: Optional[Dict[str, str]] = None) -> List[Tuple[Run, str, str]]:
    """(run, why, log) of every run that has no result (a diverged run has one); ``errors``
    ({run folder: error}, the launcher's): an error its status.json could not record (a full disk)."""
    out = []
    for run in runs:
        reason = launchers.failure_of(run)
        if reason is not None:
            unrecorded = (errors or {}).get(run.run_dir)
            if unrecorded and unrecorded not in reason:
                reason += f"; {unrecorded}"
            out.append((run, with_errno_names(reason), (logs or {}).get(run.run_dir) or run.path("train.log")))
    return out


def with_errno_names(text: str) -> str:
    """``text`` with the name of each ``[Errno N]`` it quotes added at its end, so a full disk
    reads ``... No space left on device (ENOSPC: the disk is full)``."""
    names = [errno.errorcode.get(int(number)) for number in re.findall(r"\[Errno (\d+)\]", text)]
    names = [name for name in dict.fromkeys(names) if name and name not in text]
    notes = [f"{name}: the disk is full" if name == "ENOSPC" else name for name in names]
    return f"{text} ({', '.join(notes)})" if notes else text


def report_failures(failed: List[Tuple[Run, str, str]], echo: Callable[[str], None] = print) -> None:
    """The last lines of a table with failed runs: each one, why, and its log."""
    if failed:
        echo(f"[reproduce] {len(failed)} run(s) FAILED:")
        for run, reason, log in failed:
            echo(f"[reproduce] FAILED {run.label}: {reason}; log: {log}")
