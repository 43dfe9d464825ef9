"""Shared fixtures (a tiny synthetic parallel corpus: raw, binarized with a joined dictionary,
and prepared by scripts/prepare_corpus.sh) and the helpers that run commands.

Commands run with a timeout, and a fallback of the plugin's fast paths is a failure unless a
test says it expects one: the plugin's "falls back" warnings (``FALLBACK_WARNING``) fail
``run_cli``/``run_parallel`` when they appear in a command's output, and are errors inside
this process (``pytest_configure``). On a machine without a C++ compiler the fallback is the
documented behaviour, and neither check applies.
"""
import contextlib
import functools
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import cpu_durations
import faster_compose
from cpu_durations import pytest_addoption  # noqa: F401  (--cpu-durations=N: the tests by CPU time)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_DIR = os.path.dirname(sys.executable)
#: the real corpora (read only): ../shared/data beside the checkout, or $NORMPLUG_SHARED_DATA
SHARED_DATA = os.environ.get("NORMPLUG_SHARED_DATA") or os.path.join(os.path.dirname(REPO), "shared", "data")

#: the plugin's warnings when a fast path falls back (modules/native.py, modules/fused.py)
FALLBACK_WARNING = re.compile(r"fairseq-normplug: (native CPU norm kernels unavailable|"
                              r"torch\.compile of \S+ failed)[^\n]*")
#: without a C++ compiler the native kernels and torch.compile's CPU code cannot be built
FALLBACK_EXPECTED = shutil.which(os.environ.get("CXX", "c++")) is None
#: a subprocess's default limit (below pytest-timeout's, pyproject.toml, so it fails first)
COMMAND_TIMEOUT = 600


def pytest_configure(config):
    cpu_durations.register(config)
    faster_compose.install()  # hydra composes each in-process fairseq command faster (tests/faster_compose.py)
    if not FALLBACK_EXPECTED:  # '.' for ':' (a ':' would end the message field)
        config.addinivalue_line(
            "filterwarnings",
            r"error:fairseq-normplug. (native CPU norm kernels unavailable|torch\.compile of):RuntimeWarning")


def pytest_collection_finish(session):
    """The cyclic garbage collector tuned for a test process, once its tests are collected: the
    objects alive then (torch, fairseq, the test modules) are frozen out of its view, and it runs
    less often (a generation-0 pass every 10,000 allocations, not 700; a full pass after 100
    generation-1 passes, not 10). On six of the heaviest test files in one process its CPU fell
    from 4.3 s to 1.9 s of about 70 s (docs/setup.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)


@pytest.fixture(scope="session", autouse=True)
def scripts_use_this_environment():
    """The scripts a test runs (scripts/*.sh call scripts/setup_env.sh first) use the
    environment the tests run in, as it is: set-up never installs anything during a test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NORMPLUG_SETUP", "0")
        patch.setenv("NORMPLUG_VENV", os.path.dirname(BIN_DIR))
        yield


@contextlib.contextmanager
def registrations_restored():
    """The plugin's registries (norm types, placements, modifiers, loaded extensions) as they
    were, when the block ends: what it registered is gone, and an extension it loaded leaves
    ``sys.modules`` with its submodules, so that a later load imports it, and registers it, again."""
    from fairseq_normplug import extensions
    from fairseq_normplug.models.placements.base import MODIFIERS, PLACEMENTS
    from fairseq_normplug.modules.norm_registry import NORM_TYPES

    registries = (NORM_TYPES, PLACEMENTS, MODIFIERS, extensions.LOADED)
    saved = [dict(registry) for registry in registries]
    try:
        yield
    finally:
        added = set(extensions.LOADED) - set(saved[-1])
        submodules = tuple(f"{name}." for name in added)
        for name in [name for name in sys.modules if name in added or name.startswith(submodules)]:
            del sys.modules[name]
        for registry, before in zip(registries, saved):
            registry.clear()
            registry.update(before)


@pytest.fixture(scope="module", autouse=True)
def registrations_undone():
    """What a test module registers is gone when the module ends (``registrations_restored``): a
    later module that loops over every registered norm type builds the package's, whichever
    modules ran before it on the same worker (a test norm whose ``formula`` needs a parameter it
    lacks failed them when one process ran the whole suite)."""
    with registrations_restored():
        yield


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves this process's environment as it found it, even one that changes it
    in-process (a benchmark's main sets its allocator variables): the commands of later tests
    get the session's environment."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def cli(name: str) -> str:
    """Path of a console script of the running environment (fairseq-train, ...)."""
    return os.path.join(BIN_DIR, name)


def command_env(env=None) -> dict:
    """The environment of a test's command: this one, without a PYTHONWARNINGS that could hide
    the plugin's warnings (unless ``env`` sets one), updated by ``env`` (None: unset)."""
    out = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def assert_no_fallback(output: str, what) -> None:
    """Fail when ``output`` holds one of the plugin's fallback warnings."""
    found = FALLBACK_WARNING.search(output)
    if found and not FALLBACK_EXPECTED:
        raise AssertionError(f"unexpected fallback in {what}: {found.group(0)}")


def failure_report(proc) -> str:
    return (f"command failed ({proc.returncode}): {' '.join(map(str, proc.args))}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")


def run_cli(args, cwd=REPO, check=True, timeout=COMMAND_TIMEOUT, env=None, input=None,
            fallback_ok=False):
    """Run a command, return the CompletedProcess; on failure show its output. A fast-path
    fallback warning in its output fails the test unless ``fallback_ok``."""
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=command_env(env), input=input)
    if check and proc.returncode != 0:
        raise AssertionError(failure_report(proc))
    if not fallback_ok:
        assert_no_fallback(proc.stdout + proc.stderr, args[0])
    return proc


def _kill(proc) -> None:
    """Kill ``proc`` and whatever it started (when it leads its own process group; else, as a
    forked command of this process's group, ``proc`` alone)."""
    if proc.poll() is None:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except ProcessLookupError:
            pass
    proc.wait()


def run_parallel(commands, cwd=REPO, timeout=COMMAND_TIMEOUT, env=None, fallback_ok=False,
                 peers=True, start=None):
    """Run ``commands`` at the same time and return their CompletedProcess objects, in order.
    ``peers`` (the processes of one job): when one fails the others are killed at once (e.g.
    the surviving data-parallel rank, which would wait for its peer forever). All are killed
    when ``timeout`` seconds have passed (an AssertionError with their output). ``start``:
    what starts each command (``start(command, cwd=, env=, stdout=, stderr=, text=True)``, a
    ``subprocess.Popen``; tests/inprocess.py's ``run_forked`` gives its forks); by default a
    real process leading a process group of its own (killed with what it started)."""
    start = start or functools.partial(subprocess.Popen, start_new_session=True)
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    procs = [start([str(a) for a in command], cwd=cwd, env=command_env(env), stdout=out, stderr=err, text=True)
             for command, (out, err) in zip(commands, outputs)]
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if peers and any(p.returncode not in (None, 0) for p in procs):
                break  # one failed: the others are killed below
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            _kill(proc)
    done = []
    for command, proc, (out, err) in zip(commands, procs, outputs):
        out.seek(0), err.seek(0)
        done.append(subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read()))
        out.close(), err.close()
    if timed_out:
        raise AssertionError(f"still running after {timeout} s, killed:\n"
                             + "\n".join(failure_report(p) for p in done))
    if not fallback_ok:
        for proc in done:
            assert_no_fallback(proc.stdout + proc.stderr, proc.args[0])
    return done


def write_configs(dest, recipes=None, tables=None) -> str:
    """A copy of the project's configs/ at ``dest`` with extra ``recipes`` ({name: recipe}) in
    recipes.json and extra ``tables`` ({name: table}) in experiments/; returns its path."""
    from fairseq_normplug.experiments.configs import CONFIG_DIR

    shutil.copytree(CONFIG_DIR, dest)
    recipes_path = os.path.join(dest, "recipes.json")
    with open(recipes_path) as f:
        all_recipes = json.load(f)
    with open(recipes_path, "w") as f:
        json.dump({**all_recipes, **(recipes or {})}, f)
    for name, table in (tables or {}).items():
        with open(os.path.join(dest, "experiments", f"{name}.json"), "w") as f:
            json.dump(table, f)
    return str(dest)


@pytest.fixture(scope="session")
def tiny_raw(tmp_path_factory):
    """Raw synthetic corpus: 2,000 train / 100 valid / 100 test pairs, langs src/tgt."""
    from fairseq_normplug.synthetic_corpus import write_corpus

    return write_corpus(str(tmp_path_factory.mktemp("raw")), train=2000, valid=100, test=100,
                        vocab_size=60)


@pytest.fixture(scope="session")
def tiny_bin(tiny_raw, tmp_path_factory):
    """``tiny_raw`` binarized by fairseq-preprocess (in this process) with a joined dictionary."""
    from inprocess import run_fairseq

    dest = str(tmp_path_factory.mktemp("bin"))
    run_fairseq([
        "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", f"{tiny_raw}/train", "--validpref", f"{tiny_raw}/valid",
        "--testpref", f"{tiny_raw}/test", "--destdir", dest, "--joined-dictionary",
        "--workers", "1",
    ])
    return dest


@pytest.fixture(scope="session")
def tiny_prepared(tiny_raw, tmp_path_factory):
    """``tiny_raw`` prepared as scripts/prepare_corpus.sh prepares it (30 BPE merges): a data
    folder with bin/, ref/ and manifest.json, as the experiment scripts take it. The script's
    Python entry point runs in this process, its fairseq-preprocess in a fork of it
    (tests/inprocess.py); test_prepare runs the script itself."""
    from inprocess import forked_commands

    from fairseq_normplug.prepare import corpus
    from fairseq_normplug.prepare.cli import run_main

    dest = str(tmp_path_factory.mktemp("prepared") / "src-tgt")
    with forked_commands():
        run_main(corpus.PROG, corpus.main, [tiny_raw, "--src", "src", "--tgt", "tgt", "--tokenized",
                                            "--bpe-merges", "30", "--dest", dest, "--workers", "1"])
    return dest


@pytest.fixture(scope="session")
def tiny_data_dir(tiny_raw, tiny_bin, tmp_path_factory):
    """``tiny_bin`` laid out as a prepared data folder (bin/, ref/test.tok.tgt, a manifest.json
    naming subword_nmt), without ``tiny_prepared``'s preparation (BPE learning, a fairseq-preprocess
    process): for tests that need a data folder's layout and dictionaries,
    not its subword segmentation (refusals before training, the commands a recipe gives, the
    experiment runner's tiny tables)."""
    data = tmp_path_factory.mktemp("data") / "src-tgt"
    shutil.copytree(tiny_bin, data / "bin")
    os.makedirs(data / "ref")
    shutil.copyfile(os.path.join(tiny_raw, "test.tgt"), data / "ref" / "test.tok.tgt")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return str(data)
