"""fairseq_normplug.atomic_files: a file is replaced whole or not at all."""
import os

import pytest

from fairseq_normplug.atomic_files import atomic_output, write_text_atomic


def test_atomic_output_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "results.md"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(str(target)) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == ["results.md"] and target.read_text() == "old"


def test_write_text_atomic_replaces_and_creates_the_directory(tmp_path):
    target = tmp_path / "new" / "results.md"
    write_text_atomic(str(target), "a\r\nb\n")
    write_text_atomic(str(target), "c\r\n")
    assert os.listdir(target.parent) == ["results.md"] and target.read_bytes() == b"c\r\n"


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_every_atomic_write_honours_the_umask_as_open_does(tmp_path, umask, mode):
    """Issue 50: results, figures, dictionaries and checkpoints written atomically get the mode a
    plain open() gives under the umask (mkstemp's 0600 hid a table from the group)."""
    from fairseq_normplug.atomic_files import copy_atomic

    old = os.umask(umask)
    try:
        write_text_atomic(str(tmp_path / "results.csv"), "a\n")
        copy_atomic(str(tmp_path / "results.csv"), str(tmp_path / "dict.txt"))
        with atomic_output(str(tmp_path / "figure.png")) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"png")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("a\n")
    finally:
        os.umask(old)
    modes = {name: os.stat(tmp_path / name).st_mode & 0o777 for name in sorted(os.listdir(tmp_path))}
    assert modes == {"dict.txt": mode, "figure.png": mode, "plain.txt": mode, "results.csv": mode}
