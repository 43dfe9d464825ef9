"""Training a run: the plan (skip, record as over, resume or train), fairseq-train with its log
kept line by line, the divergence rule on every validation, and why training stopped."""
import glob
import math
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from fairseq_normplug import checkpoint_safety, hub
from fairseq_normplug.atomic_files import move_into_place
from fairseq_normplug.experiments import portable_paths
from fairseq_normplug.experiments.processes import run_process
from fairseq_normplug.experiments.run_commands import changed_flags, subword_method
from fairseq_normplug.experiments.runs import Run
from fairseq_normplug.experiments.training_log import (
    dev_loss, last_num_updates, logged_stop_reason, valid_losses, valid_record,
)
from fairseq_normplug.flag_lists import last_flag_value
from fairseq_normplug.optim.lr_scheduler.common import PAPER_STOP_LR


#: what fairseq-train prints when a run diverges, and what it means (its last failing line)
DIVERGENCE_MARKERS = {
    "FloatingPointError": "NaN or inf in the loss or gradients",
    "gradients are Nan/Inf": "NaN or inf in the gradients",
    "Minimum loss scale reached": "the fp16 loss scale fell to its minimum (overflow at every update)",
    "KeyError: 'bleu'": "no dev BLEU could be computed (every dev translation was empty)",
}
#: a dev loss over this many times a uniform guess's (log2 |V| bits per token) is a divergence
#: at any validation; an untrained model's first validations may be somewhat above log2 |V|
#: (a tiny model at update 3: 7.65 bits against 6.32), a diverged one is far above (98-130 bits)
DIVERGENCE_FACTOR = 2.0


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
