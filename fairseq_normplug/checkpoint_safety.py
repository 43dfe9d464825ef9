"""The checkpoints a killed fairseq-train leaves behind: which to trust, and how to finish the
save it was killed in, so that a re-run continues from the last complete checkpoint.

How fairseq 0.12 saves (``checkpoint_utils.save_checkpoint``): one save writes several files
with the same content, in this order: ``checkpointE.pt`` (epoch ends, unless
``--no-epoch-checkpoints``), ``checkpoint_E_U.pt`` (every ``--save-interval-updates``),
``checkpoint_best.pt`` (when the validation is at least as good as the best so far),
``checkpoint.best_*.pt`` (``--keep-best-checkpoints``), ``checkpoint_last.pt``. Only the
first is written atomically (``NAME.pt.tmp``, then a rename); the others are plain
``shutil.copyfile`` copies of it. A job killed during a save therefore leaves

* while the first file is written: a ``NAME.pt.tmp`` (harmless; fairseq never reads it);
* during a copy: a truncated ``checkpoint_best.pt`` or ``checkpoint_last.pt``. fairseq-train
  fails on a truncated ``checkpoint_last.pt`` at every re-run; a truncated
  ``checkpoint_best.pt`` fails only the test decoding;
* between two copies: a ``checkpoint_best.pt`` newer than ``checkpoint_last.pt``.

:func:`repair` (run by the experiment runner before it starts or resumes fairseq-train):
deletes every checkpoint file that is not complete, then finishes the interrupted save from
its complete first file, the newest checkpoint in the folder: it becomes
``checkpoint_last.pt``, and ``checkpoint_best.pt`` as well when its own validation was the
best (fairseq's rule: its ``val_loss`` equals the ``best`` it saved). Both copies are atomic.
The folder is then what the uninterrupted save would have left, and fairseq-train resumes
from it. A checkpoint counts as complete when its zip archive (torch's format) is whole and
it unpickles with a model and an optimizer history; the tensors are not read (``mmap``).

:func:`finished` tells a run whose training had already ended (``--max-update`` reached, or
the lr below ``--stop-lr`` or ``--stop-patience`` exhausted, our schedulers' rules): fairseq-train resumed from such a checkpoint
would train one update more before it checks, and overwrite the final checkpoints.

For your own fairseq-train commands, before re-launching one::

    python -m fairseq_normplug.checkpoint_safety SAVE_DIR [--max-update N]

repairs SAVE_DIR, prints what it did, and exits with status 3 when training is already over
(do not re-launch it then).
"""
import argparse
import glob
import os
import sys
import zipfile
from dataclasses import dataclass
from typing import List, Optional

from fairseq_normplug.atomic_files import copy_atomic
from fairseq_normplug.checkpoint_compat import UntrustedCheckpoint, safe_load
from fairseq_normplug.optim.lr_scheduler.common import patience_exhausted

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
#: lr schedulers with ``--stop-lr`` and ``--stop-patience`` (fairseq_normplug.optim): they stop once
#: the next lr is below the floor, or the validations in their state have stalled
STOP_LR_SCHEDULERS = ("inv_sqrt_decay", "val_decay")


@dataclass
class CheckpointInfo:
    """What the runner needs to know of one complete checkpoint file."""
    path: str
    updates: int
    val_loss: Optional[float]  # the validation metric of its save (None: saved without one)
    best: Optional[float]  # the best validation metric so far, as saved
    next_lr: Optional[float]  # the lr of the next update
    scheduler: dict  # its --lr-scheduler config
    scheduler_state: dict  # the scheduler's state_dict (e.g. our schedulers' validation history)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def was_best(self) -> bool:
        """fairseq wrote this save to checkpoint_best.pt (its validation was the best so far)."""
        return self.val_loss is not None and self.val_loss == self.best


def _whole_zip(path: str) -> bool:
    """The zip's central directory (written last) is there and every member lies in the file."""
    try:
        size = os.path.getsize(path)
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return bool(members) and all(m.header_offset + m.compress_size <= size for m in members)


def read_checkpoint(path: str) -> Optional[CheckpointInfo]:
    """The checkpoint's :class:`CheckpointInfo`, or None when the file is missing or not
    complete. An error of the file system itself (permissions, a lost mount) is raised: it says
    nothing about the file."""
    if not os.path.isfile(path):
        return None
    try:  # a whole zip needs no tensor read; anything else is loaded in full (old formats) or fails
        state = safe_load(path, mmap=_whole_zip(path))
        updates = int(state["optimizer_history"][-1]["num_updates"])
        if "model" not in state:
            return None
    except (OSError, UntrustedCheckpoint):  # the file system's own error; whole, but a refused class
        raise
    except Exception:  # a cut or damaged archive or pickle: not a checkpoint to trust
        return None
    extra = state.get("extra_state") or {}
    groups = (state.get("last_optimizer_state") or {}).get("param_groups") or [{}]
    cfg = state.get("cfg") or {}
    scheduler = cfg.get("lr_scheduler") if isinstance(cfg, dict) else None
    scheduler_state = state["optimizer_history"][-1].get("lr_scheduler_state") or {}
    return CheckpointInfo(path=path, updates=updates, val_loss=extra.get("val_loss"), best=extra.get("best"),
                          next_lr=groups[0].get("lr"), scheduler=dict(scheduler or {}),
                          scheduler_state=dict(scheduler_state))


def repair(save_dir: str) -> List[str]:
    """Make ``save_dir`` safe to resume from (see the module docstring); returns one line per
    file removed or written."""
    actions = []
    for leftover in glob.glob(os.path.join(save_dir, "*.pt.tmp")):  # fairseq's unfinished atomic write
        os.remove(leftover)
        actions.append(f"removed the unfinished write {os.path.basename(leftover)}")
    complete = {}
    for path in sorted(glob.glob(os.path.join(save_dir, "checkpoint*.pt"))):
        info = read_checkpoint(path)
        if info is None:
            os.remove(path)
            actions.append(f"removed the incomplete {os.path.basename(path)}")
        else:
            complete[info.name] = info
    if not complete:
        return actions
    newest = max(complete.values(), key=lambda info: (info.updates, info.name == LAST))
    last = complete.get(LAST)
    if last is not None and last.updates >= newest.updates:
        return actions
    # fairseq was killed while copying the save of update ``newest.updates``: finish it
    copy_atomic(newest.path, os.path.join(save_dir, LAST))
    actions.append(f"{LAST} <- {newest.name} (update {newest.updates}; the save was interrupted)")
    best = complete.get(BEST)
    if newest.was_best and newest.name != BEST and (best is None or best.updates != newest.updates):
        copy_atomic(newest.path, os.path.join(save_dir, BEST))
        actions.append(f"{BEST} <- {newest.name} (its validation was the best)")
    return actions


def finished(info: Optional[CheckpointInfo], max_update: Optional[int], stop_patience: Optional[int] = None,
             stop_lr: Optional[float] = None) -> Optional[str]:
    """Why training from ``info`` (checkpoint_last.pt) is already over, or None: ``max_update``
    reached, or after warmup the next lr below the ``--stop-lr`` of our schedulers or their
    ``--stop-patience`` exhausted (their own rules, fairseq_normplug.optim.lr_scheduler.common).
    ``stop_patience`` and ``stop_lr``: the values of the command that would resume the run, which
    are the ones fairseq-train applies (None: those the checkpoint was trained with). A run
    stopped by ``--stop-patience 3`` is not over for ``--stop-patience 5``: resumed, it goes on
    exactly as if it had been trained with 5 from the start (the rule only decides when to stop)."""
    if info is None:
        return None
    if max_update and info.updates >= max_update:
        return f"update {info.updates} >= --max-update {max_update}"
    scheduler = info.scheduler
    if scheduler.get("_name") not in STOP_LR_SCHEDULERS:
        return None
    warmup = int(scheduler.get("warmup_updates") or 0)
    if info.updates < warmup:
        return None
    stop_lr = float(scheduler.get("stop_lr") or 0) if stop_lr is None else float(stop_lr)
    if stop_lr > 0 and info.next_lr is not None and info.next_lr < stop_lr:
        return f"lr {info.next_lr:.3g} < --stop-lr {stop_lr:g} after update {info.updates}"
    state = info.scheduler_state
    patience = int(scheduler.get("stop_patience") or 0) if stop_patience is None else int(stop_patience)
    stalled = patience_exhausted(state.get("history") or [], patience, warmup, bool(state.get("maximize", False)))
    return f"{stalled} after update {info.updates}" if stalled else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fairseq_normplug.checkpoint_safety",
                                     description="Repair a fairseq --save-dir a killed job left; exit 3 when "
                                                 "its training is already over.")
    parser.add_argument("save_dir", help="fairseq-train's --save-dir")
    parser.add_argument("--max-update", type=int, help="the run's --max-update (to tell a finished run)")
    parser.add_argument("--stop-patience", type=int, help="the run's --stop-patience (default: the checkpoint's)")
    parser.add_argument("--stop-lr", type=float, help="the run's --stop-lr (default: the checkpoint's)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.save_dir):
        parser.error(f"no such folder: {args.save_dir}")
    for action in repair(args.save_dir):
        print(action)
    last = read_checkpoint(os.path.join(args.save_dir, LAST))
    print(f"{LAST}: " + (f"update {last.updates}" if last else "none (fairseq-train starts from scratch)"))
    over = finished(last, args.max_update, args.stop_patience, args.stop_lr)
    if over:
        print(f"training is over: {over}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
