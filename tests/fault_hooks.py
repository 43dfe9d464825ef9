"""Test-only fault points of the fault tests (tests/test_kill_rerun.py, test_trust.py,
test_one_owner.py): patches of fairseq's modules that the environment turns on, each applied by
:func:`install` to the module now if it is imported, else right after its import. A real process
gets them from a ``sitecustomize.py`` on its PYTHONPATH (:data:`SITECUSTOMIZE`: this file, then
``install()``); a forked fairseq command of tests/inprocess.py, whose modules are imported
already, from ``install`` called in it (``ForkedLauncher(..., at_start=fault_hooks.install)``).
  NORMPLUG_KILL_AT=POINT: SIGKILL this process group at POINT
    update:N          after training update N (fairseq-train)
    copy:NAME:N       half-way through copying the save of update N to NAME (fairseq-train)
    generate:N        at the N-th batch of fairseq-generate
    write:NAME        half-way through writing NAME (experiments.tables.write_text_atomic; applied
                      by the caller: ``during_write(tables)``)
  NORMPLUG_TEST_PAUSE_AT=update:N or generate:N: after fairseq-train's update N or at
    fairseq-generate's N-th batch, write this process's pid to $NORMPLUG_TEST_PAUSED and wait
    there until a signal ends it or the test writes $NORMPLUG_TEST_PAUSED.go (:func:`release`);
    once: a process that finds that file there goes on (a resumed run that passes update N again)
  NORMPLUG_TEST_ENOSPC_AT=N: fairseq-train's save of update N writes half the checkpoint and
    fails as a full disk does (OSError ENOSPC)
"""
import errno
import importlib.machinery
import io
import os
import re
import signal
import sys
import time


def point():
    return os.environ.get("NORMPLUG_KILL_AT", "").split(":")


def kill():
    os.killpg(os.getpgrp(), signal.SIGKILL)


def at_update(number, action):
    """The patch of ``fairseq.trainer``: ``action()`` right after fairseq-train's update
    ``number()`` (read from the environment when it is reached)."""
    def patch(module):
        step = module.Trainer.train_step

        def train_step(self, *args, **kwargs):
            out = step(self, *args, **kwargs)
            if self.get_num_updates() == int(number()):
                action()
            return out
        module.Trainer.train_step = train_step
    return patch


def at_decoding_batch(number, action):
    """The patch of ``fairseq.tasks.fairseq_task``: ``action()`` at fairseq-generate's batch
    ``number()`` (one ``inference_step`` call per batch, whichever generator); other commands
    are left alone."""
    def patch(module):
        if not sys.argv[0].endswith("fairseq-generate"):
            return
        step, calls = module.FairseqTask.inference_step, []

        def counted(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == int(number()):
                action()
            return step(self, *args, **kwargs)
        module.FairseqTask.inference_step = counted
    return patch


def during_copy(module):
    copy = module.PathManager.copy

    def half_copy(src, dst, overwrite=False):
        if os.path.basename(dst) == point()[1] and re.search(rf"_{point()[2]}\.pt$", src):
            with open(src, "rb") as f:
                data = f.read()
            with open(dst, "wb") as f:
                f.write(data[: len(data) // 2])
            kill()
        return copy(src, dst, overwrite=overwrite)
    module.PathManager.copy = staticmethod(half_copy)


def during_write(module):
    from fairseq_normplug.atomic_files import atomic_output

    write = module.write_text_atomic

    def half_write(path, text):
        if os.path.basename(path) == point()[1]:
            with atomic_output(path) as tmp:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text[: len(text) // 2])
                kill()
        return write(path, text)
    module.write_text_atomic = half_write


PATCHES = {"update": ("fairseq.trainer", at_update(lambda: point()[1], kill)),
           "copy": ("fairseq.file_io", during_copy),
           "generate": ("fairseq.tasks.fairseq_task", at_decoding_batch(lambda: point()[1], kill))}


class PatchAfterImport:
    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


def pause_point():
    return os.environ.get("NORMPLUG_TEST_PAUSE_AT", "").split(":")


def pause():
    if os.path.exists(os.environ["NORMPLUG_TEST_PAUSED"]):  # held once already
        return
    with open(os.environ["NORMPLUG_TEST_PAUSED"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.environ["NORMPLUG_TEST_PAUSED"] + ".tmp", os.environ["NORMPLUG_TEST_PAUSED"])
    while not os.path.exists(os.environ["NORMPLUG_TEST_PAUSED"] + ".go"):
        time.sleep(0.1)


def release(paused) -> None:
    """Let the process held at the pause file ``paused`` go on."""
    with open(f"{paused}.go", "w"):
        pass


PAUSES = {"update": ("fairseq.trainer", at_update(lambda: pause_point()[1], pause)),
          "generate": ("fairseq.tasks.fairseq_task", at_decoding_batch(lambda: pause_point()[1], pause))}


def full_disk(module):
    def full_disk_save(obj, f):
        if obj["optimizer_history"][-1]["num_updates"] == int(os.environ["NORMPLUG_TEST_ENOSPC_AT"]):
            data = io.BytesIO()
            module.torch.save(obj, data)
            f.write(data.getvalue()[: len(data.getvalue()) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return module.torch.save(obj, f)
    module._torch_persistent_save = full_disk_save


def patch_now_or_after_import(name, patch):
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, PatchAfterImport(name, patch))


def install():
    """The patches this process's environment turns on (none: nothing)."""
    if point()[0] in PATCHES:
        patch_now_or_after_import(*PATCHES[point()[0]])
    if pause_point()[0] in PAUSES:
        patch_now_or_after_import(*PAUSES[pause_point()[0]])
    if os.environ.get("NORMPLUG_TEST_ENOSPC_AT"):
        patch_now_or_after_import("fairseq.checkpoint_utils", full_disk)


def _source() -> str:
    """This file's text (in a sitecustomize, __file__ is the sitecustomize's own)."""
    with open(__file__, encoding="utf-8") as f:
        return f.read()


#: the text of a ``sitecustomize.py`` that installs these hooks in a real process
SITECUSTOMIZE = _source() + "\n\ninstall()\n"


def sitecustomize_folder(parent) -> str:
    """A folder (made once under the pathlib folder ``parent``) holding :data:`SITECUSTOMIZE` as
    ``sitecustomize.py``: on a real process's PYTHONPATH, it installs these hooks there."""
    folder = parent / "fault-hooks"
    if not folder.exists():
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(folder)
