"""Atomic file writing: a reader (or a rerun after a kill) sees the old file or the new
one, never a half-written one. Standard library only, so that every layer of the package
(checkpoints, tables, figures, conversions) can use it."""
import contextlib
import os
import re
import secrets
import shutil
import socket
import zlib
from typing import Iterator, List


#: ``.NAME.<host>-<pid>-<random>.tmp``: the temporary file of an atomic write of NAME by process
#: ``pid`` on the host whose :func:`_host_tag` is ``host``
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$")


def _host_tag() -> str:
    """8 hex digits naming this host (a shared folder may be written from several nodes)."""
    return f"{zlib.crc32(socket.gethostname().encode('utf-8')):08x}"


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(directory: str) -> List[str]:
    """Delete the temporary files in ``directory`` that atomic writes of processes now dead on
    this host left (a killed job: SIGKILL runs no clean-up); returns their paths. A live
    writer's (or another host's) temporary file is never touched."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    host = _host_tag()
    for name in names:
        match = TEMPORARY.match(name)
        if match and match.group("host") == host and int(match.group("pid")) != os.getpid() \
                and not pid_running(int(match.group("pid"))):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                if os.path.isdir(path) and not os.path.islink(path):  # an atomic_output_dir's folder
                    shutil.rmtree(path)
                else:
                    os.remove(path)
                removed.append(path)
    return removed


def _new_temporary_file(directory: str, prefix: str, suffix: str) -> str:
    """Create a new empty file of a unique name in ``directory`` (:data:`TEMPORARY`) and return its
    path. Its mode is what a plain ``open(path, "w")`` gives (0666 less the umask, and a default
    ACL), not ``tempfile.mkstemp``'s 0600: results, figures and checkpoints stay readable by the
    group."""
    for _ in range(100):
        candidate = os.path.join(directory, f"{prefix}{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {directory}")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, rename it to
    ``path`` (readers never see a half-written file), else delete it (a full disk leaves
    nothing). The temporary files killed writers left in the folder are deleted first."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(directory)
    tmp = _new_temporary_file(directory, "." + os.path.basename(path) + ".", ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_output_dir(path: str, replace: bool = False) -> Iterator[str]:
    """Yield a new empty temporary folder next to the folder ``path``; when the block succeeds,
    rename it to ``path`` (readers see no folder or the whole one), else delete it. An existing
    ``path`` is refused before the block runs (FileExistsError) unless ``replace``: then it is
    swapped out and deleted only once the new folder is in place. The temporary folders killed
    writers left are deleted first (:func:`remove_stale_temporaries`)."""
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    if os.path.lexists(target) and not replace:
        raise FileExistsError(f"{path} already exists")
    remove_stale_temporaries(directory)
    tmp = _new_temporary_file(directory, "." + os.path.basename(target) + ".", ".tmp")
    os.remove(tmp)
    os.mkdir(tmp)
    try:
        yield tmp
        publish_directory(tmp, target)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: str, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` through :func:`atomic_output`."""
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def copy_atomic(source: str, destination: str) -> None:
    """Copy ``source`` to ``destination`` through a temporary name (never a partial file)."""
    with atomic_output(destination) as tmp:
        shutil.copyfile(source, tmp)


def move_into_place(finished: str, path: str) -> None:
    """Rename the finished file ``finished`` to ``path`` in one step, replacing an older
    ``path``: a reader sees the old file or the new one (both must be on one filesystem)."""
    os.replace(finished, path)


def publish_directory(stage: str, destination: str) -> None:
    """Rename the finished folder ``stage`` to ``destination`` (same filesystem): readers see
    no folder, the older one or the whole new one. An older ``destination`` is set aside under
    a temporary name (:data:`TEMPORARY`: a killed writer's is deleted by the next write),
    deleted once the new folder is in place, and put back if that rename fails."""
    target = os.path.abspath(destination)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    old = None
    if os.path.lexists(target):
        old = _new_temporary_file(directory, "." + os.path.basename(target) + ".", ".tmp")
        os.remove(old)
        os.rename(target, old)
    try:
        os.rename(stage, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
