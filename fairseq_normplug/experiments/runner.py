"""Train and evaluate one row of an experiment table on one prepared data folder.

A run lives in its own folder (``runs/<table>/<pair>/<row-slug>/``)::

    train.log            fairseq-train's log (JSON records), appended across resumes
    checkpoints/         checkpoint_last.pt, checkpoint_best.pt (the validation with the best dev BLEU),
                         the dictionaries and subword model beside them (fairseq_normplug/hub.py)
    generate-test.txt    fairseq-generate output on the test set
    scores.json          test BLEU (tokenized, sacreBLEU with signature, compound-split for en-de),
                         chrF and chrF++ with signature (the lines sacreBLEU scores),
                         the selected checkpoint's update and dev BLEU
    status.json          running | done | diverged | failed, with updates and minutes
    owner.lock           while a launcher owns the run (experiments/ownership.py)

What the runner adds to every recipe (docs/fidelity.md):

* **One decoder for dev and test.** The recipe's ``decoding`` spec (beam, GNMT alpha or
  lenpen, the authors' search, max_len_a/b of the per-sentence length cap) becomes both
  fairseq-train's dev-BLEU generator (``--eval-bleu-args``, ``--gnmt-alpha``,
  ``--gnmt-search``) and fairseq-generate's flags; dev BLEU is tokenized BLEU
  (``--eval-tokenized-bleu``), like the test score. Each sentence's length cap is its own
  (the task's default), so dev BLEU during training (validation batches) and the test decoder
  (other batches) give one checkpoint the same hypotheses.
* **Checkpoint selection by dev BLEU.** fairseq updates ``checkpoint_best.pt`` only when it
  saves, so ``--save-interval-updates`` is set to the effective ``--validate-interval-updates``
  (its last occurrence, the user's ``--train-flags`` included) and ``--keep-interval-updates 1``
  bounds the disk (the numbered interval file is deleted once training is done).
* **Post-processing from the manifest.** ``--eval-bleu-remove-bpe`` and ``--remove-bpe`` are
  the data folder's ``subword_method`` (manifest.json).
* **Tokens per update.** A recipe's ``tokens_per_update`` is reached exactly on any number of
  devices: the runner splits it evenly over the run's devices and sets ``--max-tokens`` per
  device (at most the recipe's ``--max-tokens``) and ``--update-freq`` (:func:`plan_batching`);
  a device count that cannot reach it is refused with one line before anything is trained.
* **Devices and threads.** A run's ``devices`` (``CUDA_VISIBLE_DEVICES``), ``num_devices`` and
  ``threads`` (``OMP_NUM_THREADS``) are set by its launcher (experiments/launchers.py); unset,
  a run uses what its process sees, as fairseq-train does.

Everything is resumable: a finished run is skipped, an interrupted one continues from
``checkpoint_last.pt``, and a run that diverged is recorded as ``diverged`` (a result, as in the
paper's Tables 2 and 5), not raised as an error: its loss or gradients became NaN/Inf, a dev loss
was worse than a uniform guess over the target vocabulary (:func:`diverged_at`; training is
stopped there), or no dev BLEU could be computed. Outputs
are written to temporary names and renamed, so nothing half-written is ever trusted. A job
killed at any moment (SIGKILL, a node lost) continues when the same command runs again:
checkpoints it left half-copied are deleted and its interrupted save is finished first
(:mod:`fairseq_normplug.checkpoint_safety`), a run whose training had ended is not trained
an update further, and the resumed run trains on the uninterrupted run's batches
(``--task translation_normplug``), so the table is the one an uninterrupted job writes.

**One owner down to the trainer.** fairseq-train and fairseq-generate are started by
:func:`run_process`: the run's lock records each one's pid while it runs
(:func:`fairseq_normplug.experiments.ownership.record_process`), and while a launcher executes
runs (:func:`stop_signals_forwarded`) SIGTERM, SIGINT and SIGHUP are forwarded to them; the
launcher waits for them to end (SIGKILL after :data:`STOP_GRACE_S` seconds), releases its runs,
and stops with :class:`LauncherStopped`. A stopped run is resumed by the next launcher, never
trained beside a process of the stopped one.
"""
import glob
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from fairseq_normplug.atomic_files import move_into_place, write_text_atomic
from fairseq_normplug import checkpoint_safety, hub
from fairseq_normplug.checkpoint_compat import safe_load
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.flag_lists import command_flags, last_flag_value, split_flags  # noqa: F401 (reproduce, preflight)
from fairseq_normplug.experiments import bleu, ownership, portable_paths
from fairseq_normplug.experiments.configs import Recipe, Row, Schedule, Table, slug  # noqa: F401 (runner.slug)
from fairseq_normplug.experiments.training_log import (  # noqa: F401 (runner.valid_record, runner.STOP_LINES)
    STOP_LINES, dev_loss, last_num_updates, logged_stop_reason, valid_losses, valid_record,
)
from fairseq_normplug.optim.lr_scheduler.common import PAPER_STOP_LR
from fairseq_normplug.prepare.bpe import METHODS as SUBWORD_METHODS

USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_DIR = os.path.dirname(sys.executable)
#: what fairseq-train prints when a run diverges, and what it means (its last failing line)
DIVERGENCE_MARKERS = {
    "FloatingPointError": "NaN or inf in the loss or gradients",
    "gradients are Nan/Inf": "NaN or inf in the gradients",
    "Minimum loss scale reached": "the fp16 loss scale fell to its minimum (overflow at every update)",
    "KeyError: 'bleu'": "no dev BLEU could be computed (every dev translation was empty)",
}
#: the states of a run's status.json ("pending": none yet)
RUN_STATES = ("pending", "running", "done", "diverged", "failed")
#: a dev loss over this many times a uniform guess's (log2 |V| bits per token) is a divergence
#: at any validation; an untrained model's first validations may be somewhat above log2 |V|
#: (a tiny model at update 3: 7.65 bits against 6.32), a diverged one is far above (98-130 bits)
DIVERGENCE_FACTOR = 2.0
#: fairseq's main branch drops the last batch unless it is a multiple of this (README)
ALL_BATCHES = ["--required-batch-size-multiple", "1"]
TASK = ["--task", "translation_normplug"]
#: fairseq generation options a recipe's ``decoding`` spec may set (GNMT's alpha is a task option)
GENERATION_OPTIONS = ("beam", "lenpen", "max_len_a", "max_len_b")


#: the signals a launcher forwards to its runs' processes before it stops (:func:`stop_signals_forwarded`)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: seconds a stopped run's process has to end after the forwarded signal, before SIGKILL
STOP_GRACE_S = float(os.environ.get("NORMPLUG_STOP_GRACE", "30"))


class LauncherStopped(KeyboardInterrupt):
    """The launcher got a stop signal (:data:`STOP_SIGNALS`): its runs' processes were ended;
    a KeyboardInterrupt, so that callers that stop on Ctrl-C stop on it too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


class _Processes:
    """The fairseq processes this launcher runs now, and the stop signal it got, if any."""

    def __init__(self):
        self.lock = threading.RLock()  # re-entered by the signal handler when it interrupts the main thread in it
        self.running: Dict[int, subprocess.Popen] = {}
        self.stop_signal: Optional[int] = None
        self.starting = False  # the main thread is between Popen and registering the process

    def forward(self, signum: int) -> None:
        with self.lock:
            processes = list(self.running.values())
        for proc in processes:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass


_PROCESSES = _Processes()


def stop_requested() -> Optional[int]:
    """The stop signal this launcher got, None if none."""
    return _PROCESSES.stop_signal


def _on_stop_signal(signum: int, _frame) -> None:
    first = _PROCESSES.stop_signal is None
    if first:
        _PROCESSES.stop_signal = signum
    _PROCESSES.forward(signum)
    if first and not _PROCESSES.starting:  # while a process starts, run_process raises once it is registered
        raise LauncherStopped(signum)


@contextmanager
def stop_signals_forwarded() -> Iterator[None]:
    """While the block runs (in the main thread), :data:`STOP_SIGNALS` are forwarded to the
    runs' fairseq processes and raise :class:`LauncherStopped` (once; a second signal is only
    forwarded, so that the stop's clean-up is not cut short). Elsewhere: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _on_stop_signal) for signum in STOP_SIGNALS}
    _PROCESSES.stop_signal = None
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _PROCESSES.stop_signal = None  # every process of the block has ended: the next block starts afresh


def end_process(proc: subprocess.Popen, signum: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """End ``proc`` (a stopped or failed run's fairseq process): ``signum`` unless it was
    forwarded already, reading what it still writes, SIGKILL after ``grace_s`` seconds."""
    if proc.poll() is None and _PROCESSES.stop_signal is None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    try:
        proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    except (OSError, ValueError):  # its pipes were closed by the interrupted reader
        proc.wait()


@contextmanager
def run_process(run: "Run", role: str, command: List[str], **popen_options) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(command, **popen_options)`` as ``run``'s ``role`` (``trainer``,
    ``decoder``): recorded in the run's lock while it runs; when the block ends by an exception
    (a stop signal included) it is ended and waited for (:func:`end_process`) before the
    exception goes on; a block that ends normally must have waited for it. A launcher stopped
    meanwhile raises :class:`LauncherStopped` (a worker thread's run ends here)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _PROCESSES.starting = True
    try:
        proc = subprocess.Popen(command, **popen_options)
        with _PROCESSES.lock:
            _PROCESSES.running[id(proc)] = proc
    finally:
        if main:
            _PROCESSES.starting = False
    try:
        try:
            ownership.record_process(run.run_dir, role, proc.pid)
            if _PROCESSES.stop_signal is not None:  # the signal came while it started
                _PROCESSES.forward(_PROCESSES.stop_signal)
                raise LauncherStopped(_PROCESSES.stop_signal)
            yield proc
        except BaseException:
            end_process(proc)
            raise
        finally:
            with _PROCESSES.lock:
                _PROCESSES.running.pop(id(proc), None)
        if _PROCESSES.stop_signal is not None:  # ended by the forwarded signal: not a result
            raise LauncherStopped(_PROCESSES.stop_signal)
    finally:
        ownership.record_process(run.run_dir, role, None)


def write_json_atomic(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` as JSON through atomic_files (a full disk or a kill leaves the
    old file and no temporary one)."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def read_json(path: str) -> Optional[dict]:
    """The JSON object in a file the runner wrote (status.json, scores.json, manifest.json);
    None when it is missing, cut, not UTF-8 JSON or not an object (a corrupt file is as good
    as none: the runner writes it again)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return data if isinstance(data, dict) else None


def read_scores(path: str) -> Optional[dict]:
    """A scores.json with a finite test BLEU and every field the table reads of its type
    (:func:`record_problem`), else None (missing, corrupt, ``{}``, cut short, ``"sacrebleu":
    "x"``): a run without one is not scored and is decoded again."""
    scores = read_json(path)
    return scores if scores is not None and record_problem(path, scores) is None else None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return _number(value) and math.isfinite(value) and float(value).is_integer()


def _text(value) -> bool:
    return isinstance(value, str)


#: the fields of a run's records that results.csv, the figures and the runner read, and their
#: types (None, JSON's null, is allowed for each); other fields are not read
RECORD_FIELDS = {
    "status.json": {"minutes": (_number, "a number"), "updates": (_integer, "an integer"),
                    "exit_code": (_integer, "an integer"), "stopped_by": (_text, "text"),
                    "diverged": (_text, "text"), "error": (_text, "text"), "run_error": (_text, "text"),
                    "command": (lambda v: isinstance(v, list) and all(map(_text, v)), "a list of strings")},
    "scores.json": {**{name: (_number, "a number") for name in (
                        "tokenized_bleu", "sacrebleu", "chrf", "chrf++", "compound_split_bleu", "multi_bleu_detok",
                        "dev_bleu", "length_ratio", "sys_len", "ref_len")},
                    "selected_update": (_integer, "an integer"),
                    "sacrebleu_signature": (_text, "text"), "chrf_signature": (_text, "text")},
}


def record_problem(path: str, record: Optional[dict] = None) -> Optional[str]:
    """What is wrong with the run record ``path`` (a status.json or scores.json), in one line
    naming the file, or None when it is missing or good; ``record``: its content, already read.
    A bad record is never tabulated: the run reads as not started (status.json: a re-run resumes
    it from its checkpoints) or not scored (scores.json: decoded again)."""
    if record is None:
        if not os.path.exists(path):
            return None
        record = read_json(path)
        if record is None:
            return f"{path} is not a JSON object (cut short or corrupt)"
    kind = os.path.basename(path)
    if kind == "status.json" and record.get("status") not in RUN_STATES:
        return f"{path}: status {record.get('status')!r} is not one of {', '.join(RUN_STATES)}"
    if kind == "scores.json" and record.get("tokenized_bleu") is None:
        return f"{path} has no test BLEU (tokenized_bleu)"
    if kind == "scores.json" and _number(record["tokenized_bleu"]) and not math.isfinite(record["tokenized_bleu"]):
        return f"{path}: tokenized_bleu={record['tokenized_bleu']!r} is not a finite number"
    for name, (check, what) in RECORD_FIELDS.get(kind, {}).items():
        value = record.get(name)
        if value is not None and not check(value):
            return f"{path}: {name}={value!r} is not {what}"
    return None


def scaled_schedule_flags(schedule: Schedule, recipe: Recipe) -> List[str]:
    """The schedule's flags with ``--warmup-updates``, ``--lr-lambda`` and ``--lr`` scaled by the
    recipe's ``warmup_scale``, ``lr_lambda_scale`` and ``lr_scale`` (short CPU runs of small
    models: a shorter warmup, a lambda that keeps eq. 7's peak lr where the recipe wants it, and
    NoWarmup's constant lr scaled like that peak)."""
    flags = list(schedule.flags)
    for flag, scale, convert in (("--warmup-updates", recipe.warmup_scale, lambda v: str(round(v))),
                                 ("--lr-lambda", recipe.lr_lambda_scale, lambda v: f"{v:.4g}"),
                                 ("--lr", recipe.lr_scale, lambda v: f"{v:.4g}")):
        if flag in flags and scale != 1.0:
            i = flags.index(flag) + 1
            value = float(flags[i]) * scale
            flags[i] = convert(max(value, 1) if flag == "--warmup-updates" and value > 0 else value)
    return flags


#: fairseq-train flags every run's command sets itself (:meth:`Run.train_command`), and why
#: ``--train-flags`` cannot change them
RUNNER_OWNED_FLAGS = {
    "--save-dir": "each run keeps its checkpoints in its own folder, RUN_DIR/checkpoints, where it "
                  "resumes, selects and evaluates them (--runs-dir or train.sh --run-dir moves the run folders)",
    "--seed": "each run trains with its own seed, the one its folder is named after "
              "(reproduce.sh --seeds N [N ...])",
}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_data_folder(text: str) -> bool:
    """Whether ``text`` names a folder of fairseq data: its dictionaries, or a ``bin/`` holding them."""
    if not os.path.isdir(text):
        return False
    return any(glob.glob(os.path.join(text, *sub, "dict.*.txt")) for sub in ((), ("bin",)))


def runner_owned_problem(flags: Sequence[str]) -> Optional[str]:
    """Why ``flags`` (``--train-flags``) would change what the runner sets in every run's
    command, or None: :data:`RUNNER_OWNED_FLAGS`, or a data path (fairseq-train's positional
    argument: the first item, an item after another non-flag that is not a number, or a
    folder of fairseq data)."""
    for i, item in enumerate(flags):
        name = item.split("=", 1)[0]
        if name in RUNNER_OWNED_FLAGS:
            return f"{name} is set by the runner: {RUNNER_OWNED_FLAGS[name]}; drop it from --train-flags"
        if item.startswith("-"):
            continue
        after_value = i > 0 and not flags[i - 1].startswith("-") and not _is_number(item)
        if i == 0 or after_value or _is_data_folder(item):
            return (f"{item!r} is a data path, which the runner gives every run (its pair's prepared data "
                    f"folder: reproduce.sh --data PAIR=DIR, train.sh DATA_DIR); drop it from --train-flags")
    return None


def train_flags(text: str) -> List[str]:
    """``--train-flags``, split as a shell splits it (quotes keep ``'(0.9, 0.999)'`` one value);
    a flag the runner sets in every run (:func:`runner_owned_problem`) is refused in one line."""
    try:
        flags = split_flags(text)
    except ValueError as error:
        raise NormplugError(f"--train-flags {text!r}: {error} (it is split like a shell command line)") from None
    problem = runner_owned_problem(flags)
    if problem:
        raise NormplugError(f"--train-flags {text!r}: {problem}")
    return flags


def decoding_task_flags(decoding: dict) -> List[str]:
    """Task flags of a decoding spec (``--gnmt-alpha``, ``--gnmt-search``, ``--batch-length-cap``),
    shared by fairseq-train (dev BLEU) and fairseq-generate (test)."""
    flags = ["--gnmt-alpha", f"{decoding['gnmt_alpha']:g}"] if decoding.get("gnmt_alpha") is not None else []
    return flags + [f"--{key.replace('_', '-')}" for key in ("gnmt_search", "batch_length_cap") if decoding.get(key)]


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


#: lr schedulers whose peak lr is eq. 7's (set by --lr-lambda), so that --lr changes nothing:
#: always (inv_sqrt_decay), or with a warmup unless --warmup-peak lr (val_decay)
LAMBDA_PEAK_SCHEDULERS = ("inv_sqrt_decay", "val_decay")


def ignored_lr_problem(command: List[str], user_flags: List[str]) -> Optional[str]:
    """Why a ``--lr`` of ``user_flags`` (a row's and ``--train-flags``) does nothing in
    ``command``, or None: under inv_sqrt_decay, or val_decay with a warmup to eq. 7's peak,
    the lr comes from ``--lr-lambda`` and fairseq would silently drop the user's ``--lr``."""
    lr = last_flag_value(user_flags, "--lr")
    scheduler = last_flag_value(command, "--lr-scheduler")
    if lr is None or scheduler not in LAMBDA_PEAK_SCHEDULERS:
        return None
    if scheduler == "val_decay" and (int(float(last_flag_value(command, "--warmup-updates") or 0)) == 0
                                     or last_flag_value(command, "--warmup-peak") == "lr"):
        return None
    return (f"--lr {lr} is ignored by --lr-scheduler {scheduler} (its peak lr is eq. 7's, set by --lr-lambda); "
            f"give --lr-lambda instead" + (", or --warmup-peak lr" if scheduler == "val_decay" else ""))


def checkpoint_selection_flags(flags: List[str]) -> List[str]:
    """Save at every validation, so that checkpoint_best.pt is the best dev-BLEU validation
    (fairseq updates it only when it saves); keep one numbered interval checkpoint."""
    interval = last_flag_value(flags, "--validate-interval-updates") or "0"
    return ["--save-interval-updates", interval, "--keep-interval-updates", "1"]


def world_size(flags: List[str], planned: Optional[int] = None) -> int:
    """Devices fairseq-train will use: --distributed-world-size, else the run's planned device
    count, else every visible GPU, else 1."""
    given = last_flag_value(flags, "--distributed-world-size")
    if given:
        return int(given)
    return planned if planned is not None else max(1, torch.cuda.device_count())


@dataclass(frozen=True)
class Batching:
    """How one update is made: ``max_tokens`` per batch on each of ``devices`` devices, summed
    over ``update_freq`` batches (fairseq's --max-tokens, world size, --update-freq)."""

    max_tokens: int
    devices: int
    update_freq: int

    @property
    def tokens_per_update(self) -> int:
        return self.max_tokens * self.devices * self.update_freq

    def describe(self) -> str:
        plural = "s" if self.devices != 1 else ""
        return (f"{self.tokens_per_update} tokens per update (--max-tokens {self.max_tokens} x "
                f"{self.devices} device{plural} x --update-freq {self.update_freq})")


def plan_batching(tokens_per_update: int, device_max_tokens: int, devices: int, recipe: str = "") -> Batching:
    """The batching that reaches ``tokens_per_update`` exactly on ``devices`` devices: each
    device's share is split into the fewest batches of at most ``device_max_tokens`` (the
    recipe's --max-tokens, what one device holds) that divide it evenly; a share split into
    more than twice the fewest batches possible counts as unreachable. Raises
    :class:`NormplugError` naming the values and device counts that work."""
    where = f"recipe {recipe!r}: " if recipe else ""

    def reachable(count: int) -> bool:
        if tokens_per_update % count:
            return False
        share = tokens_per_update // count
        fewest = math.ceil(share / device_max_tokens)
        return any(share % freq == 0 for freq in range(fewest, 2 * fewest + 1))

    if devices < 1 or not reachable(devices):
        working = [str(count) for count in range(1, 65) if reachable(count)][:8]
        why = (f"{tokens_per_update} is not a multiple of {devices}" if devices >= 1 and tokens_per_update % devices
               else f"no split of {tokens_per_update // max(devices, 1)} tokens per device into batches of at most "
                    f"{device_max_tokens}")
        raise NormplugError(f"{where}{tokens_per_update} tokens per update cannot be reached exactly on {devices} "
                            f"device(s) ({why}); device counts that work: {', '.join(working) or 'none'}")
    share = tokens_per_update // devices
    freq = math.ceil(share / device_max_tokens)
    while share % freq:
        freq += 1
    return Batching(max_tokens=share // freq, devices=devices, update_freq=freq)


def batching_flags(recipe: Recipe, flags: List[str], devices: int) -> List[str]:
    """``--max-tokens``/``--update-freq`` reaching the recipe's ``tokens_per_update`` on
    ``devices`` devices, given the recipe's (and row's) ``flags`` (none for a recipe without it)."""
    if recipe.tokens_per_update is None:
        return []
    given = last_flag_value(flags, "--max-tokens")
    if given is None:
        raise NormplugError(f"recipe {recipe.name!r} has tokens_per_update but no --max-tokens (the most "
                            f"tokens one device holds); add it to its 'train' flags")
    batching = plan_batching(recipe.tokens_per_update, int(given), devices, recipe.name)
    return ["--max-tokens", str(batching.max_tokens), "--update-freq", str(batching.update_freq)]


def command_batching(command: List[str], planned_devices: Optional[int] = None) -> Batching:
    """The batching a fairseq-train command trains with (the last occurrence of each flag)."""
    max_tokens = last_flag_value(command, "--max-tokens")
    if max_tokens is None:
        raise NormplugError("the training command has no --max-tokens, so its tokens per update are unknown")
    return Batching(max_tokens=int(max_tokens), devices=world_size(command, planned_devices),
                    update_freq=int(last_flag_value(command, "--update-freq") or 1))


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
        recipe = self.recipe
        schedule = self.table.schedules[self.row.schedule]
        flags = [*recipe.train, *scaled_schedule_flags(schedule, recipe), *self.row.model, *self.row.train]
        command = [os.path.join(BIN_DIR, "fairseq-train"), os.path.join(self.data_dir, "bin"),
                   "--user-dir", USER_DIR, *TASK, "--source-lang", self.src, "--target-lang", self.tgt,
                   "--arch", recipe.arch, *flags, *dev_bleu_flags(recipe.decoding, subword_method(self.data_dir, self.assumed_subword)),
                   "--save-dir", self.path("checkpoints"), "--no-epoch-checkpoints", "--seed", str(self.seed),
                   "--log-format", "json", "--num-workers", "0", *ALL_BATCHES, *self.device_flags(),
                   *batching_flags(recipe, flags, world_size(flags + list(extra), self.num_devices)), *extra]
        problem = ignored_lr_problem(command, [*self.row.model, *self.row.train, *extra])
        if problem:
            raise NormplugError(f"{self.table.name} row {self.row.name!r}: {problem}")
        return command + checkpoint_selection_flags(command)


def changed_flags(recorded: List[str], command: List[str]) -> List[str]:
    """How ``command`` differs from the ``recorded`` one a run was trained with, as
    ``--flag old -> new`` (``(none)`` for an absent flag). Both are compared in their portable
    form (experiments/portable_paths.py: ``$RUN``, ``$DATA``, ``$PLUGIN``...), so a run folder
    copied to another machine, or its repository moved, trains the same, and an old record with
    the absolute paths of the machine that ran it still matches."""
    def shown(value: Optional[str]) -> str:
        return "(none)" if value is None else (value or "(set)")

    old = command_flags(portable_paths.recorded_form(recorded))
    new = command_flags(portable_paths.recorded_form(command))
    changes = []
    for flag in dict.fromkeys([*old, *new]):
        before, after = old.get(flag), new.get(flag)
        if before == after:
            continue
        changes.append(f"{flag} {shown(before)} -> {shown(after)}")
    return changes


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


def target_vocabulary_size(data_dir: str, tgt: str) -> Optional[int]:
    """|V| of the target dictionary: its lines plus fairseq's 4 special symbols; None without it."""
    path = os.path.join(data_dir, "bin", f"dict.{tgt}.txt")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip()) + 4


def uniform_guess_bits(run: "Run") -> Optional[float]:
    """log2 |V| of the run's target vocabulary: the dev loss (bits per token, fairseq's unit)
    of a uniform guess; None without a dictionary."""
    size = target_vocabulary_size(run.data_dir, run.tgt)
    return None if size is None else math.log2(size)


def diverged_at(record: dict, uniform: Optional[float], learned: bool) -> Optional[str]:
    """Why a validation ``record`` shows a diverged run, None when it does not: a NaN or inf
    dev loss; a dev loss over :data:`DIVERGENCE_FACTOR` times a uniform guess's (``uniform``
    bits); or, once the run has ``learned`` (an earlier dev loss below ``uniform``), a dev loss
    worse than a uniform guess again."""
    loss = dev_loss(record)
    if loss is None:
        return None
    update = record.get("valid_num_updates", "?")
    if not math.isfinite(loss):
        return f"dev loss {loss} at update {update}"
    if uniform is None:
        return None
    guess = f"a uniform guess over the target vocabulary ({uniform:.2f} bits)"
    if loss > DIVERGENCE_FACTOR * uniform:
        return f"dev loss {loss:g} bits per token at update {update}, over {DIVERGENCE_FACTOR:g} times {guess}"
    if learned and loss > uniform:
        return f"dev loss {loss:g} bits per token at update {update}, worse than {guess} after it had been better"
    return None


def progress_line(run: Run, line: str) -> Optional[str]:
    """A one-line summary of a validation record, for the console."""
    record = valid_record(line)
    if record is None:
        return None
    parts = [f"update {record.get('valid_num_updates', '?')}", f"dev loss {record.get('valid_loss', '?')}"]
    if "valid_bleu" in record:
        # fairseq adds the best so far only once a checkpoint has been saved
        best = record.get("valid_best_bleu")
        parts.append(f"dev BLEU {record['valid_bleu']}" + (f" (best {best})" if best else ""))
    return f"[{run.label}] " + ", ".join(parts)


@dataclass
class TrainingPlan:
    """What :func:`train` does with a run (``--print-commands`` and ``--preflight`` say it too):
    ``done`` (finished or diverged: skipped), ``over`` (its last checkpoint already ended training:
    recorded done without another update), ``resume`` (from ``last.updates``) or ``train``."""

    action: str
    changes: List[str]
    last: Optional[checkpoint_safety.CheckpointInfo] = None
    over: Optional[str] = None
    state: str = "pending"

    @property
    def trains(self) -> bool:
        """It runs fairseq-train (from the start or resumed)."""
        return self.action in ("resume", "train")

    def trained_with(self, run_dir: str = "the run folder") -> str:
        return (f" (trained with {'; '.join(self.changes)}: delete {run_dir} to train it with this "
                "command)" if self.changes else "")

    def describe(self) -> str:
        """One line: ``done (skipped)``, ``to resume from update N``, ``to train``..."""
        if self.action == "done":
            return f"{self.state} (skipped){self.trained_with()}"
        if self.action == "over":
            return f"training was over ({self.over}): to record as done, not resumed"
        changed = f" (the command has changed: {'; '.join(self.changes)})" if self.changes else ""
        if self.action == "resume":
            return f"to resume from update {self.last.updates}{changed}"
        return f"to train{changed}"


def training_plan(run: Run, command: List[str], status: Optional[dict] = None,
                  read_last: bool = True) -> TrainingPlan:
    """The one rule of what :func:`train` does with ``run`` and its ``command`` (reads, writes
    nothing): a finished or diverged run is skipped; otherwise its last checkpoint (read as
    fairseq-train resumes from it) either already ended training under this command's stopping
    rules, or is resumed, or there is none and it trains from the start. ``read_last=False``:
    only whether it is skipped (``resume``/``train`` undecided)."""
    status = run.status() if status is None else status
    changes = changed_flags(status["command"], command) if status.get("command") else []
    if status["status"] in ("done", "diverged"):
        return TrainingPlan("done", changes, state=status["status"])
    if not read_last:
        return TrainingPlan("train", changes, state=status["status"])
    last = checkpoint_safety.read_checkpoint(run.path("checkpoints", checkpoint_safety.LAST))
    max_update = last_flag_value(command, "--max-update")
    # the stopping rules of this command (or the schedulers' defaults), not the checkpoint's
    over = checkpoint_safety.finished(last, int(max_update) if max_update else None,
                                      int(last_flag_value(command, "--stop-patience") or 0),
                                      float(last_flag_value(command, "--stop-lr") or PAPER_STOP_LR))
    action = "over" if over else ("resume" if last is not None else "train")
    return TrainingPlan(action, changes, last, over, status["status"])


def plan_summary(plans: List[TrainingPlan]) -> str:
    """``18 runs: 15 done (skipped), 0 to resume, 3 to train`` (and the runs whose training was
    over, recorded done without an update, when there are any)."""
    count = {action: sum(plan.action == action for plan in plans) for action in ("done", "over", "resume", "train")}
    over = f", {count['over']} over (recorded done)" if count["over"] else ""
    return (f"{len(plans)} runs: {count['done']} done (skipped){over}, {count['resume']} to resume, "
            f"{count['train']} to train")


def train(run: Run, extra: List[str] = (), echo: Callable[[str], None] = print) -> dict:
    """Train (or resume) ``run``; returns its status. Finished and diverged runs are skipped.

    Before fairseq-train starts, the checkpoints a killed job left are checked and the save it
    was killed in is finished (:func:`fairseq_normplug.checkpoint_safety.repair`), and a run
    whose last checkpoint already ended training is recorded as done without another update."""
    status = run.status()
    command = run.train_command(list(extra))
    plan = training_plan(run, command, status, read_last=False)
    changes = plan.changes
    if plan.action == "done":
        echo(f"[{run.label}] {status['status']}: skipped{plan.trained_with(run.run_dir)}")
        return status
    if changes:
        echo(f"[{run.label}] the command has changed since this run started: {'; '.join(changes)}")
    hub.copy_hub_files(run.data_dir, run.path("checkpoints"), run.src, run.tgt, subword_method(run.data_dir))
    for action in checkpoint_safety.repair(run.path("checkpoints")):
        echo(f"[{run.label}] checkpoints: {action}")
    minutes_before = status.get("minutes", 0.0)
    plan = training_plan(run, command, status)  # the checkpoints as repaired
    last, over, max_update = plan.last, plan.over, last_flag_value(command, "--max-update")
    if over:
        echo(f"[{run.label}] training was over ({over}); not resumed")
        return _training_done(run, minutes_before, last.updates,
                              stopped_by(run.path("train.log"), last.updates, max_update) or over)
    if last is None and os.path.exists(run.path("train.log")):
        # nothing to resume from (its checkpoints were lost, e.g. a run folder copied without
        # them): training starts from update 0, so the old log would count twice in its curves
        stale = run.path(f"train.log.no-checkpoint-{time.strftime('%Y%m%d-%H%M%S')}")
        move_into_place(run.path("train.log"), stale)
        echo(f"[{run.label}] no checkpoint to resume from: starting again (old log: {stale})")
        minutes_before = 0.0
    started = time.time()
    run.set_status(status="running", command=portable_paths.to_portable(command, run.roots()))
    echo(f"[{run.label}] training ({'resuming' if last is not None else 'starting'}); "
         f"log: {run.path('train.log')}")
    tail, diverged, uniform = [], None, uniform_guess_bits(run)
    learned = uniform is not None and any(loss < uniform for loss in valid_losses(run.path("train.log")))
    _end_last_line(run.path("train.log"))
    with open(run.path("train.log"), "a", encoding="utf-8", buffering=1) as log:  # line by line: kept on a kill
        if changes:  # the log says so too, where the resumed training starts
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} | INFO | fairseq_normplug.experiments.runner | "
                      f"the command has changed since this run started: {'; '.join(changes)}\n")
        roots = run.roots()
        with run_process(run, "trainer", command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **run.env(), "PYTHONUNBUFFERED": "1"}) as proc:
            for line in proc.stdout:
                log.write(portable_paths.portable_text(line, roots))  # a portable record too (docs/experiments.md)
                tail = (tail + [line])[-200:]
                summary = progress_line(run, line)
                if summary:
                    echo(summary)
                    # the time trained so far survives a kill (a killed job's minutes count too)
                    run.set_status(minutes=round(minutes_before + (time.time() - started) / 60, 2))
                    if diverged is None:
                        record = valid_record(line)
                        diverged = diverged_at(record, uniform, learned)
                        if diverged:  # a result: training it further changes nothing
                            proc.terminate()
                        loss = dev_loss(record)
                        learned = learned or (uniform is not None and loss is not None and loss < uniform)
            returncode = proc.wait()
        if diverged:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} | INFO | fairseq_normplug.experiments.runner | "
                      f"diverged: {diverged}; training stopped\n")
    minutes = minutes_before + (time.time() - started) / 60
    updates = last_num_updates(run.path("train.log"))
    if returncode == 0 and not diverged:
        return _training_done(run, minutes, updates, stopped_by(run.path("train.log"), updates, max_update))
    text = "".join(tail)
    last_line = text.strip().splitlines()[-1][:300] if text.strip() else ""
    marker = next((marker for marker in DIVERGENCE_MARKERS if marker in text), None)
    if diverged is None and marker:
        diverged = DIVERGENCE_MARKERS[marker]
    state = "diverged" if diverged else "failed"
    echo(f"[{run.label}] {state}{': ' + diverged if diverged else ''} (exit {returncode}); "
         f"see {run.path('train.log')}")
    return run.set_status(status=state, minutes=round(minutes, 2), updates=updates, exit_code=returncode,
                          error=last_line if marker or not diverged else diverged,
                          **({"diverged": diverged} if diverged else {}))


def _training_done(run: Run, minutes: float, updates: Optional[int], stopped: Optional[str]) -> dict:
    for interval_checkpoint in glob.glob(run.path("checkpoints", "checkpoint_*_*.pt")):
        os.remove(interval_checkpoint)  # a copy of checkpoint_last.pt or older: keep last and best
    return run.set_status(status="done", minutes=round(minutes, 2), updates=updates, stopped_by=stopped)


def stopped_by(log_path: str, updates: Optional[int], max_update: Optional[str]) -> Optional[str]:
    """Why a finished training ended: the last stopping rule its log names (``--stop-lr``,
    ``--stop-patience``, fairseq's ``--patience``), else ``--max-update N`` when it reached it,
    else None (e.g. ``--max-epoch``, or no log)."""
    reason = logged_stop_reason(log_path)
    if reason:
        return reason
    if updates is not None and max_update and updates >= int(max_update):
        return f"--max-update {max_update}"
    return None


def _end_last_line(path: str) -> None:
    """End a log's last line if a killed job left it unfinished (so appended records parse)."""
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def subword_method(data_dir: str, assumed: Optional[str] = None) -> str:
    """The data folder's subword method (``subword_nmt`` or ``sentencepiece``): the manifest's
    ``subword_method`` field, or for manifests written before it existed their ``recipe.bpe``.
    It is also fairseq's post-processing name (--remove-bpe, --eval-bleu-remove-bpe).
    ``assumed`` is returned for a folder not prepared yet (``--print-commands`` before the data)."""
    manifest = read_json(os.path.join(data_dir, "manifest.json"))
    if manifest is None and assumed is not None:
        return assumed
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
            *test_decoding_flags(run.recipe.decoding, subword_method(run.data_dir, run.assumed_subword)),
            *run.recipe.generate, *ALL_BATCHES, *run.device_flags()]


def evaluate(run: Run, echo: Callable[[str], None] = print) -> Optional[dict]:
    """Translate the test set with the best checkpoint and score it; None if not trained.
    ``generate-test.txt`` and ``scores.json`` appear complete or not at all; a killed
    decoding's temporary output is deleted and decoding starts again."""
    scores_path = run.path("scores.json")
    if read_scores(scores_path) is not None:
        return read_scores(scores_path)
    checkpoint = run.path("checkpoints", "checkpoint_best.pt")
    if run.status()["status"] != "done" or not os.path.exists(checkpoint):
        return None
    if checkpoint_safety.read_checkpoint(checkpoint) is None:
        raise NormplugError(f"{checkpoint} is incomplete (the disk filled up or it was copied in part); "
                            f"train {run.label} again from scratch: delete {run.run_dir}")
    output = run.path("generate-test.txt")
    for leftover in glob.glob(f"{output}.tmp-*"):  # a killed decoding's partial output
        os.remove(leftover)
    tmp = f"{output}.tmp-{os.getpid()}"
    command = generate_command(run, checkpoint)
    echo(f"[{run.label}] translating the test set")
    with open(tmp, "w", encoding="utf-8") as out:
        with run_process(run, "decoder", command, stdout=out, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **run.env()}) as proc:
            _, errors = proc.communicate()
    if proc.returncode != 0:
        os.remove(tmp)
        last = errors.strip().splitlines()[-1] if errors.strip() else f"exit {proc.returncode}"
        raise NormplugError(f"fairseq-generate failed for {run.label}: {last}")
    move_into_place(tmp, output)
    scores = {**score_generation(output, run.data_dir, run.tgt), **selected_checkpoint(checkpoint)}
    write_json_atomic(scores_path, scores)
    echo(f"[{run.label}] update {scores['selected_update']} (dev BLEU {scores['dev_bleu']}): test BLEU "
         f"{scores['tokenized_bleu']:.2f} (tokenized), sacreBLEU {scores['sacrebleu']:.2f}, chrF {scores['chrf']:.2f}")
    return scores


def test_references(data_dir: str, tgt: str):
    """(tokenized references, detokenized references or None) of a prepared data folder."""
    refs_tok = bleu.read_lines(os.path.join(data_dir, "ref", f"test.tok.{tgt}"))
    detok_path = os.path.join(data_dir, "ref", f"test.detok.{tgt}")
    return refs_tok, bleu.read_lines(detok_path) if os.path.exists(detok_path) else None


def test_hypotheses(run: "Run", expected: int) -> List[str]:
    return bleu.read_fairseq_generate(run.path("generate-test.txt"), expected=expected).hypotheses


def score_generation(generate_output: str, data_dir: str, tgt: str) -> dict:
    """Tokenized BLEU (the paper's), detokenized sacreBLEU and chrF/chrF++ with signatures and,
    for German targets, the WMT recipe's compound-split BLEU."""
    refs_tok, refs_detok = test_references(data_dir, tgt)
    hyps = bleu.read_fairseq_generate(generate_output, expected=len(refs_tok)).hypotheses
    return bleu.score_translation(hyps, refs_tok, lang=tgt, detok_refs=refs_detok,
                                  compound_split=tgt == "de")
