"""scripts/setup_env.sh stops on any failed step and records "done" (its stamp) only after
every check has passed; a recorded set-up is skipped, a changed one runs again.

Offline and in well under a second a run: set-up runs from a copy of its three inputs (the
script, pyproject.toml, install_plan.py) into a temporary NORMPLUG_VENV whose ``bin/python``
is a stand-in: it records every call, installs nothing (pip is a no-op), answers the checks,
and fails the step named by ``FAIL_ON``. Nothing touches the real environment.
"""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

FAKE_PYTHON = r"""#!/usr/bin/env bash
# stand-in for an environment's python (tests/test_setup_env.py)
echo "$*" >> "$FAKE_LOG"
if [ -n "${FAIL_ON:-}" ] && [[ " $* " == *" $FAIL_ON "* ]]; then
  echo "fake failure of: $*" >&2
  exit 3
fi
case "$*" in
  *"--no-build-isolation -e "*)  # pip's report of fairseq's left-out torchaudio, and another note
    echo "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. This behaviour is the source of the following dependency conflicts." >&2
    echo "fairseq-fixed 0.12.3.1 requires torchaudio>=0.8.0, which is not installed." >&2
    echo "another pip note" >&2
    exit 0 ;;
  "-m venv "*|"-m pip "*) exit 0 ;;
  *" check-installed "*) echo "torch 2.13.0+cpu (CPU build)"; exit 0 ;;
  "-c import torch"*) echo "2.13.0"; exit 0 ;;
  "-c import fairseq"*) exit 0 ;;
  *"native.ops()"*) exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"   # install_plan.py torch / fairseq: the real plan
"""
#: the steps a successful set-up takes, in order (FAIL_ON patterns and what the log shows)
STEPS = {
    "plan": "torch",  # install_plan.py torch, with $PYTHON
    "pip": "install -q --upgrade pip setuptools wheel",
    "torch": "torch==2.13.0",
    "check": "check-installed",
    "version": "-c import torch; print(torch.__version__.split(\"+\")[0])",
    "numpy": "numpy cython",
    "fairseq": "fairseq",  # install_plan.py fairseq
    "plugin": "--no-build-isolation -e",
    "import": "import fairseq_normplug",
    "kernels": "native.ops()",  # built last, after every check
}


@pytest.fixture
def setup_copy(tmp_path):
    """``run(**env)`` runs set-up from a copy of the repository's set-up inputs with a fake
    environment; returns (CompletedProcess, calls made, stamp text or None)."""
    root = tmp_path / "repo"
    for name in ("scripts/setup_env.sh", "pyproject.toml", "fairseq_normplug/install_plan.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), root / name)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    stamp = venv / ".normplug-setup"

    def run(**env):
        log.write_text("")
        environment = {k: v for k, v in os.environ.items()
                       if not k.startswith(("NORMPLUG_", "FAIL_ON"))}
        environment.update({"NORMPLUG_VENV": str(venv), "NORMPLUG_CUDA": "0", "PYTHON": str(fake),
                            "NORMPLUG_TORCH_INDEX": "https://index.invalid/whl",
                            "REAL_PYTHON": sys.executable, "FAKE_LOG": str(log), **env})
        proc = subprocess.run(["bash", str(root / "scripts" / "setup_env.sh")], capture_output=True,
                              text=True, env=environment, timeout=120)
        calls = [line for line in log.read_text().splitlines() if line]
        return proc, calls, stamp.read_text() if stamp.exists() else None

    run.root = root
    return run


@pytest.mark.slow
def test_a_full_set_up_records_its_stamp_last_and_is_then_skipped(setup_copy):
    proc, calls, stamp = setup_copy()
    assert proc.returncode == 0, proc.stderr
    for step, pattern in STEPS.items():
        assert any(f" {pattern} " in f" {call} " for call in calls), (step, calls)
    assert [c for c in calls if "import fairseq_normplug" in c] == [calls[-2]]  # the last check
    assert "native.ops()" in calls[-1]  # then the native kernels
    lines = proc.stderr.splitlines()
    assert "[setup_env] torch 2.13.0+cpu (CPU build)" in lines
    assert lines[-1].startswith("[setup_env] ready: ")
    assert stamp.startswith("|https://index.invalid/whl|0|")
    # nothing the user can do nothing about: numpy is there before torch is first imported,
    # and pip's report of the torchaudio left out on purpose is not shown (other notes are)
    first_torch_import = next(i for i, call in enumerate(calls) if "check-installed" in call)
    assert any(" numpy cython" in call for call in calls[:first_torch_import]), calls
    assert "torchaudio" not in proc.stderr and "dependency resolver" not in proc.stderr
    assert "another pip note" in lines
    again, calls, same_stamp = setup_copy()
    assert again.returncode == 0 and calls == [] and again.stderr == "" and same_stamp == stamp
    # an input of set-up changed (here pyproject.toml): it runs again
    with open(setup_copy.root / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    changed, calls, new_stamp = setup_copy()
    assert changed.returncode == 0 and calls and new_stamp != stamp


@pytest.mark.slow
@pytest.mark.parametrize("step", ["plan", "torch", "check", "version", "fairseq", "plugin", "import"])
def test_a_failed_step_stops_set_up_and_records_nothing(setup_copy, step):
    """Each failing step ends set-up with its exit status and a line naming the command; no
    stamp, and no later step runs (the check inside a log line used to be ignored)."""
    proc, calls, stamp = setup_copy(FAIL_ON=STEPS[step])
    assert proc.returncode != 0 and stamp is None
    assert f" {STEPS[step]} " in f" {calls[-1]} ", calls  # nothing ran after the failure
    failed = [line for line in proc.stderr.splitlines() if "FAILED (exit status" in line]
    assert len(failed) == 1 and "set-up is not recorded as done" in failed[0], proc.stderr
    assert "ready:" not in proc.stderr


@pytest.mark.slow
def test_native_kernels_that_cannot_be_built_do_not_stop_set_up(setup_copy):
    """Training falls back to the other fast paths where the kernels cannot be built (no
    compiler), so set-up says so and is recorded as done."""
    proc, calls, stamp = setup_copy(FAIL_ON=STEPS["kernels"])
    assert proc.returncode == 0 and stamp, proc.stderr
    assert "native.ops()" in calls[-1]
    lines = proc.stderr.splitlines()
    assert "[setup_env] the native CPU norm kernels were not built (above): training falls back to the other " \
        "fast paths" in lines and "FAILED" not in proc.stderr
    assert lines[-1].startswith("[setup_env] ready: ")


@pytest.mark.slow
def test_a_failed_re_run_removes_the_old_stamp(setup_copy):
    """Set-up with new settings fails half-way: the environment is no longer the recorded one,
    so a run with the old settings does not skip set-up either."""
    first, _, stamp = setup_copy()
    assert first.returncode == 0 and stamp
    failed, _, after_failure = setup_copy(NORMPLUG_TORCH="torch==2.6.0", FAIL_ON="check-installed")
    assert failed.returncode != 0 and after_failure is None
    rerun, calls, stamp_again = setup_copy()
    assert rerun.returncode == 0 and calls and stamp_again == stamp


@pytest.mark.slow
def test_setup_zero_uses_the_environment_as_it_is(setup_copy, tmp_path):
    proc, calls, stamp = setup_copy(NORMPLUG_SETUP="0")
    assert proc.returncode == 0 and calls == [] and stamp is None and proc.stderr == ""
    missing = str(tmp_path / "nothing-here")
    proc, calls, _ = setup_copy(NORMPLUG_SETUP="0", NORMPLUG_VENV=missing)
    assert proc.returncode == 1 and calls == []
    assert proc.stderr.splitlines() == [
        f"[setup_env] NORMPLUG_SETUP=0 uses the environment as it is, but {missing}/bin/python "
        "does not exist; set NORMPLUG_VENV"]
