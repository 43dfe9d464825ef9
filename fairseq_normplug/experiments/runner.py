"""Train and evaluate one row of an experiment table on one prepared data folder.

A run lives in its own folder (``runs/<table>/<pair>/<row-slug>/``)::

    train.log            fairseq-train's log (JSON records), appended across resumes
    checkpoints/         checkpoint_last.pt, checkpoint_best.pt (the validation with the best dev BLEU)
    generate-test.txt    fairseq-generate output on the test set
    scores.json          test BLEU (tokenized, sacreBLEU with signature, compound-split for en-de),
                         the selected checkpoint's update and dev BLEU
    status.json          running | done | diverged | failed, with updates and minutes

What the runner adds to every recipe (docs/fidelity.md):

* **One decoder for dev and test.** The recipe's ``decoding`` spec (beam, GNMT alpha or
  lenpen, max_len_a/b) becomes both fairseq-train's dev-BLEU generator (``--eval-bleu-args``,
  ``--gnmt-alpha``) and fairseq-generate's flags; dev BLEU is tokenized BLEU
  (``--eval-tokenized-bleu``), like the test score.
* **Checkpoint selection by dev BLEU.** fairseq updates ``checkpoint_best.pt`` only when it
  saves, so ``--save-interval-updates`` is set to the effective ``--validate-interval-updates``
  (its last occurrence, the user's ``--train-flags`` included) and ``--keep-interval-updates 1``
  bounds the disk (the numbered interval file is deleted once training is done).
* **Post-processing from the manifest.** ``--eval-bleu-remove-bpe`` and ``--remove-bpe`` are
  the data folder's ``subword_method`` (manifest.json).
* **Tokens per update.** A recipe with ``tokens_per_update`` gets ``--update-freq`` =
  ceil(tokens_per_update / (--max-tokens x world size)).

Everything is resumable: a finished run is skipped, an interrupted one continues from
``checkpoint_last.pt``, and a run whose loss or gradients became NaN/Inf is recorded as
``diverged`` (a result, as in the paper's Tables 2 and 5), not raised as an error. Outputs
are written to temporary names and renamed, so nothing half-written is ever trusted.
"""
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from fairseq_normplug.checkpoint_compat import safe_load
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu
from fairseq_normplug.experiments.configs import Recipe, Row, Schedule, Table
from fairseq_normplug.prepare.bpe import METHODS as SUBWORD_METHODS

USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_DIR = os.path.dirname(sys.executable)
DIVERGENCE_MARKERS = ("FloatingPointError", "gradients are Nan/Inf", "Minimum loss scale reached")
#: fairseq's main branch drops the last batch unless it is a multiple of this (README)
ALL_BATCHES = ["--required-batch-size-multiple", "1"]
TASK = ["--task", "translation_normplug"]
#: fairseq generation options a recipe's ``decoding`` spec may set (GNMT's alpha is a task option)
GENERATION_OPTIONS = ("beam", "lenpen", "max_len_a", "max_len_b")


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


def last_flag_value(flags: List[str], flag: str) -> Optional[str]:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``flags`` (fairseq's argparse:
    the last occurrence wins), None if absent."""
    found = None
    for i, item in enumerate(flags):
        if item == flag and i + 1 < len(flags):
            found = flags[i + 1]
        elif item.startswith(flag + "="):
            found = item.split("=", 1)[1]
    return found


def decoding_task_flags(decoding: dict) -> List[str]:
    """Task flags of a decoding spec (``--gnmt-alpha``), shared by fairseq-train and -generate."""
    return ["--gnmt-alpha", f"{decoding['gnmt_alpha']:g}"] if decoding.get("gnmt_alpha") is not None else []


def generation_options(decoding: dict) -> dict:
    """The fairseq generation options of a decoding spec, as ``--eval-bleu-args`` takes them."""
    return {key: decoding[key] for key in GENERATION_OPTIONS if key in decoding}


def dev_bleu_flags(decoding: dict, subword_method: str) -> List[str]:
    """fairseq-train flags: tokenized dev BLEU with the test set's decoder; select by it."""
    return ["--eval-bleu", "--eval-tokenized-bleu", "--eval-bleu-args", json.dumps(generation_options(decoding)),
            "--eval-bleu-remove-bpe", subword_method, *decoding_task_flags(decoding),
            "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"]


def test_decoding_flags(decoding: dict, subword_method: str) -> List[str]:
    """fairseq-generate flags of the same decoding spec (and post-processing) as dev BLEU."""
    flags = []
    for key, value in generation_options(decoding).items():
        flags += [f"--{key.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return flags + decoding_task_flags(decoding) + ["--remove-bpe", subword_method]


def checkpoint_selection_flags(flags: List[str]) -> List[str]:
    """Save at every validation, so that checkpoint_best.pt is the best dev-BLEU validation
    (fairseq updates it only when it saves); keep one numbered interval checkpoint."""
    interval = last_flag_value(flags, "--validate-interval-updates") or "0"
    return ["--save-interval-updates", interval, "--keep-interval-updates", "1"]


def world_size(flags: List[str]) -> int:
    """Devices fairseq-train will use: --distributed-world-size, else every visible GPU, else 1."""
    given = last_flag_value(flags, "--distributed-world-size")
    return int(given) if given else max(1, torch.cuda.device_count())


def update_freq_flags(recipe: Recipe, flags: List[str]) -> List[str]:
    """``--update-freq`` reaching the recipe's ``tokens_per_update`` on this world size."""
    if recipe.tokens_per_update is None:
        return []
    max_tokens = int(last_flag_value(flags, "--max-tokens"))
    return ["--update-freq", str(math.ceil(recipe.tokens_per_update / (max_tokens * world_size(flags))))]


@dataclass
class Run:
    """One row of one table on one language pair."""

    table: Table
    row: Row
    pair: str
    data_dir: str
    run_dir: str
    seed: int = 1

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
        return read_json(self.path("status.json")) or {"status": "pending"}

    def set_status(self, **fields) -> dict:
        status = {**self.status(), **fields}
        write_json_atomic(self.path("status.json"), status)
        return status

    def device_flags(self) -> List[str]:
        return [] if torch.cuda.is_available() else ["--cpu"]

    def train_command(self, extra: List[str] = ()) -> List[str]:
        recipe = self.recipe
        schedule = self.table.schedules[self.row.schedule]
        flags = [*recipe.train, *scaled_schedule_flags(schedule, recipe), *self.row.model, *self.row.train]
        command = [os.path.join(BIN_DIR, "fairseq-train"), os.path.join(self.data_dir, "bin"),
                   "--user-dir", USER_DIR, *TASK, "--source-lang", self.src, "--target-lang", self.tgt,
                   "--arch", recipe.arch, *flags, *dev_bleu_flags(recipe.decoding, subword_method(self.data_dir)),
                   "--save-dir", self.path("checkpoints"), "--no-epoch-checkpoints", "--seed", str(self.seed),
                   "--log-format", "json", "--num-workers", "0", *ALL_BATCHES, *self.device_flags(),
                   *update_freq_flags(recipe, flags + list(extra)), *extra]
        return command + checkpoint_selection_flags(command)


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
        for interval_checkpoint in glob.glob(run.path("checkpoints", "checkpoint_*_*.pt")):
            os.remove(interval_checkpoint)  # a copy of checkpoint_last.pt or older: keep last and best
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


def subword_method(data_dir: str) -> str:
    """The data folder's subword method (``subword_nmt`` or ``sentencepiece``): the manifest's
    ``subword_method`` field, or for manifests written before it existed their ``recipe.bpe``.
    It is also fairseq's post-processing name (--remove-bpe, --eval-bleu-remove-bpe)."""
    manifest = read_json(os.path.join(data_dir, "manifest.json"))
    if manifest is None:
        raise NormplugError(f"{data_dir} has no readable manifest.json to tell its subword method; "
                            f"prepare it with scripts/prepare_*.sh (docs/data.md)")
    method = manifest.get("subword_method", (manifest.get("recipe") or {}).get("bpe"))
    if method not in SUBWORD_METHODS:
        raise NormplugError(f"{data_dir}/manifest.json: subword_method {method!r} is not one of "
                            f"{', '.join(SUBWORD_METHODS)}; prepare the data with scripts/prepare_*.sh")
    return method


def selected_checkpoint(checkpoint: str) -> dict:
    """The update and dev BLEU of the validation ``checkpoint`` (checkpoint_best.pt) was saved at,
    read with the plugin's safe loader (``weights_only=True``: no code in the file runs)."""
    state = safe_load(checkpoint)
    return {"selected_update": state["optimizer_history"][-1]["num_updates"],
            "dev_bleu": state.get("extra_state", {}).get("val_loss")}


def generate_command(run: Run, checkpoint: str, subset: str = "test") -> List[str]:
    """fairseq-generate on ``subset`` with the decoder and post-processing of dev BLEU."""
    return [os.path.join(BIN_DIR, "fairseq-generate"), os.path.join(run.data_dir, "bin"),
            "--user-dir", USER_DIR, *TASK, "--source-lang", run.src, "--target-lang", run.tgt,
            "--path", checkpoint, "--gen-subset", subset,
            *test_decoding_flags(run.recipe.decoding, subword_method(run.data_dir)),
            *run.recipe.generate, *ALL_BATCHES, *run.device_flags()]


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
    command = generate_command(run, checkpoint)
    echo(f"[{run.label}] translating the test set")
    with open(tmp, "w", encoding="utf-8") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise NormplugError(f"fairseq-generate failed for {run.label}: {proc.stderr.strip().splitlines()[-1]}")
    os.replace(tmp, output)
    scores = {**score_generation(output, run.data_dir, run.tgt), **selected_checkpoint(checkpoint)}
    write_json_atomic(scores_path, scores)
    echo(f"[{run.label}] update {scores['selected_update']} (dev BLEU {scores['dev_bleu']}): test BLEU "
         f"{scores['tokenized_bleu']:.2f} (tokenized), sacreBLEU {scores['sacrebleu']:.2f}")
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
