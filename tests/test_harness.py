"""The test suite's own rules (tests/conftest.py), on stand-in commands: a failed peer and a
hang end their job at once, and a fast path's fallback warning fails a command's test."""
import sys
import time

import pytest

import conftest
from conftest import assert_no_fallback, run_cli, run_parallel

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


@pytest.mark.slow
def test_a_failing_peer_gets_the_others_killed():
    """Like a data-parallel rank whose peer crashed: the survivor would wait forever."""
    start = time.monotonic()
    failed, survivor = run_parallel([[sys.executable, "-c", "raise SystemExit(3)"], SLEEPER])
    assert failed.returncode == 3 and survivor.returncode < 0  # killed by a signal
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_independent_commands_all_finish():
    first, second = run_parallel([[sys.executable, "-c", "raise SystemExit(3)"],
                                  [sys.executable, "-c", "print('done')"]], peers=False)
    assert (first.returncode, second.returncode, second.stdout) == (3, 0, "done\n")


@pytest.mark.slow
def test_a_hang_is_killed_at_the_time_limit():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 1 s, killed"):
        run_parallel([SLEEPER, SLEEPER], timeout=1)
    assert time.monotonic() - start < 60


WARNING = ("fairseq-normplug: native CPU norm kernels unavailable (RuntimeError: no compiler); "
           "using the other fast paths")


@pytest.mark.slow
def test_a_fallback_warning_fails_the_command_that_printed_it(monkeypatch):
    monkeypatch.setattr(conftest, "FALLBACK_EXPECTED", False)
    script = f"import sys; print({WARNING!r}, file=sys.stderr)"
    with pytest.raises(AssertionError, match="unexpected fallback in .*native CPU norm kernels unavailable"):
        run_cli([sys.executable, "-c", script])
    assert run_cli([sys.executable, "-c", script], fallback_ok=True).returncode == 0
    assert_no_fallback("fairseq-normplug: training on 1 device", "x")  # other plugin lines are fine
    with pytest.raises(AssertionError, match="torch.compile of dyt_kernel failed"):
        assert_no_fallback("... fairseq-normplug: torch.compile of dyt_kernel failed (X: y); using the eager "
                           "fast path", "x")


def test_a_fallback_warning_inside_this_process_is_an_error():
    """pytest_configure turned the plugin's fallback warnings into errors (where a compiler
    exists); a test that expects one catches it with pytest.warns."""
    import warnings

    if conftest.FALLBACK_EXPECTED:
        pytest.skip("no C++ compiler: the fallback is expected here")
    with pytest.raises(RuntimeWarning, match="native CPU norm kernels unavailable"):
        warnings.warn(WARNING, RuntimeWarning)
    with pytest.warns(RuntimeWarning, match="native CPU norm kernels unavailable"):
        warnings.warn(WARNING, RuntimeWarning)
