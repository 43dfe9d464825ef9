"""The test suite's own rules (tests/conftest.py), on stand-in commands: a failed peer and a
hang end their job at once, and a fast path's fallback warning fails a command's test."""
import os
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


RECORDING_PYTHON = """#!/usr/bin/env bash
# stand-in for the environment's python: prints what scripts/test.sh runs it with
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS"
printf '%s\\n' "$@"
"""


@pytest.mark.parametrize("args,workers", [([], "3"), (["-m", "not slow"], "2"), (["-mnot slow"], "2"),
                                          (["-m", "slow"], "3")])
def test_the_quick_loop_runs_one_worker_per_core_and_the_suite_one_more(tmp_path, args, workers):
    """scripts/test.sh on 2 cores: the whole suite waits on the commands it starts and takes a third
    worker, the quick loop computes throughout and takes two (docs/setup.md)."""
    printed = recording_test_sh(tmp_path, *args)
    assert printed[0] == "OMP_NUM_THREADS=1"
    assert printed[1:] == ["-m", "pytest", "tests", "examples", "-n", workers, "--dist", "loadfile", *args]


def recording_test_sh(tmp_path, *args) -> list:
    """What scripts/test.sh, on 2 cores and with its Python replaced by RECORDING_PYTHON, prints:
    OMP_NUM_THREADS, then the arguments of its Python, one a line."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    fake_bin = tmp_path / "bin"  # a getconf that says 2 cores, whatever this machine has
    fake_bin.mkdir()
    (fake_bin / "getconf").write_text("#!/usr/bin/env bash\necho 2\n")
    (fake_bin / "getconf").chmod(0o755)
    env = {"NORMPLUG_SETUP": "0", "NORMPLUG_VENV": str(venv), "NORMPLUG_TEST_WORKERS": None, "OMP_NUM_THREADS": None,
           "MKL_NUM_THREADS": None, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    return run_cli(["bash", os.path.join(conftest.REPO, "scripts", "test.sh"), *args], env=env).stdout.splitlines()


@pytest.mark.parametrize("args,expected", [
    # one file: its tests share one worker, so no workers are started
    (["tests/test_norms.py", "-x"], ["tests/test_norms.py", "-x"]),
    # node ids count by their file: two files, two workers
    (["tests/test_norms.py::test_x", "tests/test_norms.py", "tests/test_cli.py", "-k", "scalenorm"],
     ["-n", "2", "--dist", "loadfile", "tests/test_norms.py::test_x", "tests/test_norms.py", "tests/test_cli.py",
      "-k", "scalenorm"]),
    # a folder: the usual workers
    (["examples"], ["-n", "3", "--dist", "loadfile", "examples"]),
    # a -k expression or a marker is not a path: the whole suite
    (["-k", "no_such_path"], ["tests", "examples", "-n", "3", "--dist", "loadfile", "-k", "no_such_path"]),
])
def test_named_test_files_run_instead_of_the_whole_suite(tmp_path, args, expected):
    assert recording_test_sh(tmp_path, *args)[1:] == ["-m", "pytest", *expected]


CPU_TESTS = """
import subprocess, sys, time

def test_computes():
    sum(i * i for i in range(2 * 10**6))

def test_waits_on_a_computing_child():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(2 * 10**6))"], check=True)

def test_sleeps():
    time.sleep(0.5)
"""


def run_stand_ins(tmp_path, *options) -> str:
    """pytest on the three stand-in tests, in ``tmp_path`` with a conftest that registers
    tests/cpu_durations.py as tests/conftest.py does: its output."""
    (tmp_path / "conftest.py").write_text("import cpu_durations\nfrom cpu_durations import pytest_addoption\n"
                                          "def pytest_configure(config):\n    cpu_durations.register(config)\n")
    (tmp_path / "test_stand_ins.py").write_text(CPU_TESTS)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_stand_ins.py", *options]
    # only the plugins asked for (-p): not every pytest plugin of the environment, in each of 3 runs
    env = {"PYTHONPATH": os.path.join(conftest.REPO, "tests"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return run_cli(command, cwd=str(tmp_path), env=env).stdout


def assert_ranked_by_cpu(output: str) -> None:
    """The three stand-ins listed by CPU seconds: a child process's CPU counts, a sleep's does not."""
    listed = {}
    for line in output.split("tests by CPU time", 1)[1].splitlines()[1:4]:
        seconds, test_id = line.split()
        listed[test_id.split("::")[1]] = float(seconds.rstrip("s"))
    assert set(listed) == {"test_computes", "test_waits_on_a_computing_child", "test_sleeps"}, output
    assert min(listed["test_computes"], listed["test_waits_on_a_computing_child"]) > 0.05, listed
    assert listed["test_sleeps"] < 0.05, listed


def test_cpu_durations_rank_tests_by_their_cpu_and_their_childrens(tmp_path):
    """--cpu-durations=N (tests/cpu_durations.py) lists the N tests that used the most CPU
    seconds (0: all) and their sum over the run, and nothing without the option."""
    assert_ranked_by_cpu(run_stand_ins(tmp_path, "--cpu-durations=0"))
    top = run_stand_ins(tmp_path, "--cpu-durations=1").split("1 of 3 tests by CPU time", 1)[1].splitlines()
    listed = [line for line in top if "::test_" in line]
    assert len(listed) == 1 and "test_sleeps" not in listed[0]
    assert any(line.endswith(" CPU s in 3 tests") for line in top)
    assert "by CPU time" not in run_stand_ins(tmp_path)


@pytest.mark.slow
def test_cpu_durations_gather_the_figures_of_xdist_workers(tmp_path):
    """Under pytest-xdist each worker measures its tests; the controller lists them all."""
    assert_ranked_by_cpu(run_stand_ins(tmp_path, "-p", "xdist.plugin", "-n", "2", "--cpu-durations=0"))


def test_what_a_test_module_registers_is_gone_after_it_and_loads_again(tmp_path):
    """conftest's ``registrations_restored`` (every test module runs in one): a norm type and a
    placement registered in the block, and an extension package loaded there, are gone after it,
    its modules too; loading the extension again registers its norm again."""
    from fairseq_normplug import extensions
    from fairseq_normplug.models.placements import PLACEMENTS, Placement, register_placement
    from fairseq_normplug.modules.norm_registry import NORM_TYPES

    name = f"harness_norm_{os.getpid()}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("from . import norm\n")
    (package / "norm.py").write_text(
        "from fairseq_normplug import FormulaNorm, register_norm\n\n"
        f"@register_norm('{name}')\nclass HarnessNorm(FormulaNorm):\n"
        "    def formula(self, x):\n        return x\n")
    before = (dict(NORM_TYPES), dict(PLACEMENTS), dict(extensions.LOADED))
    for _ in range(2):
        with conftest.registrations_restored():
            extensions.load_extensions(str(package))
            register_placement(f"harness-placement-{os.getpid()}")(type("HarnessPlacement", (Placement,), {}))
            assert name in NORM_TYPES and f"{name}.norm" in sys.modules
        assert (dict(NORM_TYPES), dict(PLACEMENTS), dict(extensions.LOADED)) == before
        assert not [module for module in sys.modules if module.startswith(name)]


def test_the_override_parses_are_remembered_and_equal_hydras_own(tiny_bin, monkeypatch):
    """tests/faster_compose.py in this process: hydra's ``parse_overrides`` still calls
    ``parse_rule`` (the method replaced), each override of a real fairseq command parses to what
    hydra's own ``parse_rule`` gives, a second parse of a string is the remembered one, and each
    caller gets its own copy."""
    from fairseq.dataclass.utils import override_module_args
    from model_helpers import parse_args
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import faster_compose

    assert OverridesParser.parse_rule is faster_compose.remembered_parse_rule
    args = parse_args(tiny_bin, "transformer_normplug_tiny", "--prenorm", "--scalenorm", "--optimizer", "adam",
                      "--lr", "1e-3", "--max-update", "3")
    overrides, _ = override_module_args(args)
    assert len(overrides) > 200
    calls = []
    remembered = faster_compose.remembered_parse_rule
    monkeypatch.setattr(OverridesParser, "parse_rule",
                        lambda self, s, rule: calls.append((s, rule)) or remembered(self, s, rule))
    parser = OverridesParser.create()
    first = parser.parse_overrides(overrides)
    assert calls == [(s, "override") for s in overrides]
    held = faster_compose.remembered()
    again = parser.parse_overrides(overrides)
    assert faster_compose.remembered() == held  # nothing parsed anew
    hydras = [faster_compose.HYDRA_PARSE_RULE(parser, s, "override") for s in overrides]
    assert first == again == hydras
    assert all(a is not b for a, b in zip(first, again))
    first[0].key_or_group = "changed"
    assert parser.parse_overrides(overrides[:1]) == hydras[:1]


def test_a_copied_config_repository_loads_through_the_live_config_store():
    """tests/faster_compose.py's other change: the deep copy that each composition makes of its
    repository (``CachingConfigRepository``) keeps the live ConfigStore, so that a config stored
    after the copy is found through it, and a load hands out a copy of the stored node."""
    from dataclasses import dataclass

    from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.config_store import ConfigStore

    import faster_compose

    assert faster_compose.structured_source_type().__deepcopy__ is faster_compose.copy_sharing_the_store
    search_path = ConfigSearchPathImpl()
    search_path.append("schema", "structured://")
    caching = CachingConfigRepository(ConfigRepository(search_path))
    (source,) = caching.delegate.get_sources()
    assert type(source) is faster_compose.structured_source_type() and source.store is ConfigStore.instance()

    @dataclass
    class StoredAfterTheCopy:
        width: int = 7

    store = ConfigStore.instance()
    store.store(name="normplug_test_stored_after_the_copy", node=StoredAfterTheCopy)
    try:
        loaded = caching.load_config("normplug_test_stored_after_the_copy")
        assert loaded is not None and loaded.config.width == 7
        loaded.config.width = 8
        assert store.load("normplug_test_stored_after_the_copy.yaml").node.width == 7
    finally:
        del store.repo["normplug_test_stored_after_the_copy.yaml"]


class _Caller:
    def method(self, detect, depth):
        return detect(depth)


def _function(detect, depth):
    return detect(depth)


def test_the_caller_of_hydras_initialize_is_found_as_hydra_finds_it():
    """tests/faster_compose.py's third change: hydra's modules call the one-frame lookup, which
    gives what hydra's ``inspect.stack()`` lookup gives at every depth, for a function, a method
    (its module through ``self``), this test and pytest's frames above it, and a lambda."""
    import hydra._internal.utils as hydra_utils

    import faster_compose

    for name in faster_compose.CALLERS_OF_DETECT:
        assert (sys.modules[name].detect_calling_file_or_module_from_stack_frame
                is faster_compose.calling_file_and_module), name
    found = set()
    for depth in range(1, 6):
        for call in (_function, _Caller().method, lambda detect, depth: detect(depth)):
            ours = call(faster_compose.calling_file_and_module, depth)
            assert ours == call(faster_compose.HYDRA_DETECT_CALLER, depth), (depth, call)
            found.add(ours)
    assert (__file__, __name__) in found and (os.path.abspath(__file__), None) in {
        (os.path.abspath(f), m) for f, m in found}  # a function's module, and a lambda's none
    assert len({f for f, _ in found}) > 2  # pytest's frames too
    assert hydra_utils.detect_calling_file_or_module_from_stack_frame(0)[0] == faster_compose.__file__


def test_a_fork_finds_most_of_its_commands_overrides_parsed_before_it(monkeypatch, tmp_path):
    """faster_compose.warm, called before each fork of a fairseq command or launcher
    (tests/inprocess.py): it parses the overrides of one tiny training command, once per process,
    and they are nearly all of another command's (another model, norm, learning rate and folder)."""
    from fairseq.dataclass.utils import override_module_args
    from model_helpers import parse_args
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import faster_compose

    monkeypatch.setattr(faster_compose, "_PARSED", {})
    monkeypatch.setattr(faster_compose, "_WARMED", False)
    faster_compose.warm()
    held = faster_compose.remembered()
    faster_compose.warm()
    assert faster_compose.remembered() == held > 200  # once
    args = parse_args(str(tmp_path / "bin"), "transformer_normplug_tiny", "--prenorm", "--dyt", "--optimizer", "adam",
                      "--lr", "5e-4", "--max-update", "7", "--save-dir", str(tmp_path / "run"))
    overrides, _ = override_module_args(args)
    OverridesParser.create().parse_overrides(overrides)
    assert faster_compose.remembered() - held < 0.1 * len(overrides)
