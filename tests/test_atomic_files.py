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


def test_the_temporary_files_of_killed_writers_are_removed_by_the_next_write(tmp_path):
    """Issue 50: a writer SIGKILLed inside its atomic write (a figure, results.md) leaves its
    hidden temporary file; the next atomic write in that folder deletes it, never the temporary
    file of a live writer (or of this process, or of another host)."""
    import subprocess
    import sys

    from fairseq_normplug.atomic_files import TEMPORARY, _host_tag

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {"dead": f".fig1_dev_bleu.png.{_host_tag()}-{dead.pid}-0123abcd.tmp",
                 "live": f".results.md.{_host_tag()}-{live.pid}-0123abcd.tmp",
                 "mine": f".results.csv.{_host_tag()}-{os.getpid()}-0123abcd.tmp",
                 "elsewhere": f".fig2_grad_norm.png.{'0' * 8 if _host_tag() != '0' * 8 else '1' * 8}-{dead.pid}-0123abcd.tmp"}
        assert all(TEMPORARY.match(name) for name in names.values())
        for name in names.values():
            (tmp_path / name).write_bytes(b"half")
        write_text_atomic(str(tmp_path / "results.md"), "new\n")
        assert sorted(os.listdir(tmp_path)) == sorted([names["live"], names["mine"], names["elsewhere"], "results.md"])
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow
def test_a_writer_killed_inside_its_atomic_write_leaves_nothing_after_the_next_write(tmp_path):
    import signal
    import subprocess
    import sys

    script = ("import os, signal, sys\n"
              "sys.path.insert(0, sys.argv[2])\n"
              "import importlib.util\n"
              "spec = importlib.util.spec_from_file_location('atomic_files', sys.argv[3])\n"
              "atomic_files = importlib.util.module_from_spec(spec); spec.loader.exec_module(atomic_files)\n"
              "with atomic_files.atomic_output(sys.argv[1]) as tmp:\n"
              "    open(tmp, 'wb').write(b'half a png')\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    import fairseq_normplug.atomic_files as module
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "fig1_dev_bleu.png"), str(tmp_path),
                           module.__file__])
    assert proc.returncode == -signal.SIGKILL
    assert [name for name in os.listdir(tmp_path) if name.startswith(".fig1_dev_bleu.png.")]
    write_text_atomic(str(tmp_path / "results.md"), "table\n")
    assert os.listdir(tmp_path) == ["results.md"]


def test_atomic_output_dir_renames_a_whole_folder_or_leaves_nothing(tmp_path):
    """A folder written through atomic_output_dir (an exported model) appears whole on success;
    a failure leaves no folder and no temporary one; an existing folder is refused unless
    ``replace``, and then replaced whole."""
    from fairseq_normplug.atomic_files import atomic_output_dir

    target = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(str(target)) as tmp:
            open(os.path.join(tmp, "model.bin"), "w").write("half")
            raise RuntimeError("check failed")
    assert os.listdir(tmp_path) == []
    with atomic_output_dir(str(target)) as tmp:
        open(os.path.join(tmp, "model.bin"), "w").write("new")
    assert os.listdir(tmp_path) == ["model"] and (target / "model.bin").read_text() == "new"
    with pytest.raises(FileExistsError):
        with atomic_output_dir(str(target)):
            pass
    with atomic_output_dir(str(target), replace=True) as tmp:
        open(os.path.join(tmp, "vocab.txt"), "w").write("v")
    assert os.listdir(tmp_path) == ["model"] and os.listdir(target) == ["vocab.txt"]


def test_a_dead_writers_temporary_folder_is_removed(tmp_path):
    from fairseq_normplug.atomic_files import _host_tag, remove_stale_temporaries

    stale = tmp_path / f".model.{_host_tag()}-999999999-0123abcd.tmp"
    stale.mkdir()
    (stale / "model.bin").write_text("x")
    assert remove_stale_temporaries(str(tmp_path)) == [str(stale)] and os.listdir(tmp_path) == []


def test_move_into_place_replaces_the_older_file_whole(tmp_path):
    from fairseq_normplug.atomic_files import move_into_place

    (tmp_path / "generate-test.txt").write_text("old")
    (tmp_path / "finished").write_text("new")
    move_into_place(str(tmp_path / "finished"), str(tmp_path / "generate-test.txt"))
    assert os.listdir(tmp_path) == ["generate-test.txt"]
    assert (tmp_path / "generate-test.txt").read_text() == "new"


def test_publish_directory_replaces_an_older_folder_and_creates_the_parent(tmp_path):
    from fairseq_normplug.atomic_files import publish_directory

    stage = tmp_path / "corpus.tmp-1"
    stage.mkdir()
    (stage / "train.en").write_text("first")
    publish_directory(str(stage), str(tmp_path / "data" / "corpus"))
    stage.mkdir()
    (stage / "valid.en").write_text("second")
    publish_directory(str(stage), str(tmp_path / "data" / "corpus"))
    assert sorted(os.listdir(tmp_path)) == ["data"] and os.listdir(tmp_path / "data") == ["corpus"]
    assert os.listdir(tmp_path / "data" / "corpus") == ["valid.en"]


def test_pid_running_tells_a_live_process_from_a_dead_one():
    import subprocess
    import sys

    from fairseq_normplug.atomic_files import pid_running

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_running(os.getpid()) and not pid_running(child.pid)


def test_publish_directory_puts_the_older_folder_back_when_the_rename_fails(tmp_path, monkeypatch):
    from fairseq_normplug import atomic_files

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.en").write_text("old")
    real_rename = os.rename

    def rename(source, target):
        if source.endswith("missing-stage"):
            raise OSError("disk gone")
        return real_rename(source, target)

    monkeypatch.setattr(atomic_files.os, "rename", rename)
    with pytest.raises(OSError):
        atomic_files.publish_directory(str(tmp_path / "missing-stage"), str(tmp_path / "corpus"))
    assert os.listdir(tmp_path) == ["corpus"] and (tmp_path / "corpus" / "train.en").read_text() == "old"
