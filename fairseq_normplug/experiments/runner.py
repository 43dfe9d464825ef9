"""Train and evaluate one row of an experiment table on one prepared data folder.

A run lives in its own folder (``runs/<table>/<pair>/<row-slug>/``)::

    train.log            fairseq-train's log (JSON records), appended across resumes
    checkpoints/         checkpoint_last.pt, checkpoint_best.pt (best dev BLEU)
    generate-test.txt    fairseq-generate output on the test set
    scores.json          test BLEU (tokenized, sacreBLEU with signature, compound-split for en-de)
    status.json          running | done | diverged | failed, with updates and minutes

Everything is resumable: a finished run is skipped, an interrupted one continues from
``checkpoint_last.pt``, and a run whose loss or gradients became NaN/Inf is recorded as
``diverged`` (a result, as in the paper's Tables 2 and 5), not raised as an error. Outputs
are written to temporary names and renamed, so nothing half-written is ever trusted.
"""
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu
from fairseq_normplug.experiments.configs import Recipe, Row, Schedule, Table

USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_DIR = os.path.dirname(sys.executable)
DIVERGENCE_MARKERS = ("FloatingPointError", "gradients are Nan/Inf", "Minimum loss scale reached")
#: fairseq's main branch drops the last batch unless it is a multiple of this (README)
ALL_BATCHES = ["--required-batch-size-multiple", "1"]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def scaled_schedule_flags(schedule: Schedule, recipe: Recipe) -> List[str]:
    """The schedule's flags with ``--warmup-updates`` and ``--lr-lambda`` scaled by the
    recipe's ``warmup_scale`` and ``lr_lambda_scale`` (short CPU runs of small models: a
    shorter warmup, and a lambda that keeps eq. 7's peak lr near the paper's ~5e-4-1e-3)."""
    flags = list(schedule.flags)
    for flag, scale, convert in (("--warmup-updates", recipe.warmup_scale, lambda v: str(round(v))),
                                 ("--lr-lambda", recipe.lr_lambda_scale, lambda v: f"{v:g}")):
        if flag in flags and scale != 1.0:
            i = flags.index(flag) + 1
            value = float(flags[i]) * scale
            flags[i] = convert(max(value, 1) if flag == "--warmup-updates" and value > 0 else value)
    return flags


@dataclass
class Run:
    """One row of one table on one language pair."""

    table: Table
    row: Row
    pair: str
    data_dir: str
    run_dir: str

    @property
    def src(self) -> str:
        return self.pair.split("-")[0]

    @property
    def tgt(self) -> str:
        return self.pair.split("-")[1]

    @property
    def label(self) -> str:
        return f"{self.table.name} {self.pair} | {self.row.name}"

    def path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    def status(self) -> dict:
        return read_json(self.path("status.json")) or {"status": "pending"}

    def set_status(self, **fields) -> dict:
        status = {**self.status(), **fields}
        write_json_atomic(self.path("status.json"), status)
        return status

    def device_flags(self) -> List[str]:
        return [] if torch.cuda.is_available() else ["--cpu"]

    def train_command(self, extra: List[str] = ()) -> List[str]:
        recipe = self.table.recipe
        schedule = self.table.schedules[self.row.schedule]
        return [os.path.join(BIN_DIR, "fairseq-train"), os.path.join(self.data_dir, "bin"),
                "--user-dir", USER_DIR, "--task", "translation",
                "--source-lang", self.src, "--target-lang", self.tgt, "--arch", recipe.arch,
                *recipe.train, *scaled_schedule_flags(schedule, recipe), *self.row.model, *self.row.train,
                "--save-dir", self.path("checkpoints"), "--no-epoch-checkpoints", "--seed", "1",
                "--log-format", "json", "--num-workers", "0", *ALL_BATCHES, *self.device_flags(),
                *extra]


def check_data_dir(data_dir: str, pair: str) -> None:
    """Fail early, naming what is missing, if ``data_dir`` is not a prepared data folder."""
    src, tgt = pair.split("-")
    needed = [os.path.join("bin", f"dict.{src}.txt"), os.path.join("bin", f"train.{src}-{tgt}.{src}.bin"),
              os.path.join("ref", f"test.tok.{tgt}")]
    missing = [p for p in needed if not os.path.exists(os.path.join(data_dir, p))]
    if missing:
        raise NormplugError(f"{data_dir} is not prepared data for {pair} (missing {missing[0]}); "
                            f"prepare it with scripts/prepare_*.sh (docs/data.md)")


def progress_line(run: Run, line: str) -> Optional[str]:
    """A one-line summary of a validation record, for the console."""
    if "| valid | " not in line:
        return None
    try:
        record = json.loads(line.split("| valid | ", 1)[1])
    except json.JSONDecodeError:
        return None
    parts = [f"update {record.get('valid_num_updates', '?')}", f"dev loss {record.get('valid_loss', '?')}"]
    if "valid_bleu" in record:
        # fairseq adds the best so far only once a checkpoint has been saved
        best = record.get("valid_best_bleu")
        parts.append(f"dev BLEU {record['valid_bleu']}" + (f" (best {best})" if best else ""))
    return f"[{run.label}] " + ", ".join(parts)


def train(run: Run, extra: List[str] = (), echo: Callable[[str], None] = print) -> dict:
    """Train (or resume) ``run``; returns its status. Finished and diverged runs are skipped."""
    status = run.status()
    if status["status"] in ("done", "diverged"):
        echo(f"[{run.label}] {status['status']}: skipped")
        return status
    os.makedirs(run.path("checkpoints"), exist_ok=True)
    command = run.train_command(list(extra))
    started = time.time()
    minutes_before = status.get("minutes", 0.0)
    run.set_status(status="running", command=command)
    echo(f"[{run.label}] training ({'resuming' if status['status'] == 'running' else 'starting'}); "
         f"log: {run.path('train.log')}")
    tail = []
    with open(run.path("train.log"), "a", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-200:]
            summary = progress_line(run, line)
            if summary:
                echo(summary)
        returncode = proc.wait()
    minutes = minutes_before + (time.time() - started) / 60
    updates = last_num_updates(run.path("train.log"))
    if returncode == 0:
        return run.set_status(status="done", minutes=round(minutes, 2), updates=updates)
    text = "".join(tail)
    state = "diverged" if any(marker in text for marker in DIVERGENCE_MARKERS) else "failed"
    echo(f"[{run.label}] {state} (exit {returncode}); see {run.path('train.log')}")
    return run.set_status(status=state, minutes=round(minutes, 2), updates=updates, exit_code=returncode,
                          error=text.strip().splitlines()[-1][:300] if text.strip() else "")


def last_num_updates(log_path: str) -> Optional[int]:
    found = None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = re.search(r'"(?:train_|valid_)?num_updates": "(\d+)"', line)
            if match:
                found = int(match.group(1))
    return found


def bpe_of(data_dir: str) -> str:
    """fairseq-generate's --remove-bpe value for the data folder's subword method."""
    manifest = read_json(os.path.join(data_dir, "manifest.json")) or {}
    method = json.dumps(manifest)
    return "sentencepiece" if "sentencepiece" in method else "subword_nmt"


def evaluate(run: Run, echo: Callable[[str], None] = print) -> Optional[dict]:
    """Translate the test set with the best checkpoint and score it; None if not trained."""
    scores_path = run.path("scores.json")
    if read_json(scores_path) is not None:
        return read_json(scores_path)
    checkpoint = run.path("checkpoints", "checkpoint_best.pt")
    if run.status()["status"] != "done" or not os.path.exists(checkpoint):
        return None
    output = run.path("generate-test.txt")
    tmp = f"{output}.tmp-{os.getpid()}"
    command = [os.path.join(BIN_DIR, "fairseq-generate"), os.path.join(run.data_dir, "bin"),
               "--user-dir", USER_DIR, "--task", "translation", "--source-lang", run.src,
               "--target-lang", run.tgt, "--path", checkpoint, "--gen-subset", "test",
               "--remove-bpe", bpe_of(run.data_dir), *run.table.recipe.generate, *ALL_BATCHES,
               *run.device_flags()]
    echo(f"[{run.label}] translating the test set")
    with open(tmp, "w", encoding="utf-8") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise NormplugError(f"fairseq-generate failed for {run.label}: {proc.stderr.strip().splitlines()[-1]}")
    os.replace(tmp, output)
    scores = score_generation(output, run.data_dir, run.tgt)
    write_json_atomic(scores_path, scores)
    echo(f"[{run.label}] test BLEU {scores['tokenized_bleu']:.2f} (tokenized), "
         f"sacreBLEU {scores['sacrebleu']:.2f}")
    return scores


def test_references(data_dir: str, tgt: str):
    """(tokenized references, detokenized references or None) of a prepared data folder."""
    refs_tok = bleu.read_lines(os.path.join(data_dir, "ref", f"test.tok.{tgt}"))
    detok_path = os.path.join(data_dir, "ref", f"test.detok.{tgt}")
    return refs_tok, bleu.read_lines(detok_path) if os.path.exists(detok_path) else None


def test_hypotheses(run: "Run", expected: int) -> List[str]:
    return bleu.read_fairseq_generate(run.path("generate-test.txt"), expected=expected).hypotheses


def score_generation(generate_output: str, data_dir: str, tgt: str) -> dict:
    """Tokenized BLEU (the paper's), detokenized sacreBLEU with signature and, for German
    targets, the WMT recipe's compound-split BLEU."""
    refs_tok, refs_detok = test_references(data_dir, tgt)
    hyps = bleu.read_fairseq_generate(generate_output, expected=len(refs_tok)).hypotheses
    return bleu.score_translation(hyps, refs_tok, lang=tgt, detok_refs=refs_detok,
                                  compound_split=tgt == "de")
