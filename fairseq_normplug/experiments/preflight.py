"""``scripts/reproduce.sh TABLE ... --preflight``: check a whole table before it spends its time.

:func:`check_table` checks, and says in one line per problem:

* every data folder has its dictionaries, train, dev and test sets and test references, no side
  of a split mostly empty (preparation's rule, ``prepare.pipeline.MOSTLY_EMPTY``), and no
  dev or test sentence is longer than the positions of a row's model (fairseq would stop the
  run at its first validation, or its test decoding);
* every row's training command is built (recipe, schedule, tokens per update, a ``--lr`` its
  schedule would ignore) and its flags parse as fairseq-train's (a mistyped flag);
* the runs and results folders are writable, with free space for the planned checkpoints
  (each run keeps checkpoint_last.pt, checkpoint_best.pt and one interval checkpoint, and a
  save copies one more: 4 checkpoints of the size the short training below writes);
* every distinct configuration (a row on a pair; seeds share it) trains :data:`UPDATES`
  updates with the run's real batching and devices, and validates (dev BLEU too) on one dev
  batch, in a temporary folder outside the run folders: the model builds, and its tokens/s, updates/s, peak memory (GPU memory on GPU,
  the process's resident memory on CPU) and the time of the table's runs at that speed
  (``--max-update`` updates each: an upper bound, decoding not included) are reported. Only
  the runs a real run would train or resume count (runner.training_plan, the re-run's own rule:
  a kept finished run is skipped, a killed one resumes from its last checkpoint's update); a
  configuration whose runs are all done is not measured.

It creates no run folder. With ``--launcher slurm`` the same check runs as one short SLURM job
(:meth:`SlurmLauncher.preflight <fairseq_normplug.experiments.launchers.SlurmLauncher.preflight>`),
and a table is submitted only when it passes.
"""
import contextlib
import io
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.tables import results_owner_problem
from fairseq_normplug.experiments.training_log import json_records
from fairseq_normplug.experiments.run_commands import subword_method
from fairseq_normplug.experiments.runs import Run
from fairseq_normplug.experiments.training import plan_summary, training_plan
from fairseq_normplug.flag_lists import last_flag_value
from fairseq_normplug.prepare.pipeline import SPLITS, mostly_empty_problem

#: updates of each configuration's short training
UPDATES = 4
#: checkpoints a run holds at once (last, best, one interval checkpoint, a save being copied)
CHECKPOINTS_PER_RUN = 4
#: fairseq's transformer positions when neither the flags nor the architecture set them
FAIRSEQ_POSITIONS = 1024
#: the flags of a run's command that differ between its seeds (a configuration is the rest)
PER_RUN_FLAGS = ("--seed", "--save-dir")

Echo = Callable[[str], None]


def existing_ancestor(folder: str) -> str:
    """``folder`` or the nearest folder above it that exists."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def folder_problem(folder: str, what: str) -> Optional[str]:
    """Why files cannot be written under ``folder`` (created if needed), None if they can;
    creates nothing (a file is written and removed in the nearest existing folder above it)."""
    existing = existing_ancestor(folder)
    if not os.path.isdir(existing):
        return f"the {what} folder {folder} cannot be created: {existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".normplug-write-check-"):
            pass
    except OSError as error:
        where = "" if existing == os.path.abspath(folder) else f"{existing}: "
        return f"the {what} folder {folder} is not writable ({where}{error.strerror or error})"
    return None


def configuration_key(command: Sequence[str]) -> Tuple[str, ...]:
    """A training command without what differs between the seeds of one configuration."""
    key, skip = [], False
    for item in command:
        if skip:
            skip = False
            continue
        if item in PER_RUN_FLAGS:
            skip = True
            continue
        key.append(item)
    return tuple(key)


def data_problems(data_dir: str, pair: str) -> List[str]:
    """What a prepared data folder lacks: dictionaries, train/dev/test binaries, test references."""
    src, tgt = pair.split("-")
    needed = [os.path.join("bin", f"dict.{lang}.txt") for lang in (src, tgt)]
    needed += [os.path.join("bin", f"{split}.{src}-{tgt}.{lang}.{ext}")
               for split in ("train", "valid", "test") for lang in (src, tgt) for ext in ("bin", "idx")]
    needed.append(os.path.join("ref", f"test.tok.{tgt}"))
    missing = [path for path in needed if not os.path.exists(os.path.join(data_dir, path))]
    problems = []
    if missing:
        problems.append(f"{pair}: {data_dir} lacks {', '.join(missing)} (prepare it with scripts/prepare_*.sh, "
                        f"docs/data.md)")
    else:
        problems += empty_sentence_problems(data_dir, pair)
    try:
        subword_method(data_dir)
    except NormplugError as error:
        problems.append(f"{pair}: {error}")
    return problems


def sentence_lengths(data_dir: str, pair: str, split: str, lang: str):
    """Token counts (with </s>, as fairseq compares them to the positions) of one binarized set."""
    from fairseq.data import data_utils

    logging.getLogger(data_utils.__name__).setLevel(logging.WARNING)  # no "loaded N examples" lines
    src, tgt = pair.split("-")
    dataset = data_utils.load_indexed_dataset(os.path.join(data_dir, "bin", f"{split}.{src}-{tgt}.{lang}"), None)
    return [int(size) for size in dataset.sizes]  # a copy: the sizes are a view of the file, closed with it


def empty_sentence_problems(data_dir: str, pair: str) -> List[str]:
    """Preparation's rule on a prepared folder: one line per side of a split whose binarized
    sentences are mostly empty (only </s>; :func:`~fairseq_normplug.prepare.pipeline.mostly_empty_problem`)."""
    src, tgt = pair.split("-")
    problems = []
    for split in SPLITS:
        for lang in (src, tgt):
            sizes = sentence_lengths(data_dir, pair, split, lang)
            what = os.path.join(data_dir, "bin", f"{split}.{src}-{tgt}.{lang}")
            problem = mostly_empty_problem(what, split, sum(size <= 1 for size in sizes), len(sizes))
            if problem:
                problems.append(f"{pair}: {problem}")
    return problems


def parse_train_command(command: Sequence[str]):
    """fairseq-train's parsed arguments of ``command`` (its architecture's defaults filled
    in), or the one line fairseq-train would print for bad flags (a str)."""
    from fairseq import options

    error = io.StringIO()
    try:
        with contextlib.redirect_stderr(error):
            parser = options.get_training_parser()
            parser.prog = "fairseq-train"
            return options.parse_args_and_arch(parser, list(command[1:]))
    except SystemExit:
        lines = [line for line in error.getvalue().strip().splitlines() if line.strip()]
        return lines[-1] if lines else "fairseq-train refuses its flags"


def positions_problems(run: Run, args) -> List[str]:
    """One line per dev/test set side with a sentence longer than the model's positions."""
    problems = []
    for split, name in (("valid", "dev"), ("test", "test")):
        for lang, side in ((run.src, "source"), (run.tgt, "target")):
            limit = getattr(args, f"max_{side}_positions", None) or FAIRSEQ_POSITIONS
            sizes = sentence_lengths(run.data_dir, run.pair, split, lang)
            over = [index for index, size in enumerate(sizes) if size > limit]
            if over:
                longest = max(range(len(sizes)), key=lambda i: sizes[i])
                problems.append(f"{run.pair}: {len(over)} {name} sentence(s) longer than the {limit} {side} positions "
                                f"of row {run.row.name!r} (the longest, #{longest}, has {sizes[longest]} tokens "
                                f"with </s>); raise --max-{side}-positions or shorten the {name} set")
    return problems


def short_training(run: Run, command: List[str], folder: str, updates: int) -> dict:
    """Train ``command`` for ``updates`` updates into ``folder``: {"error"} or its speed and
    memory: tokens_per_second, updates_per_second, peak_memory_gb (+ memory_kind),
    checkpoint_bytes."""
    save_dir = os.path.join(folder, "checkpoints")
    short = [*command, "--max-update", str(updates), "--save-dir", save_dir, "--max-valid-steps", "1",
             "--log-interval", "1", "--validate-interval-updates", "0", "--save-interval-updates", "0",
             "--no-epoch-checkpoints"]  # one dev batch, decoded, at the end
    proc = subprocess.Popen(short, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **run.env(), "PYTHONUNBUFFERED": "1"})
    log = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        lines = [line for line in log.strip().splitlines() if line.strip()]
        return {"error": f"exit {proc.returncode}: {lines[-1][:300] if lines else 'no output'}"}
    records = json_records(log, "train_inner")[1:] or json_records(log, "train_inner")  # the first update warms up
    speed = {key: statistics.median(float(r[key]) for r in records if key in r) if any(key in r for r in records)
             else None for key in ("wps", "ups")}
    gb_free = [float(r["gb_free"]) for r in json_records(log, "train_inner") if "gb_free" in r]
    gpu = bool(gb_free) and torch.cuda.is_available()
    peak = (torch.cuda.get_device_properties(0).total_memory / 2 ** 30 - min(gb_free) if gpu
            else usage.ru_maxrss / 2 ** 20)  # ru_maxrss: KiB on Linux
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    return {"tokens_per_second": speed["wps"], "updates_per_second": speed["ups"], "peak_memory_gb": peak,
            "memory_kind": "GPU" if gpu else "CPU resident", "checkpoint_bytes":
            os.path.getsize(checkpoint) if os.path.exists(checkpoint) else 0}


def _size(num_bytes: float) -> str:
    """``12 B``, ``3.4 KB``, ... up to GB."""
    for unit in ("B", "KB", "MB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GB"


def check_table(runs: List[Run], extra_train: Sequence[str], runs_dir: str, results_dir: str,
                updates: int = UPDATES, echo: Echo = print) -> dict:
    """The preflight of a table's ``runs`` (see the module docstring): ``{"problems": [line, ...],
    "configurations": [{label, runs, tokens_per_second, updates_per_second, peak_memory_gb,
    memory_kind, hours}, ...], "hours": float}``. Each problem is also echoed as it is found."""
    problems: List[str] = []

    def problem(line: str) -> None:
        problems.append(line)
        echo(f"[preflight] PROBLEM: {line}")

    for folder, what in ((runs_dir, "runs"), (results_dir, "results")):
        found = folder_problem(folder, what)
        if found:
            problem(found)
    if runs:
        found = results_owner_problem(results_dir, runs[0].table.name)
        if found:
            problem(found)
    bad_data = set()
    for pair, data_dir in dict.fromkeys((run.pair, run.data_dir) for run in runs):
        for line in data_problems(data_dir, pair):
            problem(line)
            bad_data.add(data_dir)
    configurations: Dict[Tuple[str, ...], List[Run]] = {}
    commands: Dict[Tuple[str, ...], List[str]] = {}
    plans = {}
    for run in runs:
        try:
            command = run.train_command(list(extra_train))
        except NormplugError as error:
            problem(str(error))
            continue
        # what the real run does with it (runner.train's rule): only runs to train or resume count
        plans[run.run_dir] = training_plan(run, command)
        key = configuration_key(command)
        configurations.setdefault(key, []).append(run)
        commands.setdefault(key, command)
    measured, checkpoint_bytes, to_train = [], 0, 0
    scratch = tempfile.mkdtemp(prefix="normplug-preflight-")
    try:
        for number, (key, config_runs) in enumerate(configurations.items(), 1):
            run, command = config_runs[0], commands[key]
            name = f"{run.table.name} {run.pair} | {run.row.name}"
            args = parse_train_command(command)
            if isinstance(args, str):
                problem(f"{name}: the flags do not parse: {args}")
                continue
            if run.data_dir in bad_data:
                continue
            found = positions_problems(run, args)
            for line in found:
                problem(line)
            if found:
                continue
            training = [run for run in config_runs if plans[run.run_dir].trains]
            if not training:
                echo(f"[preflight] {name}: its {len(config_runs)} run(s) are done (skipped): not measured")
                continue
            folder = os.path.join(scratch, str(number))
            os.makedirs(folder)
            echo(f"[preflight] {name}: training {updates} updates")
            started = time.time()
            result = short_training(run, command, folder, updates)
            if "error" in result:
                problem(f"{name}: the short training failed ({result['error']})")
                continue
            max_update = last_flag_value(command, "--max-update")
            ups = result["updates_per_second"] or updates / max(time.time() - started, 1e-9)
            left = [max(int(max_update) - (plans[run.run_dir].last.updates if plans[run.run_dir].last else 0), 0)
                    for run in training] if max_update else []
            hours = sum(left) / ups / 3600 if max_update else None
            checkpoint_bytes = max(checkpoint_bytes, result["checkpoint_bytes"])
            to_train += len(training)
            measured.append({"label": name, "runs": len(training), "hours": hours, **result})
            tokens = result["tokens_per_second"]
            echo(f"[preflight] {name}: {'?' if tokens is None else f'{tokens:,.0f}'} target tokens/s, "
                 f"{ups:.2f} updates/s, peak {result['memory_kind']} memory {result['peak_memory_gb']:.2f} GB, "
                 f"checkpoint {_size(result['checkpoint_bytes'])}; "
                 + (f"{len(training)} run(s) to train x at most {max_update} updates"
                    + (f" ({sum(left)} left)" if sum(left) != len(training) * int(max_update) else "")
                    + f": {hours:.2f} hours" if hours is not None else "no --max-update: no time estimate"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    needed = checkpoint_bytes * CHECKPOINTS_PER_RUN * to_train
    free = shutil.disk_usage(existing_ancestor(runs_dir)).free
    if needed > free:
        problem(f"the runs folder {runs_dir} has {_size(free)} free, but the {to_train} runs to train need about "
                f"{_size(needed)} of checkpoints ({CHECKPOINTS_PER_RUN} x {_size(checkpoint_bytes)} each)")
    hours = sum(config["hours"] or 0.0 for config in measured)
    echo(f"[preflight] {plan_summary(list(plans.values()))}")
    echo(f"[preflight] {len(configurations)} configuration(s), {len(runs)} run(s), {to_train} to train or resume: "
         f"at most {hours:.2f} hours of training one after another at these speeds (decoding not included); "
         f"checkpoints need about "
         f"{_size(needed)}, {_size(free)} free; {len(problems)} problem(s)")
    return {"problems": problems, "configurations": measured, "hours": hours}
