"""Where and how the runs of a table are executed (``scripts/reproduce.sh --launcher``).

Every launcher executes the same function per run, :func:`execute_run`: take the run folder
(its one owner, :mod:`.ownership`: a run another live launcher holds is left to it and tried
again later), train (resume, or skip a finished run), then evaluate; the run's fairseq
processes get its environment
(:meth:`Run.env`: ``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``). So a run on this machine and a
run in a SLURM job run exactly the same code.

* :class:`LocalLauncher` (``--launcher local``, the default): this machine. ``--jobs 1`` runs
  the runs one after another. ``--jobs N`` runs N at once (one thread each, driving
  the run's fairseq processes), each with its own slot of ``--devices-per-run K`` GPUs
  (``CUDA_VISIBLE_DEVICES``, :func:`device_slots`) and ``--cpus-per-run`` threads (default:
  the cores divided by N, so that N runs never oversubscribe the CPU). Their console lines,
  one per validation, carry each run's label. SIGTERM, SIGINT and SIGHUP stop it cleanly: they
  are forwarded to the runs' fairseq-train and fairseq-generate, which it waits for before it
  releases their runs and stops (:func:`runner.stop_signals_forwarded`); the next launcher
  resumes them.
* :class:`SlurmLauncher` (``--launcher slurm``): one SLURM job per run through ``submitit``
  (an optional dependency: ``pip install .[slurm]``), as a job array. A job that reaches its
  time limit or is preempted is requeued by submitit (:class:`RunJob`'s ``checkpoint``) and
  its run resumes from ``checkpoint_last.pt``.
"""
import collections
import contextlib
import dataclasses
import errno
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.ownership import RunOwnership, live_holder
from fairseq_normplug.experiments.preflight import check_table
from fairseq_normplug.experiments.processes import LauncherStopped, stop_requested, stop_signals_forwarded
from fairseq_normplug.experiments.run_records import read_scores, record_problem
from fairseq_normplug.experiments.runs import Run
from fairseq_normplug.experiments.scoring import evaluate
from fairseq_normplug.experiments.training import train
from fairseq_normplug.experiments.slurm_launcher import (  # noqa: F401 (launchers.SlurmLauncher, ...)
    PREFLIGHT_TIME_MIN, SUBMITIT_MISSING, RunJob, SlurmLauncher, descendants, import_submitit, parse_sbatch,
    stop_descendants,
)

Echo = Callable[[str], None]
LAUNCHERS = ("local", "slurm")
#: seconds between two tries of runs that other launchers hold, when nothing else is left
HELD_POLL_S = float(os.environ.get("NORMPLUG_HELD_POLL", "10"))


def execute_run(run: Run, extra_train: Sequence[str] = (), echo: Echo = print) -> dict:
    """Train then evaluate ``run`` (what every launcher executes per run) as its only owner
    (:mod:`.ownership`); returns its status, with ``held_by`` (and nothing done) when another
    live launcher owns it. An error of this run is reported and recorded, never raised, so the
    other runs go on."""
    try:
        os.makedirs(run.run_dir, exist_ok=True)
        owner = RunOwnership(run.run_dir)
        holder = owner.acquire()
    except OSError as error:
        echo(f"[{run.label}] error: cannot take the run folder: {error}")
        return {**run.status(), "run_error": str(error)}
    if holder is not None:
        return {**run.status(), "held_by": holder.describe()}
    if owner.took_over:
        previous, why = owner.took_over
        echo(f"[{run.label}] took the run over from {previous.describe()}: {why}")
    try:
        return _train_and_evaluate(run, list(extra_train), echo)
    finally:
        owner.release()


def _train_and_evaluate(run: Run, extra: List[str], echo: Echo) -> dict:
    try:
        if run.status()["status"] not in ("done", "diverged"):
            where = f" on CUDA_VISIBLE_DEVICES={run.devices}" if run.devices is not None else ""
            threads = f", {run.threads} thread{'s' if run.threads != 1 else ''}" if run.threads else ""
            echo(f"[{run.label}] {run.batching(extra).describe()}{where}{threads}")
        train(run, extra, echo=echo)
        evaluate(run, echo=echo)
        if run.status().get("run_error"):
            run.set_status(run_error=None)
    except Exception as error:  # noqa: BLE001 - one run's failure must not stop the table
        message = error_line(error)
        echo(f"[{run.label}] error: {message}")
        try:
            run.set_status(run_error=message[:300])
        except OSError as write_error:  # a full disk or a read-only folder: said, not raised,
            echo(f"[{run.label}] error: cannot record it in {run.path('status.json')}: {error_line(write_error)}")
            return {**run.status(), "run_error": message[:300]}  # and kept for the summary
    return run.status()


def error_line(error: BaseException) -> str:
    """One line for an error of a run: a NormplugError's text, else its type and text, with the
    errno's name for an OSError (``OSError ENOSPC: [Errno 28] No space left on device: ...``)."""
    if isinstance(error, NormplugError):
        return str(error)
    name = errno.errorcode.get(error.errno, "") if isinstance(error, OSError) and error.errno else ""
    return f"{type(error).__name__}{' ' + name if name else ''}: {error}"


def held(result) -> Optional[str]:
    """Who holds a run, from :func:`execute_run`'s result; None when it was executed."""
    return result.get("held_by") if isinstance(result, dict) else None


def visible_gpus() -> List[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them."""
    count = torch.cuda.device_count()
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


def device_slots(jobs: int, devices_per_run: Optional[int], visible: Sequence[str]) -> List[Optional[str]]:
    """``CUDA_VISIBLE_DEVICES`` of each of the ``jobs`` concurrent runs: disjoint groups of
    ``devices_per_run`` of the ``visible`` GPUs (default: the GPUs divided by ``jobs``). None
    means inherited: on CPU, or one job without ``devices_per_run`` (every visible GPU)."""
    if jobs < 1:
        raise NormplugError(f"--jobs must be at least 1, got {jobs}")
    if devices_per_run is not None and devices_per_run < 1:
        raise NormplugError(f"--devices-per-run must be at least 1, got {devices_per_run}")
    if not visible:
        if devices_per_run is not None:
            raise NormplugError(f"--devices-per-run {devices_per_run}: no GPU is visible here; on CPU leave it "
                                f"out (parallel runs share the cores: --cpus-per-run)")
        return [None] * jobs
    if devices_per_run is None:
        if jobs == 1:
            return [None]
        devices_per_run = len(visible) // jobs
        if devices_per_run == 0:
            raise NormplugError(f"--jobs {jobs} needs at least {jobs} GPUs, {len(visible)} visible "
                                f"({','.join(visible)}); use --jobs {len(visible)} or fewer")
    if jobs * devices_per_run > len(visible):
        raise NormplugError(f"--jobs {jobs} x --devices-per-run {devices_per_run} = {jobs * devices_per_run} GPUs, "
                            f"but {len(visible)} are visible ({','.join(visible)}); lower --jobs or --devices-per-run")
    return [",".join(visible[i * devices_per_run:(i + 1) * devices_per_run]) for i in range(jobs)]


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class LocalLauncher:
    """Runs on this machine, ``jobs`` at once (see the module docstring).

    ``visible_devices``, ``cores`` and ``execute`` default to this machine's GPUs, its cores
    and :func:`execute_run`; tests pass others."""

    name = "local"

    def __init__(self, jobs: int = 1, devices_per_run: Optional[int] = None, cpus_per_run: Optional[int] = None,
                 visible_devices: Optional[Sequence[str]] = None, cores: Optional[int] = None,
                 execute: Optional[Callable[[Run, Sequence[str], Echo], object]] = None):
        self.jobs = jobs
        self.slots = device_slots(jobs, devices_per_run, visible_gpus() if visible_devices is None else visible_devices)
        if cpus_per_run is not None and cpus_per_run < 1:
            raise NormplugError(f"--cpus-per-run must be at least 1, got {cpus_per_run}")
        self.threads = cpus_per_run if cpus_per_run is not None else (
            max(1, (cores or available_cores()) // jobs) if jobs > 1 else None)
        self.execute_one = execute or execute_run
        self.logs: Dict[str, str] = {}
        #: {run folder: the error of its last execution}, also when its status.json could not record it
        self.errors: Dict[str, str] = {}

    @property
    def num_devices(self) -> Optional[int]:
        return None if self.slots[0] is None else len(self.slots[0].split(","))

    def prepare(self, runs: List[Run]) -> List[Run]:
        """The runs with their device count and threads (their slot is chosen when they start)."""
        return [dataclasses.replace(run, num_devices=self.num_devices, threads=self.threads,
                                    devices=self.slots[0] if self.jobs == 1 else run.devices) for run in runs]

    def describe_devices(self, run: Run) -> str:
        threads = f", {run.threads} thread{'s' if run.threads != 1 else ''}" if run.threads else ""
        if self.slots[0] is None:
            gpus = torch.cuda.device_count()
            return (f"every visible GPU ({gpus}){threads}" if gpus else f"cpu{threads}")
        count = self.num_devices
        where = (f"CUDA_VISIBLE_DEVICES={self.slots[0]}" if len(self.slots) == 1 else
                 f"CUDA_VISIBLE_DEVICES = the first free of {' | '.join(self.slots)}")
        return f"{count} GPU{'s' if count != 1 else ''} ({where}){threads}"

    def env_prefix(self, run: Run) -> Dict[str, str]:
        env = run.env()
        if len(self.slots) > 1 and self.slots[0] is not None:
            env["CUDA_VISIBLE_DEVICES"] = "<free slot>"
        return env

    def preflight(self, runs: List[Run], extra_train: Sequence[str], runs_dir: str, results_dir: str,
                  echo: Echo) -> dict:
        """The table's preflight (experiments/preflight.py), here."""
        return check_table(runs, extra_train, runs_dir, results_dir, echo=echo)

    def execute(self, runs: List[Run], extra_train: Sequence[str], echo: Echo) -> None:
        """Execute every run, ``jobs`` at once. A run another launcher holds is put back at the
        end of the queue, and tried again until it is done there (then skipped) or its owner is
        dead (then taken over); when only held runs are left, every :data:`HELD_POLL_S` seconds."""
        pending = collections.deque(enumerate(runs, 1))
        waiting = set()  # indices of runs found held, until they are executed
        lock = threading.Lock()

        def say(message: str) -> None:
            with lock:
                echo(message)

        def worker(slot: Optional[str]) -> None:
            while True:
                with lock:
                    if not pending or stop_requested() is not None:
                        return
                    index, run = pending.popleft()
                    only_held_left = index in waiting and all(i in waiting for i, _ in pending)
                if only_held_left:
                    time.sleep(HELD_POLL_S)
                if self.jobs > 1:
                    run = dataclasses.replace(run, devices=slot)
                if index not in waiting:
                    say(f"[reproduce] run {index}/{len(runs)}: {run.label}"
                        + (f" (CUDA_VISIBLE_DEVICES={slot})" if slot is not None and self.jobs > 1 else ""))
                result = self.execute_one(run, extra_train, say)
                holder = held(result)
                if isinstance(result, dict) and result.get("run_error"):
                    self.errors[run.run_dir] = result["run_error"]
                elif holder is None:
                    self.errors.pop(run.run_dir, None)
                with lock:
                    if holder is not None:
                        if index not in waiting:
                            echo(f"[{run.label}] held by {holder}: it trains there; this launcher comes back "
                                 f"to it (and takes it over if that owner dies)")
                        waiting.add(index)
                        pending.append((index, run))
                    else:
                        waiting.discard(index)

        def stoppable_worker(slot: Optional[str], done: threading.Event) -> None:
            try:
                with contextlib.suppress(LauncherStopped):  # the main thread raises it
                    worker(slot)
            finally:
                done.set()

        with stop_signals_forwarded():
            if self.jobs == 1:
                worker(self.slots[0])
                return
            # the main thread waits on events, not Thread.join: a join interrupted by the stop
            # signal's exception takes a running thread for stopped (CPython 3.11)
            finished = [threading.Event() for _ in self.slots]
            for slot, done in zip(self.slots, finished):
                threading.Thread(target=stoppable_worker, args=(slot, done), daemon=True).start()
            try:
                while not all(done.is_set() for done in finished):
                    for done in finished:
                        done.wait(0.2)
            except LauncherStopped:  # the workers' runs end with their processes; then each is released
                for done in finished:
                    done.wait()
                raise


def failure_of(run: Run) -> Optional[str]:
    """Why ``run`` failed, or None if it is a result (tested, or diverged)."""
    status = run.status()
    state = status["status"]
    if state == "diverged":
        return None
    holder = live_holder(run.run_dir)
    if holder is not None:
        return f"still {state if state != 'pending' else 'starting'} under another launcher ({holder.describe()})"
    if state == "done":
        if read_scores(run.path("scores.json")) is not None:
            return None
        error = status.get("run_error") or record_problem(run.path("scores.json"))
        return f"trained, not evaluated{': ' + error if error else ''}"
    if state == "failed":
        error = f": {status['error']}" if status.get("error") else ""
        return f"training failed (exit {status.get('exit_code')}){error}"
    if state == "running":
        return "interrupted while training (its process ended without a result)"
    bad_status = record_problem(run.path("status.json"))
    if bad_status:
        return f"its record is bad: {bad_status} (a re-run resumes it from its checkpoints)"
    error = status.get("run_error")
    return f"not trained{': ' + error if error else ''}"
