"""``--launcher slurm``: the preflight as one job, then every run as a SLURM job of its own
through submitit; a job that reaches its time limit or is preempted stops its fairseq processes
and is requeued (:class:`RunJob`'s ``checkpoint``), to resume from the run's last checkpoint."""
import contextlib
import dataclasses
import os
import signal
import time
from typing import Dict, List, Optional, Sequence

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.ownership import zombie
from fairseq_normplug.experiments.preflight import Echo, check_table
from fairseq_normplug.experiments.runs import Run

SUBMITIT_MISSING = "--launcher slurm needs submitit, an optional dependency: pip install .[slurm]"
#: time limit (minutes) of the preflight job of --launcher slurm
PREFLIGHT_TIME_MIN = 60


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
        from fairseq_normplug.experiments import launchers  # it imports this module

        result = launchers.execute_run(run, extra_train, echo=lambda message: print(message, flush=True))
        if launchers.held(result):
            print(f"[{run.label}] held by {launchers.held(result)}: it trains there, not in this job", flush=True)
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
