"""Atomic file writing: a reader (or a rerun after a kill) sees the old file or the new
one, never a half-written one. Standard library only, so that every layer of the package
(checkpoints, tables, figures, conversions) can use it."""
import contextlib
import os
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, rename it to
    ``path`` (readers never see a half-written file), else delete it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                                   suffix=".tmp")
    os.close(handle)
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
