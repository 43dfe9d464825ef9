"""Where and how the runs of a table are executed (``scripts/reproduce.sh --launcher``).

Every launcher executes the same function per run, :func:`execute_run`: take the run folder
(its one owner, :mod:`.ownership`: a run another live launcher holds is left to it and tried
again later), train (resume, or skip a finished run), then evaluate; the run's fairseq
processes get its environment
(:meth:`Run.env`: ``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``). So a run on this machine and a
run in a SLURM job run exactly the same code.

* :class:`LocalLauncher` (``--launcher local``, the default): this machine. ``--jobs 1`` runs
  the runs one after another, as before. ``--jobs N`` runs N at once (one thread each, driving
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
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.ownership import RunOwnership, live_holder, zombie
from fairseq_normplug.experiments.preflight import check_table
from fairseq_normplug.experiments.runner import (LauncherStopped, Run, evaluate, read_scores, record_problem,
                                                 stop_requested, stop_signals_forwarded, train)

Echo = Callable[[str], None]
LAUNCHERS = ("local", "slurm")
SUBMITIT_MISSING = "--launcher slurm needs submitit, an optional dependency: pip install .[slurm]"
#: time limit (minutes) of the preflight job of --launcher slurm
PREFLIGHT_TIME_MIN = 60
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


def descendants(pid: int) -> List[int]:
    """Process ids of every descendant of ``pid`` (Linux /proc), children first."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def stop_descendants(grace_s: float = 60.0) -> None:
    """SIGTERM this process's descendants (fairseq-train/-generate), then SIGKILL those that
    are still there after ``grace_s`` seconds."""
    pids = descendants(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class RunJob:
    """The callable a SLURM job executes: :func:`execute_run`. On a time limit or preemption
    submitit calls :meth:`checkpoint`: the run's fairseq processes are stopped and the same
    call is requeued; the requeued job resumes the run from its last checkpoint (submitit's
    ``Checkpointable`` protocol, without importing submitit here)."""

    def __call__(self, run: Run, extra_train: Sequence[str]) -> dict:
        result = execute_run(run, extra_train, echo=lambda message: print(message, flush=True))
        if held(result):
            print(f"[{run.label}] held by {held(result)}: it trains there, not in this job", flush=True)
        return result

    def checkpoint(self, run: Run, extra_train: Sequence[str]):
        from submitit.helpers import DelayedSubmission

        print(f"[{run.label}] time limit or preemption: stopping, to resume from the last checkpoint", flush=True)
        stop_descendants()
        return DelayedSubmission(self, run, extra_train)


def import_submitit():
    try:
        import submitit
    except ImportError:
        raise NormplugError(SUBMITIT_MISSING) from None
    return submitit


def parse_sbatch(values: Sequence[str]) -> Dict[str, object]:
    """``--sbatch KEY=VALUE`` (or ``--sbatch KEY`` for an option without value) options ->
    submitit's ``slurm_additional_parameters``."""
    out: Dict[str, object] = {}
    for value in values:
        key, sep, setting = value.partition("=")
        key = key.strip().lstrip("-")
        if not key or (sep and not setting):
            raise NormplugError(f"--sbatch takes KEY=VALUE or KEY (an sbatch option without its dashes, e.g. "
                                f"qos=high or exclusive), got {value!r}")
        out[key] = setting if sep else True
    return out


class SlurmLauncher:
    """One SLURM job per run through submitit (see the module docstring). ``cluster`` is
    submitit's: ``slurm``, or ``local`` to run the same jobs here without a scheduler."""

    name = "slurm"

    def __init__(self, folder: str, partition: Optional[str] = None, time_limit_min: int = 1440,
                 gpus_per_run: int = 1, cpus_per_run: Optional[int] = None, mem: Optional[str] = None,
                 account: Optional[str] = None, sbatch: Optional[Dict[str, object]] = None, jobs: Optional[int] = None,
                 max_requeues: int = 10, cluster: str = "slurm"):
        for name, value, least in (("--time-limit", time_limit_min, 1), ("--devices-per-run", gpus_per_run, 0),
                                   ("--cpus-per-run", cpus_per_run, 1), ("--jobs", jobs, 1),
                                   ("--max-requeues", max_requeues, 0)):
            if value is not None and value < least:
                raise NormplugError(f"{name} must be at least {least}, got {value}")
        self.folder, self.cluster = folder, cluster
        self.partition, self.time_limit_min, self.gpus_per_run = partition, time_limit_min, gpus_per_run
        self.cpus_per_run, self.mem, self.account = cpus_per_run, mem, account
        self.sbatch, self.jobs, self.max_requeues = dict(sbatch or {}), jobs, max_requeues
        self.logs: Dict[str, str] = {}  # run folder -> the log of its failed job
        self.submitted: Dict[str, object] = {}  # run folder -> submitit job

    def prepare(self, runs: List[Run]) -> List[Run]:
        return [dataclasses.replace(run, num_devices=self.gpus_per_run or None, threads=self.cpus_per_run)
                for run in runs]

    def describe_devices(self, run: Run) -> str:
        threads = f", {run.threads} thread{'s' if run.threads != 1 else ''}" if run.threads else ""
        if not self.gpus_per_run:
            return f"cpu (a SLURM job){threads}"
        return f"{self.gpus_per_run} GPU{'s' if self.gpus_per_run != 1 else ''} (a SLURM job's){threads}"

    def env_prefix(self, run: Run) -> Dict[str, str]:
        return run.env()

    def parameters(self) -> dict:
        """submitit's executor parameters (AutoExecutor names)."""
        params = {"name": "normplug", "timeout_min": self.time_limit_min, "nodes": 1, "tasks_per_node": 1,
                  "gpus_per_node": self.gpus_per_run, "slurm_additional_parameters": dict(self.sbatch)}
        for key, value in (("cpus_per_task", self.cpus_per_run), ("slurm_partition", self.partition),
                           ("slurm_mem", self.mem), ("slurm_account", self.account),
                           ("slurm_array_parallelism", self.jobs)):
            if value is not None:
                params[key] = value
        return params

    def describe_submission(self) -> str:
        """The sbatch options each job gets, as sbatch spells them."""
        options = [f"--time={self.time_limit_min}", "--nodes=1", "--ntasks-per-node=1"]
        if self.gpus_per_run:
            options.append(f"--gpus-per-node={self.gpus_per_run}")
        for flag, value in (("cpus-per-task", self.cpus_per_run), ("partition", self.partition),
                            ("mem", self.mem), ("account", self.account)):
            if value is not None:
                options.append(f"--{flag}={value}")
        options += [f"--{key}" if value is True else f"--{key}={value}" for key, value in self.sbatch.items()]
        limit = f", at most {self.jobs} at once" if self.jobs else ""
        return (f"one job per run as a job array{limit}: sbatch {' '.join(options)}; requeued on preemption, "
                f"and up to {self.max_requeues} times on reaching the time limit; logs in {self.folder}")

    def _executor(self, **parameters):
        submitit = import_submitit()
        executor = submitit.AutoExecutor(folder=os.path.join(self.folder, "%j"), cluster=self.cluster,
                                         slurm_max_num_timeout=self.max_requeues)
        executor.update_parameters(**{**self.parameters(), **parameters})
        return submitit, executor

    def preflight(self, runs: List[Run], extra_train: Sequence[str], runs_dir: str, results_dir: str,
                  echo: Echo) -> dict:
        """The table's preflight as one short job on a node like the runs' (at most
        :data:`PREFLIGHT_TIME_MIN` minutes); its report, also echoed here."""
        _, executor = self._executor(name="normplug-preflight",
                                     timeout_min=min(self.time_limit_min, PREFLIGHT_TIME_MIN))
        job = executor.submit(check_table, runs, list(extra_train), runs_dir, results_dir)
        echo(f"[preflight] job {job.job_id}: log {job.paths.stdout}; waiting for it")
        try:
            report = job.result()
        except Exception as error:  # noqa: BLE001 - the job itself failed: one line, and no submission
            last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            return {"problems": [f"the preflight job {job.job_id} failed: {last[:300]}; log: {job.paths.stderr}"]}
        for line in report["problems"]:
            echo(f"[preflight] PROBLEM: {line}")
        for config in report["configurations"]:
            tokens = config["tokens_per_second"]
            echo(f"[preflight] {config['label']}: {'?' if tokens is None else f'{tokens:,.0f}'} target tokens/s, "
                 f"peak {config['memory_kind']} memory {config['peak_memory_gb']:.2f} GB")
        echo(f"[preflight] at most {report['hours']:.2f} hours of training one after another; "
             f"{len(report['problems'])} problem(s)")
        return report

    def execute(self, runs: List[Run], extra_train: Sequence[str], echo: Echo) -> None:
        submitit, executor = self._executor()
        with executor.batch():
            jobs = [executor.submit(RunJob(), run, list(extra_train)) for run in runs]
        by_id = {}
        for run, job in zip(runs, jobs):
            by_id[job.job_id] = run
            self.submitted[run.run_dir] = job
            echo(f"[{run.label}] job {job.job_id}: log {job.paths.stdout}")
        echo(f"[reproduce] {len(jobs)} jobs submitted; waiting for them to end (Ctrl-C leaves them running; "
             f"--status shows their progress, --collect writes the table)")
        for job in submitit.helpers.as_completed(jobs, poll_frequency=1 if self.cluster == "local" else 30):
            run = by_id[job.job_id]
            try:
                status = job.result()
                echo(f"[{run.label}] job {job.job_id} ended: {status.get('status')}")
            except Exception as error:  # noqa: BLE001 - the job's failure is reported, the others go on
                last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                echo(f"[{run.label}] job {job.job_id} failed: {last[:300]}")
                self.logs[run.run_dir] = str(job.paths.stderr)


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
