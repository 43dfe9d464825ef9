"""One run: one row of one table on one language pair and seed, in its own folder
(``RUNS_DIR/TABLE/PAIR/ROW-SLUG``), with its records, devices and commands."""
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import portable_paths
from fairseq_normplug.experiments.batching import Batching, command_batching
from fairseq_normplug.experiments.configs import Recipe, Row, Table, slug
from fairseq_normplug.experiments.run_commands import train_command, subword_method
from fairseq_normplug.experiments.run_records import read_json, record_problem, write_json_atomic


@dataclass
class Run:
    """One row of one table on one language pair."""

    table: Table
    row: Row
    pair: str
    data_dir: str
    run_dir: str
    seed: int = 1
    #: subword method of a data folder not prepared yet (only for printing its commands)
    assumed_subword: Optional[str] = None
    #: CUDA_VISIBLE_DEVICES of the run's processes (None: inherited)
    devices: Optional[str] = None
    #: the devices it trains on, for its tokens per update (None: what fairseq-train sees)
    num_devices: Optional[int] = None
    #: OMP_NUM_THREADS / torch threads of its processes (None: inherited)
    threads: Optional[int] = None

    @property
    def src(self) -> str:
        return self.pair.split("-")[0]

    @property
    def tgt(self) -> str:
        return self.pair.split("-")[1]

    @property
    def label(self) -> str:
        seed = f" | seed {self.seed}" if self.seed != 1 else ""
        return f"{self.table.name} {self.pair} | {self.row.name}{seed}"

    @property
    def recipe(self) -> Recipe:
        """The table's recipe for this pair (e.g. iwslt15 for en-vi in a ted table)."""
        return self.table.recipe_for(self.pair)

    def path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    def status(self) -> dict:
        """status.json; ``pending`` when it is missing, corrupt or has a field of the wrong type
        (:func:`record_problem`; the run is then resumed from its checkpoints, which repairs it)."""
        status = read_json(self.path("status.json"))
        good = status is not None and record_problem(self.path("status.json"), status) is None
        return status if good else {"status": "pending"}

    def record_problems(self) -> List[str]:
        """One line per bad record of the run (status.json, scores.json), naming its path."""
        return [problem for problem in (record_problem(self.path(name)) for name in ("status.json", "scores.json"))
                if problem]

    def set_status(self, **fields) -> dict:
        status = {**self.status(), **fields}
        write_json_atomic(self.path("status.json"), status)
        return status

    def roots(self) -> Dict[str, str]:
        """The folders its recorded command names by placeholder (experiments/portable_paths.py)."""
        return portable_paths.run_roots(self.run_dir, self.data_dir)

    def device_flags(self) -> List[str]:
        return [] if self.num_devices or torch.cuda.is_available() else ["--cpu"]

    def env(self) -> Dict[str, str]:
        """The environment variables the run's launcher sets for its processes."""
        env = {} if self.devices is None else {"CUDA_VISIBLE_DEVICES": self.devices}
        if self.threads is not None:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        return env

    def batching(self, extra: List[str] = ()) -> Batching:
        """The tokens per update its training command trains with."""
        return command_batching(self.train_command(list(extra)), self.num_devices)

    def train_command(self, extra: List[str] = ()) -> List[str]:
        """Its fairseq-train command (:func:`~fairseq_normplug.experiments.run_commands.train_command`)."""
        return train_command(self, extra)


def run_folder(runs_dir: str, table: str, pair: str, row: str, seed: int = 1) -> str:
    """``RUNS_DIR/TABLE/PAIR/ROW-SLUG`` for seed 1 (the folder of a one-seed table), and
    ``RUNS_DIR/TABLE/PAIR/ROW-SLUG-seedN`` for every other seed N."""
    return os.path.join(runs_dir, table, pair, slug(row) + (f"-seed{seed}" if seed != 1 else ""))


def check_data_dir(data_dir: str, pair: str) -> None:
    """Fail early, naming what is missing, if ``data_dir`` is not a prepared data folder."""
    src, tgt = pair.split("-")
    subword_method(data_dir)
    needed = [os.path.join("bin", f"dict.{src}.txt"), os.path.join("bin", f"train.{src}-{tgt}.{src}.bin"),
              os.path.join("ref", f"test.tok.{tgt}")]
    missing = [p for p in needed if not os.path.exists(os.path.join(data_dir, p))]
    if missing:
        raise NormplugError(f"{data_dir} is not prepared data for {pair} (missing {missing[0]}); "
                            f"prepare it with scripts/prepare_*.sh (docs/data.md)")
