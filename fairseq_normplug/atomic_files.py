"""Atomic file writing: a reader (or a rerun after a kill) sees the old file or the new
one, never a half-written one. Standard library only, so that every layer of the package
(checkpoints, tables, figures, conversions) can use it."""
import contextlib
import os
import secrets
import shutil
from typing import Iterator


def _new_temporary_file(directory: str, prefix: str, suffix: str) -> str:
    """Create a new empty file of a unique name in ``directory`` and return its path. Its mode is
    what a plain ``open(path, "w")`` gives (0666 less the umask, and a default ACL), not
    ``tempfile.mkstemp``'s 0600: results, figures and checkpoints stay readable by the group."""
    for _ in range(100):
        candidate = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {directory}")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, rename it to
    ``path`` (readers never see a half-written file), else delete it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = _new_temporary_file(directory, "." + os.path.basename(path) + ".", ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` through :func:`atomic_output`."""
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def copy_atomic(source: str, destination: str) -> None:
    """Copy ``source`` to ``destination`` through a temporary name (never a partial file)."""
    with atomic_output(destination) as tmp:
        shutil.copyfile(source, tmp)
