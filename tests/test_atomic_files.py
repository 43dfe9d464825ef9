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
