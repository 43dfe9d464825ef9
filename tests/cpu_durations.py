"""``--cpu-durations=N``: the N tests that used the most CPU time (0: every test), after the run.

pytest's ``--durations`` lists wall time, which on a busy machine (three workers on two cores, a
training beside the suite) says more about the machine than about the test. This lists CPU
seconds instead, user + sys: those of the test's own process and those of every process it
started and waited for (``resource.getrusage``'s RUSAGE_SELF and RUSAGE_CHILDREN): the real
commands and the forked ones of tests/inprocess.py alike. A test's figure runs from the start of
its set-up to the end of its tear-down, so it includes the fixtures it was the first to build
(a module's trained checkpoints go to its first test). With pytest-xdist each worker measures
its own tests and the figures travel to the summary in the reports' ``user_properties``.

tests/conftest.py takes the option (``pytest_addoption``) and registers :class:`CpuDurations` at
configuration (:func:`register`): ``scripts/test.sh --cpu-durations=40`` (docs/setup.md)."""
import resource

import pytest

CPU_AT_START = pytest.StashKey[float]()
PROPERTY = "cpu_seconds"


def cpu_seconds() -> float:
    """User + sys CPU seconds of this process and of its waited-for child processes so far: the
    sum ``bench/common.py``'s ``OtherProcesses`` takes as its own, written out here because this
    module imports only the standard library and pytest (``fairseq_normplug.bench`` would load
    the package, and with it torch and fairseq, in every pytest process that takes the option)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that used the most CPU time, user + sys, with the processes "
                          "they started (N=0: all)")


class CpuDurations:
    """The hooks that measure and list, for every test of the run (tests/ and examples/)."""

    def __init__(self):
        self.measured = {}  # {test id: CPU seconds}, on the process that prints the summary

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        item.stash[CPU_AT_START] = cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        start = item.stash.get(CPU_AT_START, None)
        if call.when == "teardown" and start is not None:
            outcome.get_result().user_properties.append((PROPERTY, cpu_seconds() - start))

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            for key, value in report.user_properties:
                if key == PROPERTY:
                    self.measured[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter, config):
        count = config.getoption("cpu_durations")
        if not self.measured:
            return
        ranked = sorted(self.measured.items(), key=lambda item: -item[1])
        shown = ranked[:count] if count > 0 else ranked
        terminalreporter.write_sep("=", f"{len(shown)} of {len(ranked)} tests by CPU time "
                                        "(user + sys, with the processes they started)")
        for test_id, seconds in shown:
            terminalreporter.write_line(f"{seconds:9.2f}s {test_id}")
        terminalreporter.write_line(f"{sum(self.measured.values()):.1f} CPU s in {len(self.measured)} tests")


def register(config) -> None:
    """From a conftest's ``pytest_configure``: with ``--cpu-durations``, measure every test."""
    if config.getoption("cpu_durations") is not None:
        config.pluginmanager.register(CpuDurations(), "cpu-durations")
