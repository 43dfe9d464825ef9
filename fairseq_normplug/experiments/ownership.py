"""One owner per run: a lock file in the run folder, safe across processes and across the nodes
of a shared filesystem.

``RUN_DIR/owner.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local filesystems and
on NFSv3+), and holds its owner as JSON: ``host``, ``pid``, ``slurm_job`` (``$SLURM_ARRAY_JOB_ID
_$SLURM_ARRAY_TASK_ID`` or ``$SLURM_JOB_ID``), a random ``token``, ``created`` (Unix time) and
``processes``: the run's fairseq processes while they run (``{"trainer": {"pid": N, "started": T}}``,
``"decoder"`` while the test set is decoded; ``started`` is the process's start time in clock
ticks, so that a reused pid is not taken for it). The owner rewrites it through its descriptor
(:meth:`RunOwnership.record_process`) when one starts and when it has ended.
The heartbeat is the file's modification time: every :data:`HEARTBEAT_S` seconds while it trains
or decodes, the owner touches the file it created through the descriptor it keeps open
(``os.utime(fd)``). It never writes by path, so a lock a taker has put in its place (when this
owner looked dead) is never overwritten by a late beat.

* A run held by a live owner is not touched: :meth:`RunOwnership.acquire` returns the holder,
  and the launcher says who holds it and comes back to it later.
* A dead owner's run is taken over: on this host, when neither its launcher nor any process the
  lock records (its trainer, its decoder) is alive (a SIGKILLed launcher whose fairseq-train
  goes on keeps its run until that trainer ends too); on another host, when its heartbeat is
  older than :data:`STALE_AFTER_S` seconds (or a lost node). The taker resumes the run from its
  last checkpoint, bit-identically (runner.train).
* A requeued SLURM job (same job id as the lock's) takes its own run back at once.

Two takers of one stale lock never both win: taking over needs ``owner.lock.takeover``,
itself created with ``O_EXCL``. ``$NORMPLUG_LOCK_TIMEOUT`` and ``$NORMPLUG_LOCK_HEARTBEAT``
change the two intervals (seconds).
"""
import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from fairseq_normplug.errors import NormplugError

LOCK_NAME = "owner.lock"
TAKEOVER_NAME = LOCK_NAME + ".takeover"
#: seconds between two heartbeats of a live owner
HEARTBEAT_S = float(os.environ.get("NORMPLUG_LOCK_HEARTBEAT", "30"))
#: a lock whose heartbeat is older than this (seconds) belongs to a dead owner
STALE_AFTER_S = float(os.environ.get("NORMPLUG_LOCK_TIMEOUT", "600"))
#: a takeover guard left by a taker that died in the middle is ignored after this (seconds)
TAKEOVER_STALE_S = 60.0
#: the runs this process owns now (their real path -> their ownership), for record_process
_OWNED: Dict[str, "RunOwnership"] = {}
_OWNED_LOCK = threading.Lock()


def slurm_job() -> Optional[str]:
    """This process's SLURM job (``ARRAYJOB_TASK`` for a job array's task), None outside SLURM;
    a requeued job keeps it."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended but is not reaped yet (or cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's field 22), None
    when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int, started: Optional[int]) -> bool:
    """Whether the process ``pid`` that started at ``started`` (:func:`start_ticks`; None: not
    recorded) still runs on this host: a pid reused by another process is not it."""
    return pid_alive(pid) and (started is None or start_ticks(pid) in (None, started))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return not zombie(pid)


@dataclass(frozen=True)
class Holder:
    """The owner a lock file names."""

    host: str
    pid: int
    slurm_job: Optional[str]
    token: str
    heartbeat: float
    #: the run's processes the launcher started, as ``(role, pid, started)`` (see the module docstring)
    processes: Tuple[Tuple[str, int, Optional[int]], ...] = ()

    @classmethod
    def me(cls, token: str) -> "Holder":
        return cls(host=socket.gethostname(), pid=os.getpid(), slurm_job=slurm_job(), token=token,
                   heartbeat=time.time())

    def record(self) -> dict:
        """The lock file's JSON (the heartbeat is the file's modification time)."""
        return {"host": self.host, "pid": self.pid, "slurm_job": self.slurm_job, "token": self.token,
                "created": self.heartbeat,
                "processes": {role: {"pid": pid, "started": started} for role, pid, started in self.processes}}

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job}" if self.slurm_job else ""
        processes = "".join(f", {role} pid {pid}" for role, pid, _ in self.processes)
        return (f"host {self.host} pid {self.pid}{job}{processes} "
                f"(heartbeat {max(0.0, time.time() - self.heartbeat):.0f} s ago)")

    def stale(self) -> Optional[str]:
        """Why this owner is dead, None when it may be alive. On this host, a live trainer or
        decoder the lock records holds the run whatever its launcher's state or heartbeat."""
        if self.host == socket.gethostname():
            if any(process_alive(pid, started) for _, pid, started in self.processes):
                return None
            if not pid_alive(self.pid):
                roles = " and ".join(f"its {role}" for role, _, _ in self.processes)
                return "its process is gone" + (f", and so is {roles}" if roles else "")
        age = time.time() - self.heartbeat
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s"
        return None


def read_holder(path: str) -> Optional[Holder]:
    """The holder of lock file ``path``, its heartbeat the file's modification time; None when
    there is no lock. A lock still being written (empty or cut) names an unknown owner."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        modified = os.path.getmtime(path)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        processes = tuple((str(role), int(entry["pid"]), None if entry.get("started") is None
                           else int(entry["started"])) for role, entry in sorted((data.get("processes") or {}).items()))
        return Holder(host=str(data["host"]), pid=int(data["pid"]), slurm_job=data.get("slurm_job"),
                      token=str(data["token"]), heartbeat=modified, processes=processes)
    except (ValueError, KeyError, TypeError):
        return Holder(host="?", pid=-1, slurm_job=None, token="?", heartbeat=modified)


def _write_new(path: str, holder: Holder) -> int:
    """Create ``path`` holding ``holder`` and return its open descriptor (the caller closes it);
    FileExistsError if it exists."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, json.dumps(holder.record()).encode("utf-8"))
    except BaseException:
        os.close(fd)
        raise
    return fd


class RunOwnership:
    """The lock of one run folder (see the module docstring)::

        ownership = RunOwnership(run_dir)
        holder = ownership.acquire()       # None: ours now (and heartbeating); else who holds it
        ...
        ownership.release()
    """

    def __init__(self, run_dir: str):
        self.run_dir = os.path.realpath(run_dir)
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.me = Holder.me(uuid.uuid4().hex)
        #: (previous holder, why it was taken over) when acquire() took a dead owner's run
        self.took_over: Optional[tuple] = None
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self._fd: Optional[int] = None  # the lock file this owner created, kept open

    def acquire(self) -> Optional[Holder]:
        """Take the run: None when it is ours now, else its live holder."""
        for _ in range(5):
            try:
                self._fd = _write_new(self.path, self.me)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:
                    continue  # released in between: try again
                # the same job id on another node: the job was requeued, its old process is gone
                # (on this node, pid_alive tells; two launchers inside one job are two owners)
                mine = (self.me.slurm_job is not None and holder.slurm_job == self.me.slurm_job
                        and holder.host != self.me.host)
                reason = "a requeued SLURM job takes its own run back" if mine else holder.stale()
                if reason is None or not self._remove_dead(holder):
                    return holder
                self.took_over = (holder, reason)
                continue
            self._start_heartbeat()
            with _OWNED_LOCK:
                _OWNED[self.run_dir] = self
            return None
        return read_holder(self.path) or self.me

    def _remove_dead(self, holder: Holder) -> bool:
        """Remove the lock of dead ``holder``, unless another taker is at it (False)."""
        guard = os.path.join(os.path.dirname(self.path), TAKEOVER_NAME)
        with contextlib.suppress(FileNotFoundError):
            if time.time() - os.path.getmtime(guard) > TAKEOVER_STALE_S:
                os.remove(guard)
        try:
            os.close(_write_new(guard, self.me))
        except FileExistsError:
            return False
        try:
            if read_holder(self.path) == holder:  # nobody else took it meanwhile
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
            return True
        finally:
            os.remove(guard)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def _still_mine(self) -> bool:
        """Whether the lock file at the path is still the one this owner created."""
        try:
            here, mine = os.stat(self.path), os.fstat(self._fd)
        except OSError:  # removed, or (NFS) our file is gone from the server
            return False
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._still_mine():
                return  # taken over (this owner looked dead): the new owner's lock is its own
            with contextlib.suppress(OSError):  # a full disk or a lost server: the next beat
                os.utime(self._fd)  # touches only the file this owner created

    def record_process(self, role: str, pid: Optional[int]) -> None:
        """Name process ``pid`` as this run's ``role`` (``trainer``, ``decoder``) in the lock, or
        forget the role (``pid`` None, once it has ended). Written through the descriptor this
        owner created, never by path: a lock taken over meanwhile is left alone."""
        processes = [entry for entry in self.me.processes if entry[0] != role]
        if pid is not None:
            processes.append((role, pid, start_ticks(pid)))
        self.me = dataclasses.replace(self.me, processes=tuple(sorted(processes)))
        if self._fd is None or not self._still_mine():
            return
        data = json.dumps(self.me.record()).encode("utf-8")
        with contextlib.suppress(OSError):  # a full disk: the launcher's pid still holds the run
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this owner's."""
        with _OWNED_LOCK:
            if _OWNED.get(self.run_dir) is self:
                del _OWNED[self.run_dir]
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self._fd is None:
            return
        if self._still_mine():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        os.close(self._fd)
        self._fd = None


@contextlib.contextmanager
def owned(run_dir: str, label: str):
    """The run folder as its only owner for the block (``scripts/train.sh``, ``evaluate.sh``);
    a run another live launcher holds is a NormplugError naming the holder."""
    os.makedirs(run_dir, exist_ok=True)
    owner = RunOwnership(run_dir)
    holder = owner.acquire()
    if holder is not None:
        raise NormplugError(f"{label} is held by {holder.describe()}: it trains there")
    try:
        yield owner
    finally:
        owner.release()


def record_process(run_dir: str, role: str, pid: Optional[int]) -> None:
    """:meth:`RunOwnership.record_process` of the run folder this process owns; nothing when it
    owns none (a test calling runner.train directly)."""
    with _OWNED_LOCK:
        owner = _OWNED.get(os.path.realpath(run_dir))
    if owner is not None:
        owner.record_process(role, pid)


def live_holder(run_dir: str) -> Optional[Holder]:
    """The live owner of a run folder (another process training it now), None if none."""
    holder = read_holder(os.path.join(run_dir, LOCK_NAME))
    return holder if holder is not None and holder.stale() is None else None
