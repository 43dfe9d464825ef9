"""``scripts/train.sh`` and ``scripts/evaluate.sh``: one row of a table on one prepared data
folder (``scripts/prepare_*.sh`` output, holding bin/ and ref/).

    scripts/train.sh TABLE ROW DATA_DIR [--run-dir DIR] [--train-flags "..."]
    scripts/evaluate.sh TABLE ROW DATA_DIR [--run-dir DIR]

ROW is the row's name in configs/experiments/TABLE.json (e.g. "PreNorm + FixNorm + ScaleNorm").
The default run folder is runs/TABLE/PAIR/ROW-SLUG, the one reproduce.sh uses, so both share
(and resume) the same runs; a run another launcher holds is refused (docs/experiments.md).
"""
import argparse
import glob
import json
import os
import re
import sys

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import PROJECT_DIR, load_table
from fairseq_normplug.experiments.ownership import owned
from fairseq_normplug.experiments.processes import LauncherStopped, stop_signals_forwarded
from fairseq_normplug.experiments.run_commands import train_flags
from fairseq_normplug.experiments.runs import Run, check_data_dir, run_folder
from fairseq_normplug.experiments.scoring import evaluate
from fairseq_normplug.experiments.training import train


def pair_of(data_dir: str) -> str:
    """SRC-TGT of a prepared folder, read from its binarized training files."""
    names = glob.glob(os.path.join(data_dir, "bin", "train.*-*.*.bin"))
    pairs = {re.match(r"train\.([^.]+)\.", os.path.basename(name)).group(1) for name in names}
    if len(pairs) != 1:
        raise NormplugError(f"{data_dir}/bin does not hold exactly one language pair's training data "
                            f"(found: {sorted(pairs) or 'none'}); prepare it with scripts/prepare_*.sh")
    return pairs.pop()


def build_run(args) -> Run:
    table = load_table(args.table)
    row = table.row(args.row)
    data_dir = os.path.abspath(args.data_dir)
    pair = pair_of(data_dir)
    check_data_dir(data_dir, pair)
    run_dir = args.run_dir or run_folder(os.path.join(PROJECT_DIR, "runs"), table.name, pair, row.name)
    return Run(table=table, row=row, pair=pair, data_dir=data_dir, run_dir=run_dir)


def parser_for(prog: str, train_flags: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("table", help="e.g. table3 (configs/experiments/*.json)")
    parser.add_argument("row", help="row name, e.g. 'PreNorm + FixNorm + ScaleNorm'")
    parser.add_argument("data_dir", help="prepared data folder (holds bin/ and ref/)")
    parser.add_argument("--run-dir", help="run folder (default runs/TABLE/PAIR/ROW-SLUG)")
    if train_flags:
        parser.add_argument("--train-flags", default="", help="extra fairseq-train flags, one string")
    return parser


def train_main(argv=None):
    args = parser_for("train.sh", train_flags=True).parse_args(argv)
    try:
        extra = train_flags(args.train_flags)  # its refusals first: before the data is read
        run = build_run(args)
        with stop_signals_forwarded(), owned(run.run_dir, run.label):
            status = train(run, extra)
    except NormplugError as error:
        sys.exit(f"train.sh: error: {error}")
    except LauncherStopped as stop:
        sys.exit(f"train.sh: {stop}: fairseq-train ended; the same command resumes the run")
    print(json.dumps(status, indent=2)[:2000])
    sys.exit(0 if status["status"] in ("done", "diverged") else 1)


def evaluate_main(argv=None):
    args = parser_for("evaluate.sh", train_flags=False).parse_args(argv)
    try:
        run = build_run(args)
        with stop_signals_forwarded(), owned(run.run_dir, run.label):
            scores = evaluate(run)
    except NormplugError as error:
        sys.exit(f"evaluate.sh: error: {error}")
    except LauncherStopped as stop:
        sys.exit(f"evaluate.sh: {stop}: fairseq-generate ended; the same command decodes again")
    if scores is None:
        sys.exit(f"evaluate.sh: error: {run.label} is not trained ({run.status()['status']}); "
                 f"run scripts/train.sh first")
    print(json.dumps(scores, indent=2))


if __name__ == "__main__":
    {"train": train_main, "evaluate": evaluate_main}[sys.argv.pop(1)]()
