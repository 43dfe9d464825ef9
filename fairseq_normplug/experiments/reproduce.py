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
import json
import logging
import os
import shlex
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import launchers, preflight, tables
from fairseq_normplug.experiments.configs import (
    CONFIG_DIR, PROJECT_DIR, Table, available_tables, check_pair, check_row_name, load_data_locations,
    load_table, under_recipe, with_added_rows,
)
from fairseq_normplug.extensions import command_line_items, load_extensions, split_items
from fairseq_normplug.experiments.batching import command_batching
from fairseq_normplug.experiments.depths import adopt_kept_runs, rows_at_depths
from fairseq_normplug.experiments.run_commands import generate_command, train_flags
from fairseq_normplug.experiments.run_records import read_scores
from fairseq_normplug.experiments.runs import Run, check_data_dir, run_folder
from fairseq_normplug.experiments.training import plan_summary, training_plan
from fairseq_normplug.flag_lists import last_flag_value
from fairseq_normplug.experiments.training_log import parse_training_log
from fairseq_normplug.experiments.table_results import (  # noqa: F401 (reproduce.TableResults, ...)
    failed_runs, figure_folders, figure_logs, report_failures, result_rows, TableResults, with_errno_names,
    write_table,
)
from fairseq_normplug.experiments.run_seeds import (  # noqa: F401 (reproduce.parse_seeds, ...)
    pair_seeds, PairSeeds, parse_seeds, Seeds,
)

SPEED_PATH = os.path.join(CONFIG_DIR, "speed.json")


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
    adopt_kept_runs(runs, runs_dir, echo)
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
    parser.add_argument("--depths", nargs="+", type=int, default=[], metavar="N",
                        help="a table trained at several depths (depth): only its rows at these layers per "
                             "stack (of --rows' designs when given)")
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
        if args.depths:
            args.rows = rows_at_depths(table, args.depths, args.rows)
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
                adopt_kept_runs(runs, runs_dir)
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
