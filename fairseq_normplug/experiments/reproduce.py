"""``scripts/reproduce.sh TABLE [PAIR ...]``: run every row of a paper table on prepared data,
then write ``results/<TABLE>/results.{csv,md}`` and the figures.

Resumable: finished rows are skipped, interrupted ones resume from their last checkpoint,
diverged ones stay recorded as diverged. Runs go one after another on this machine, or
``--jobs N`` at once (``--devices-per-run K`` GPUs each), or as SLURM jobs (``--launcher slurm``;
experiments/launchers.py); ``--seeds`` trains every cell with several seeds (``PAIR=N,N,...``: other
seeds on one pair, :func:`parse_seeds`). ``--print-commands``,
``--status``, ``--collect`` and ``--preflight`` (experiments/preflight.py) look at a table instead
of running it. The table is written whatever its runs did; exits 1 when a run failed (a diverged
run is a result). See docs/experiments.md.
"""
import argparse
import dataclasses
import errno
import json
import logging
import os
import re
import shlex
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu, figures, launchers, preflight, tables
from fairseq_normplug.experiments.configs import (
    CONFIG_DIR, PAIR_PATTERN, PROJECT_DIR, Table, available_tables, check_pair, check_row_name, load_data_locations,
    load_table,
    under_recipe, with_added_rows,
)
from fairseq_normplug.experiments.ownership import live_holder
from fairseq_normplug.extensions import command_line_items, load_extensions, split_items
from fairseq_normplug.experiments.runner import (
    Run, check_data_dir, command_batching, generate_command, last_flag_value, read_scores,
    plan_summary, run_folder, test_hypotheses, test_references, train_flags, training_plan,
)
from fairseq_normplug.experiments.training_log import TrainingLog, parse_training_log

SPEED_PATH = os.path.join(CONFIG_DIR, "speed.json")



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


@dataclasses.dataclass(frozen=True)
class PairSeeds:
    """The training seeds of each pair (``--seeds 1 2 3 az-en=1,2``): ``default`` for every pair
    that ``per_pair`` does not name, ``per_pair`` {pair: its seeds} for the others."""
    default: Tuple[int, ...] = (1,)
    per_pair: Mapping[str, Tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def of(self, pair: str) -> Tuple[int, ...]:
        """The seeds that ``pair`` trains and collects."""
        return self.per_pair.get(pair, self.default)

    def check_pairs(self, pairs: Sequence[str]) -> None:
        """A ``PAIR=`` entry for a pair that is not run here is refused (NormplugError)."""
        for pair, seeds in self.per_pair.items():
            if pair not in pairs:
                raise NormplugError(f"--seeds {pair}={','.join(map(str, seeds))}: {pair} is not a pair of this "
                                    f"run; choose from {', '.join(pairs)}")

    def describe(self, pairs: Sequence[str]) -> str:
        """``de-en 1 2 3, az-en 1 2``: each pair's seeds."""
        return ", ".join(f"{pair} {' '.join(map(str, self.of(pair)))}" for pair in pairs)


#: what :func:`plan_runs` takes as seeds: one list for every pair, or :class:`PairSeeds`
Seeds = Union[Sequence[int], PairSeeds]


def pair_seeds(seeds: Seeds) -> PairSeeds:
    """``seeds`` as :class:`PairSeeds` (one list of seeds: the same on every pair)."""
    return seeds if isinstance(seeds, PairSeeds) else PairSeeds(default=tuple(seeds))


def _seed_list(text: str, entry: str) -> Tuple[int, ...]:
    """The distinct non-negative integers of ``text`` (``1,2``), or a one-line NormplugError."""
    seeds = []
    for item in text.split(","):
        if not re.fullmatch(r"[0-9]+", item):
            raise NormplugError(f"--seeds {entry}: {item!r} is not a seed (a non-negative integer); "
                                f"write N ... or PAIR=N,N,...")
        seeds.append(int(item))
    if len(set(seeds)) != len(seeds):
        raise NormplugError(f"--seeds must be distinct non-negative integers, got {entry}")
    return tuple(seeds)


def parse_seeds(values: Sequence[str]) -> PairSeeds:
    """``--seeds``: plain numbers are every pair's seeds (default 1), ``PAIR=N,N,...`` one pair's
    instead (``--seeds 1 2 3 az-en=1,2``: de-en seeds 1, 2, 3 and az-en seeds 1, 2). A bad
    number, a repeated seed or a pair named twice is a one-line NormplugError."""
    default, per_pair = [], {}
    for value in values:
        if "=" not in value:
            default.extend(_seed_list(value, value))
            continue
        pair, text = value.split("=", 1)
        pair = check_pair(pair, "--seeds")
        if pair in per_pair:
            raise NormplugError(f"--seeds names {pair} twice ({pair}={','.join(map(str, per_pair[pair]))} and "
                                f"{value}); give each pair one PAIR=N,N,... entry")
        per_pair[pair] = _seed_list(text, value)
    if len(set(default)) != len(default):
        raise NormplugError(f"--seeds must be distinct non-negative integers, got {default}")
    return PairSeeds(default=tuple(default) or (1,), per_pair=per_pair)


def plan_runs(table: Table, pairs: List[str], data_dirs: Dict[str, str], runs_dir: str,
              rows: List[str] = (), seeds: Seeds = (1,), check_data: bool = True) -> List[Run]:
    """All (pair, row, seed) runs, after checking every input (nothing is trained on bad input);
    ``seeds``: one list for every pair, or :class:`PairSeeds` (each pair its own).
    ``check_data=False`` (``--print-commands``) accepts a data folder not prepared yet: its
    commands are printed as the prepare scripts' default (subword-nmt) would make them."""
    repeated = sorted({name for name in rows if list(rows).count(name) > 1})
    if repeated:
        raise NormplugError(f"--rows names {repeated[0]!r} twice; name each row once")
    selected = [table.row(name) for name in rows] if rows else table.rows
    seeds = pair_seeds(seeds)
    seeds.check_pairs(pairs)
    runs = []
    for pair in pairs:
        check_pair(pair, example=table.pairs[0])
        if pair not in data_dirs:
            raise NormplugError(f"no data folder for {pair}: pass --data {pair}=DIR or add it to configs/data.json")
        assumed = None
        if check_data or os.path.exists(os.path.join(data_dirs[pair], "manifest.json")):
            check_data_dir(data_dirs[pair], pair)
        else:
            assumed = "subword_nmt"
        for row in selected:
            for seed in seeds.of(pair):
                runs.append(Run(table=table, row=row, pair=pair, data_dir=data_dirs[pair], seed=seed,
                                run_dir=run_folder(runs_dir, table.name, pair, row.name, seed),
                                assumed_subword=assumed))
    check_run_folders(runs)
    return runs


def check_run_folders(runs: List[Run]) -> None:
    """One run folder per run: two runs mapped to one folder (a row ``PreNorm`` with seed 2 and a
    row ``PreNorm seed2``, both ``prenorm-seed2``) would report one result under both names, so
    they are refused in one line, naming both and the folder, before anything trains."""
    owners: Dict[str, Run] = {}
    for run in runs:
        other = owners.setdefault(run.run_dir, run)
        if other is not run:
            raise NormplugError(f"runs {other.label!r} and {run.label!r} map to one run folder ({run.run_dir}): "
                                f"one run's result would be reported for both; rename one row")


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
    """The rows :func:`run_table` wrote (a list, as before), with the ``runs`` of the table and
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


def check_batching(runs: List[Run], extra_train: Sequence[str]) -> None:
    """Every run's training command, built once before anything runs: a tokens per update
    that cannot be reached on its devices is refused here (NormplugError)."""
    for run in runs:
        run.train_command(list(extra_train))


def run_table(table: Table, pairs: List[str], data_dirs: Dict[str, str], runs_dir: str, results_dir: str,
              rows: List[str] = (), extra_train: List[str] = (), echo: Callable[[str], None] = print,
              seeds: Seeds = (1,), launcher=None, echo_failures: bool = True,
              metric: Optional[str] = None) -> TableResults:
    """Train and evaluate every (pair, row, seed) run of ``table`` with ``launcher`` (default:
    this machine, one run after another), then write the results table and figures; the last
    lines name the failed runs (``echo_failures=False``: the caller does)."""
    launcher = launcher or launchers.LocalLauncher()
    runs = launcher.prepare(plan_runs(table, pairs, data_dirs, runs_dir, rows, seeds))
    check_batching(runs, extra_train)
    for folder, what in ((runs_dir, "runs"), (results_dir, "results")):
        problem = preflight.folder_problem(folder, what)
        if problem:
            raise NormplugError(f"{problem}; nothing was run")
    problem = tables.results_owner_problem(results_dir, table.name)
    if problem:
        raise NormplugError(f"{problem}; nothing was run")
    echo(f"[reproduce] {table.title}: {len(runs)} runs ({run_shape(runs, pairs, pair_seeds(seeds))})")
    launcher.execute(runs, extra_train, echo)
    results = write_table(table, runs, results_dir, echo, metric=metric)
    failed = failed_runs(runs, launcher.logs, getattr(launcher, "errors", None))
    if echo_failures:
        report_failures(failed, echo)
    return TableResults(results, runs, failed)


def run_shape(runs: List[Run], pairs: Sequence[str], seeds: PairSeeds) -> str:
    """``2 pairs x 5 rows x 3 seeds``, or with other seeds on some pair
    ``2 pairs x 5 rows; seeds de-en 1 2 3, az-en 1 2``."""
    rows = len(dict.fromkeys(run.row.name for run in runs))
    if len({seeds.of(pair) for pair in pairs}) > 1:
        return f"{len(pairs)} pairs x {rows} rows; seeds {seeds.describe(pairs)}"
    count = len(seeds.of(pairs[0]))
    return f"{len(pairs)} pairs x {rows} rows" + (f" x {count} seeds" if count > 1 else "")


def load_speeds(path: str = SPEED_PATH) -> dict:
    """configs/speed.json: {arch: {device kind: {"target_tokens_per_second": N, "measured": ...}}}."""
    with open(path, encoding="utf-8") as f:
        return {arch: kinds for arch, kinds in json.load(f).items() if not arch.startswith("_")}


def cost_estimate(run: Run, command: List[str], batching, speeds: dict,
                  done_updates: int = 0) -> Optional[Tuple[float, str]]:
    """(hours, explanation) of training ``run`` at a measured speed, or None without one;
    ``done_updates``: where a resumed run starts (only the updates left count)."""
    kind = "gpu" if run.num_devices or torch.cuda.is_available() else "cpu"
    speed = speeds.get(run.recipe.arch, {}).get(kind)
    updates = last_flag_value(command, "--max-update")
    if not speed or not updates:
        return None
    per_second = speed["target_tokens_per_second"] * (batching.devices if kind == "gpu" else 1)
    left = max(int(updates) - done_updates, 0)
    hours = left * batching.tokens_per_update / per_second / 3600
    return hours, (f"at most {left} updates{f' (of {int(updates)})' if done_updates else ''} x "
                   f"{batching.tokens_per_update} tokens at "
                   f"{per_second:,.0f} target tokens/s ({run.recipe.arch} on {kind}: {speed['measured']}) "
                   f"= {hours:.2f} hours of training")


def print_commands(runs: List[Run], launcher, extra_train: Sequence[str], echo: Callable[[str], None] = print) -> None:
    """Every fairseq-train and fairseq-generate command of the runs, with run folder, seed,
    devices, tokens per update and a cost estimate; runs nothing, writes nothing."""
    speeds, total, unestimated, training = load_speeds(), 0.0, 0, 0
    if isinstance(launcher, launchers.SlurmLauncher):
        echo(f"[print-commands] SLURM: {launcher.describe_submission()}")
    plans = []
    for run in runs:
        command = run.train_command(list(extra_train))
        batching = command_batching(command, run.num_devices)
        env = " ".join(f"{key}={value}" for key, value in launcher.env_prefix(run).items())
        plan = training_plan(run, command)  # what a real run does with it (runner.train's rule)
        plans.append(plan)
        echo(f"[{run.label}] {plan.describe()}")
        if run.assumed_subword:
            echo(f"  data: {run.data_dir} is not prepared yet (scripts/prepare_*.sh); commands shown "
                 f"for its default subword method, {run.assumed_subword}")
        echo(f"  run folder: {run.run_dir}")
        echo(f"  seed {run.seed}; devices: {launcher.describe_devices(run)}; {batching.describe()}")
        echo(f"  train: {(env + ' ') if env else ''}{shlex.join(command)}")
        echo(f"  test:  {(env + ' ') if env else ''}"
             f"{shlex.join(generate_command(run, run.path('checkpoints', 'checkpoint_best.pt')))}")
        if not plan.trains:
            continue
        training += 1
        estimate = cost_estimate(run, command, batching, speeds, plan.last.updates if plan.last else 0)
        if estimate:
            total += estimate[0]
            echo(f"  cost: {estimate[1]}")
        else:
            unestimated += 1
            echo(f"  cost: no measured speed for {run.recipe.arch} on this device kind (configs/speed.json)")
    estimated = training - unestimated
    summary = f"{plan_summary(plans)}; nothing was run"
    if estimated:
        summary += (f"; estimated training time of the {estimated} run(s) to train with a measured speed: "
                    f"{total:.2f} hours one after another (less with --jobs; decoding not included)")
    echo(f"[print-commands] {summary}")



def run_state(run: Run) -> dict:
    """A run's state from its folder: state, last update, best dev BLEU so far, elapsed minutes."""
    status = run.status()
    state = status["status"]
    if state == "done":
        state = "tested" if read_scores(run.path("scores.json")) is not None else "trained"
    log = run.path("train.log")
    last_update, best = None, None
    try:  # an unreadable log (garbage, --log-format none) leaves its columns empty, not --status
        parsed = parse_training_log(log) if os.path.exists(log) else None
    except (NormplugError, OSError):
        parsed = None
    if parsed is not None:
        last_update = parsed.last_update
        bleu_values = parsed.series("valid", "valid_bleu")[1]
        best = max(bleu_values) if bleu_values else None
        valid_updates = parsed.series("valid", "valid_num_updates")[0]
        if valid_updates and (last_update is None or valid_updates[-1] > last_update):
            last_update = int(valid_updates[-1])
    minutes = status.get("minutes") or 0.0
    if state == "running" and os.path.exists(run.path("status.json")):
        minutes += (time.time() - os.path.getmtime(run.path("status.json"))) / 60
    return {"run": run.label, "state": state, "last update": last_update, "best dev BLEU": best,
            "elapsed": minutes if state != "pending" else None}


def print_status(runs: List[Run], echo: Callable[[str], None] = print) -> List[dict]:
    """One line per run: state, last update, best dev BLEU so far, elapsed time."""
    states = [run_state(run) for run in runs]
    cells = [[s["run"], s["state"], "-" if s["last update"] is None else str(s["last update"]),
              "-" if s["best dev BLEU"] is None else f"{s['best dev BLEU']:.2f}",
              "-" if s["elapsed"] is None else f"{s['elapsed']:.1f} min"] for s in states]
    header = ["run", "state", "last update", "best dev BLEU", "elapsed"]
    widths = [max(len(row[i]) for row in cells + [header]) for i in range(len(header))]
    for row in [header] + cells:
        echo("  ".join(cell.ljust(width) if i < 2 else cell.rjust(width)
                       for i, (cell, width) in enumerate(zip(row, widths))).rstrip())
    counts = {}
    for s in states:
        counts[s["state"]] = counts.get(s["state"], 0) + 1
    echo(f"[status] {len(runs)} runs: " + ", ".join(f"{n} {state}" for state, n in counts.items())
         + " (running: also a run whose process was killed, until it is re-run)")
    return states


def parse_data_overrides(values: List[str]) -> Dict[str, str]:
    out = {}
    for value in values:
        if "=" not in value:
            raise NormplugError(f"--data takes PAIR=DIR, got {value!r}")
        pair, folder = value.split("=", 1)
        out[check_pair(pair, "--data")] = os.path.abspath(folder)
    return out


def make_launcher(args, runs_dir: str, table: Table):
    """The launcher the options ask for (checked before anything runs)."""
    if args.launcher == "slurm":
        if not (args.print_commands or args.status or args.collect):
            launchers.import_submitit()
        return launchers.SlurmLauncher(
            folder=args.slurm_folder or os.path.join(runs_dir, table.name, "slurm"), partition=args.partition,
            time_limit_min=args.time_limit, gpus_per_run=1 if args.devices_per_run is None else args.devices_per_run,
            cpus_per_run=args.cpus_per_run, mem=args.mem, account=args.account,
            sbatch=launchers.parse_sbatch(args.sbatch), jobs=args.jobs, max_requeues=args.max_requeues)
    slurm_only = [f"--{name.replace('_', '-')}" for name in ("partition", "mem", "account", "slurm_folder")
                  if getattr(args, name) is not None] + (["--sbatch"] if args.sbatch else [])
    if slurm_only:
        raise NormplugError(f"{slurm_only[0]} is an option of --launcher slurm (the launcher is local)")
    return launchers.LocalLauncher(jobs=1 if args.jobs is None else args.jobs, devices_per_run=args.devices_per_run,
                                   cpus_per_run=args.cpus_per_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reproduce.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"tables: {', '.join(available_tables())}; "
                                            f"docs/experiments.md has examples")
    parser.add_argument("table", help="table to run, e.g. table3")
    parser.add_argument("pairs", nargs="*", help="language pairs (default: all of the table's)")
    parser.add_argument("--data", action="append", default=[], metavar="PAIR=DIR",
                        help="prepared data folder of a pair (default: configs/data.json)")
    parser.add_argument("--rows", nargs="+", default=[], metavar="NAME", help="only these rows")
    parser.add_argument("--seeds", nargs="+", default=["1"], metavar="N|PAIR=N,N",
                        help="train every cell with each seed, each in its own run folder (default: 1); "
                             "PAIR=N,N,... gives one pair other seeds (--seeds 1 2 3 az-en=1,2: de-en seeds "
                             "1-3, az-en seeds 1-2), in every mode (--collect: the table of those seeds)")
    parser.add_argument("--runs-dir", default=os.path.join(PROJECT_DIR, "runs"))
    parser.add_argument("--results-dir", help="default: results/TABLE")
    parser.add_argument("--recipe", metavar="NAME",
                        help="train the table's rows with this recipe of configs/recipes.json instead of "
                             "the table's own (e.g. cpu_short); runs and results go under TABLE.NAME")
    parser.add_argument("--train-flags", default="", help="extra fairseq-train flags, one string")
    yours = parser.add_argument_group("your own rows beside the table's (docs/extending.md)")
    yours.add_argument("--add-row", action="append", default=[], metavar="NAME=FLAGS",
                       help="one more row: its model flags, trained with the table's recipe and seeds and "
                            "compared with its baseline row (repeatable); the table's finished runs are reused")
    yours.add_argument("--normplug-modules", action="append", default=[], metavar="PATH[,PATH...]",
                       help="the extensions the added rows need (.py files, package folders or module names)")
    yours.add_argument("--add-row-schedule", metavar="NAME",
                       help="the added rows' schedule (default: the baseline row's)")
    parser.add_argument("--metric", metavar="NAME",
                        help=f"the cells' metric, of the \u2020/\u2021 marks and both p-values: one of "
                             f"{', '.join(tables.CELL_METRICS)} (default: the table's in configs/paper_results.json, "
                             f"tokenized_bleu for most; chrf++ is chrF with word bigrams; docs/evaluation.md)")
    what = parser.add_argument_group("instead of running the table")
    what.add_argument("--print-commands", action="store_true",
                      help="print every fairseq-train/-generate command with its run folder, seed, devices, "
                           "tokens per update and a cost estimate; run nothing")
    what.add_argument("--status", action="store_true",
                      help="print each run's state, last update, best dev BLEU so far and elapsed time")
    what.add_argument("--collect", action="store_true",
                      help="write results.{csv,md} and the figures from the runs that have finished so far")
    what.add_argument("--preflight", action="store_true",
                      help="check the whole table (data, flags, positions, folders, disk space) and train a few "
                           "updates of each configuration outside the run folders: tokens/s, peak memory and a "
                           "time estimate; one line per problem, exit 1 if any (with --launcher slurm: as one "
                           "short job)")
    where = parser.add_argument_group("where the runs run")
    where.add_argument("--launcher", choices=launchers.LAUNCHERS, default="local",
                       help="local: this machine (default); slurm: one SLURM job per run (submitit)")
    where.add_argument("--jobs", type=int, metavar="N",
                       help="runs at once (local default 1; slurm: at most N jobs of the array at once)")
    where.add_argument("--devices-per-run", "--gpus-per-run", type=int, metavar="K", dest="devices_per_run",
                       help="GPUs of each run (local: its own CUDA_VISIBLE_DEVICES slot, default the GPUs "
                            "divided by --jobs; slurm: --gpus-per-node, default 1, 0 for CPU jobs)")
    where.add_argument("--cpus-per-run", type=int, metavar="N",
                       help="CPU threads of each run (OMP_NUM_THREADS; local default: the cores divided by "
                            "--jobs when --jobs > 1; slurm: --cpus-per-task)")
    slurm = parser.add_argument_group("--launcher slurm")
    slurm.add_argument("--partition", help="SLURM partition")
    slurm.add_argument("--time-limit", type=int, default=1440, metavar="MINUTES",
                       help="time limit of each job (default 1440 = 24 h); a run that needs longer is requeued "
                            "and resumes from its last checkpoint")
    slurm.add_argument("--mem", help="memory of each job, as sbatch takes it (e.g. 64G)")
    slurm.add_argument("--account", help="SLURM account")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, without its dashes (e.g. --sbatch qos=high --sbatch exclusive "
                            "--sbatch constraint=volta32gb); repeatable")
    slurm.add_argument("--max-requeues", type=int, default=10, metavar="N",
                       help="times a job may reach its time limit and be requeued (default 10; "
                            "preemptions do not count)")
    slurm.add_argument("--slurm-folder", metavar="DIR", help="submitit's job logs (default RUNS_DIR/TABLE/slurm)")
    slurm.add_argument("--no-preflight", action="store_true",
                       help="submit the table without running --preflight as one short job first")
    return parser


def main(argv=None):
    """reproduce.sh; exits 1 when any run failed (a diverged run is a result: exit 0)."""
    args = build_parser().parse_args(argv)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    modes = [flag for flag in ("print_commands", "status", "collect", "preflight") if getattr(args, flag)]
    try:
        if len(modes) > 1:
            raise NormplugError(f"--{modes[0].replace('_', '-')} and --{modes[1].replace('_', '-')} "
                                f"exclude each other; pick one")
        seeds = parse_seeds(args.seeds)
        for name in args.rows:
            check_row_name(name, "--rows")
        if args.metric is not None:
            tables.with_cell_metric({}, args.table, args.metric)  # an unknown metric: one line, before any work
        table = load_table(args.table)
        if args.recipe:
            table = under_recipe(table, args.recipe)
        if args.normplug_modules and not args.add_row:
            raise NormplugError("--normplug-modules names the extensions of rows added with --add-row; "
                                "give --add-row \"NAME=FLAGS\" too")
        if args.add_row_schedule and not args.add_row:
            raise NormplugError("--add-row-schedule needs --add-row")
        if args.add_row:
            table = with_added_rows(table, args.add_row, split_items(args.normplug_modules), args.add_row_schedule)
        # the rows' own norms and placements (--add-row, "normplug_modules" in the table): a missing
        # or broken extension fails here, before any work; --preflight then parses their flags
        load_extensions([item for row in table.rows for item in command_line_items(row.model)])
        data_dirs = {**load_data_locations(), **parse_data_overrides(args.data)}
        pairs = args.pairs or table.pairs
        seeds.check_pairs(pairs)
        results_dir = args.results_dir or os.path.join(PROJECT_DIR, "results", table.name)
        runs_dir = os.path.abspath(args.runs_dir)
        extra = train_flags(args.train_flags)
        launcher = make_launcher(args, runs_dir, table)
        slurm_preflight = isinstance(launcher, launchers.SlurmLauncher) and not args.no_preflight
        if args.preflight or (slurm_preflight and not modes):
            runs = launcher.prepare(plan_runs(table, pairs, data_dirs, runs_dir, args.rows, seeds,
                                              check_data=False))
            problems = launcher.preflight(runs, extra, runs_dir, results_dir, print)["problems"]
            if problems:
                sys.exit(f"reproduce.sh: preflight: {len(problems)} problem(s), listed above; nothing was "
                         f"{'submitted' if slurm_preflight and not modes else 'run'}")
            if modes:
                return
        if modes:
            runs = launcher.prepare(plan_runs(table, pairs, data_dirs, runs_dir, args.rows, seeds,
                                              check_data=not args.print_commands))
            if args.print_commands:
                print_commands(runs, launcher, extra)
            elif args.status:
                print_status(runs)
            else:
                write_table(table, runs, results_dir, collecting=True, metric=args.metric)
                failed = failed_runs(runs)
                if len(failed) == len(runs):  # no result at all: why, run by run
                    for run, reason, log in failed:
                        print(f"[reproduce] no result for {run.label}: {reason}; log: {log}")
                print(f"[reproduce] collected {len(runs) - len(failed)} of {len(runs)} runs with a result")
            return
        results = run_table(table, pairs, data_dirs, runs_dir, results_dir, args.rows, extra,
                            seeds=seeds, launcher=launcher, metric=args.metric)
    except NormplugError as error:
        sys.exit(f"reproduce.sh: error: {error}")
    except KeyboardInterrupt:
        sys.exit("reproduce.sh: interrupted; re-run the same command to resume (SLURM jobs keep running: "
                 "--status, --collect)")
    if results.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
