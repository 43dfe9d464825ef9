"""The package as a user installs it, not the editable checkout: a wheel built from a copy of
this repository holds the C++ source and the configs, its metadata the licence and the one
version (``fairseq_normplug.__version__``), builds without setuptools warnings, and installs into
a fresh virtual environment, where, from outside the repository, fairseq-train loads the plugin
through ``--user-dir "$(fairseq-normplug-path)"`` and compiles the native kernels from the
installed C++ source, and the project's own jobs (prepare, reproduce, demo) run from the
packaged configs and write into the current directory.

The fresh environment sees torch, fairseq and the other requirements of the test environment
through a .pth file naming its site-packages (nothing is downloaded or reinstalled). Python does
not process .pth files inside a directory named that way, so the editable install's finder,
which would map ``fairseq_normplug`` back to the checkout, stays invisible; PYTHONPATH is unset.
"""
import csv
import json
import os
import shutil
import sys
import sysconfig
import zipfile

import pytest
from prepare_fixtures import write_pairs

import fairseq_normplug
from conftest import REPO, cli, run_cli
from fairseq_normplug import install_plan
from fairseq_normplug.modules import native

#: what setuptools prints when package data is declared badly (the old setup.py's csrc/)
SETUPTOOLS_WARNINGS = ("Package would be ignored", "BuildBackendWarning", "SetuptoolsDeprecationWarning",
                       "is absent from the `packages` configuration")
NOT_SHIPPED = (".venv", ".git", "data", "runs", "results", "build", "dist", "checkpoints", "*.egg-info",
               "__pycache__", ".pytest_cache")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(path of the wheel built from a copy of the checkout, the build's verbose output)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "checkout"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SHIPPED), symlinks=True)
    proc = run_cli([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-v", str(source), "-w", str(work / "dist")], cwd=str(work))
    (path,) = (work / "dist").glob("fairseq_normplug-*.whl")
    return path, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_wheel_holds_the_package_its_cpp_source_and_its_metadata(wheel):
    path, build_output = wheel
    warned = [w for w in SETUPTOOLS_WARNINGS if w in build_output]
    assert not warned, f"setuptools warned {warned}:\n{build_output[-3000:]}"
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "fairseq_normplug/modules/csrc/norm_kernels.cpp" in names
    configs = {n[len("fairseq_normplug/configs/"):] for n in names if n.startswith("fairseq_normplug/configs/")}
    assert configs == {os.path.relpath(os.path.join(d, f), os.path.join(REPO, "configs"))
                       for d, _, files in os.walk(os.path.join(REPO, "configs")) for f in files}
    assert f"Version: {fairseq_normplug.__version__}" in metadata.splitlines()
    assert "License-Expression: MIT" in metadata.splitlines() and "License-File: LICENSE" in metadata.splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    sources = {n for n in names if n.startswith("fairseq_normplug/") and n.endswith(".py")}
    in_checkout = {os.path.relpath(os.path.join(d, f), REPO)
                   for d, _, files in os.walk(os.path.join(REPO, "fairseq_normplug")) for f in files if f.endswith(".py")}
    assert sources == in_checkout  # every module, nothing else (no tests/, scripts/)
    assert not [n for n in names if not n.startswith(("fairseq_normplug/", "fairseq_normplug-"))]
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    assert f"torch>={install_plan.MIN_TORCH}" in requires and "tensorboardX" in requires
    assert not [r for r in requires if r.startswith(("fairseq", "torchaudio"))]
    assert 'submitit>=1.5; extra == "slurm"' in requires and 'pytest-timeout>=2.1; extra == "test"' in requires
    assert "fairseq-normplug-path = fairseq_normplug.cli:print_user_dir" in entry_points
    assert "fairseq-normplug-hydra-train = fairseq_normplug.hydra_train:cli_main" in entry_points
    assert "fairseq-normplug-ct2 = fairseq_normplug.export.ct2:main" in entry_points
    assert 'ctranslate2>=4.5; extra == "export"' in requires


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory):
    """A new virtual environment with only the wheel installed in it (no pip of its own: the
    test environment's pip, visible through the .pth file, installs it)."""
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    run_cli([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=str(root), timeout=120)
    python = venv / "bin" / "python"
    site = run_cli([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=str(root), timeout=60, env={"PYTHONPATH": None}).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "test_environment.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    env = isolated_env(venv, root)
    # fairseq's console scripts, as installing fairseq there would make them (the runner starts
    # fairseq-train and fairseq-generate from the bin/ of the running Python)
    for name in os.listdir(os.path.dirname(sys.executable)):
        if name.startswith("fairseq-") and name != "fairseq-normplug-path":
            with open(os.path.join(os.path.dirname(sys.executable), name), encoding="utf-8") as f:
                body = f.read().split("\n", 1)[1]
            launcher = venv / "bin" / name
            launcher.write_text(f"#!{python}\n{body}", encoding="utf-8")
            launcher.chmod(0o755)
    # --ignore-installed: the editable fairseq-normplug of the test environment is visible as
    # metadata; it must be neither taken as "already installed" nor uninstalled
    run_cli([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
             "--disable-pip-version-check", "--no-compile", "-q", str(wheel[0])], cwd=str(root), env=env, timeout=300)
    return venv, site, env


def isolated_env(venv, root) -> dict:
    """The environment (``run_cli``'s ``env``) of a command in ``venv``: its bin/ first on PATH,
    no PYTHONPATH, and a native-kernel cache of its own (so the build really happens)."""
    return {"PYTHONPATH": None, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv), "NORMPLUG_CACHE_DIR": str(root / "kernel-cache"), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_fairseq_train_with_the_installed_plugin_from_anywhere(fresh_venv, tiny_bin, tmp_path):
    venv, site, env = fresh_venv
    # fairseq-normplug-path once (the installed package's folder): printed, then given to fairseq-train
    script = ('USER_DIR="$(fairseq-normplug-path)" && echo "$USER_DIR" && '
              'python -m fairseq_cli.train "$DATA" --user-dir "$USER_DIR" '
              "--arch transformer_normplug_tiny --prenorm --scalenorm --optimizer adam --lr 1e-3 "
              "--max-tokens 1000 --max-update 3 --cpu --num-workers 0 --no-save --disable-validation "
              "--log-format json --log-interval 1 && "
              'python -c "from importlib.util import find_spec as f; print(f(\'fairseq_normplug\').origin); '
              'print(f(\'fairseq\').origin)"')  # where they are imported from (without importing)
    proc = run_cli(["bash", "-c", script], cwd=str(tmp_path), env={**env, "DATA": tiny_bin}, timeout=900)
    user_dir = proc.stdout.splitlines()[0].strip()
    assert user_dir == os.path.join(site, "fairseq_normplug")
    assert os.path.isfile(os.path.join(user_dir, "modules", "csrc", "norm_kernels.cpp"))
    log = proc.stdout + proc.stderr
    records = [json.loads(line.split("| train | ", 1)[1]) for line in log.splitlines() if "| train | " in line]
    assert records and records[-1]["train_num_updates"] == "3"
    # the kernels were compiled here, from the C++ source the wheel installed
    assert "building the native norm kernels with" in log
    built = [name for name in os.listdir(env["NORMPLUG_CACHE_DIR"]) if name.endswith(".so")]
    assert len(built) == 1, os.listdir(env["NORMPLUG_CACHE_DIR"])
    plugin_path, fairseq_path = proc.stdout.strip().splitlines()[-2:]
    assert plugin_path == os.path.join(user_dir, "__init__.py")  # so native.SOURCE_PATH is the wheel's
    assert not fairseq_path.startswith(str(venv))  # fairseq is the test environment's, not reinstalled
    assert not os.path.commonpath([user_dir, REPO]) == REPO


@pytest.mark.slow
def test_the_projects_jobs_run_from_the_installed_wheel_outside_the_repository(fresh_venv, tmp_path):
    """prepare (its BPE size from the packaged configs/bpe.json), reproduce's --print-commands
    and the demo (tests/tiny_demo.py: one row, 4 updates) from the wheel, in a folder outside
    the repository: each reads the packaged configs and writes data/, runs/, results/ there."""
    venv, site, env = fresh_venv
    project, raw = tmp_path / "project", tmp_path / "corpus" / "raw"
    project.mkdir()
    for split, count in (("train", 40), ("valid", 5), ("test", 5)):
        write_pairs(str(raw), split, [(f"a b {i} .", f"x y {i} .") for i in range(count)], "src", "tgt")
    python = str(venv / "bin" / "python")

    # the native kernels from the cache the rest of the suite uses (built here if no test built them yet): the
    # wheel's C++ source is the checkout's, so the library is the same one; the build is the other test's subject
    kernel_cache = native._cache_dir()

    def run(*argv):
        return run_cli([python, *argv], cwd=str(project), env={**env, "NORMPLUG_CACHE_DIR": kernel_cache},
                       timeout=600)

    run("-m", "fairseq_normplug.prepare.corpus", str(raw), "--src", "src", "--tgt", "tgt", "--tokenized",
        "--workers", "1")
    prepared = project / "data" / "corpus" / "src-tgt"
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["recipe"]["bpe_merges"] == 8000  # configs/bpe.json's default, read from the wheel
    printed = run("-m", "fairseq_normplug.experiments.reproduce", "demo", "--print-commands",
                  "--data", f"src-tgt={prepared}").stdout
    assert f"--user-dir {os.path.join(site, 'fairseq_normplug')} " in printed
    assert f"run folder: {project / 'runs' / 'demo' / 'src-tgt' / 'postnorm-layernorm-warmup'}" in printed
    demo = run(os.path.join(REPO, "tests", "tiny_demo.py"), "--corpus", str(raw), "--src", "src", "--tgt", "tgt",
               "--tokenized", "--bpe-merges", "30", "--preset", "tiny")
    assert f"results in {project / 'results' / 'demo'}" in demo.stdout
    (row,) = list(csv.DictReader(open(project / "results" / "demo" / "results.csv", newline="")))
    assert row["status"] == "ok" and int(row["updates"]) == 4
    assert [p.name for p in (project / "data").iterdir()] and not os.path.exists(os.path.join(site, "data"))


def test_the_path_printer_imports_neither_torch_nor_fairseq(tmp_path):
    """``fairseq-normplug-path`` (README: ``--user-dir "$(fairseq-normplug-path)"`` on every
    command) prints the package's folder without importing torch or fairseq (3 CPU s each)."""
    proc = run_cli([sys.executable, "-X", "importtime", cli("fairseq-normplug-path")], cwd=str(tmp_path))
    assert proc.stdout.strip() == os.path.dirname(fairseq_normplug.__file__)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "fairseq_normplug.cli" in imported and not imported & {"torch", "fairseq", "fairseq_normplug.models"}


def test_the_licence_the_citation_and_one_version():
    """LICENSE (MIT, as the metadata says), CITATION.cff citing both papers and the project, and
    the version written only in fairseq_normplug/__init__.py (pyproject.toml reads it there)."""
    import yaml

    with open(os.path.join(REPO, "LICENSE"), encoding="utf-8") as f:
        assert f.readline().strip() == "MIT License"
    with open(os.path.join(REPO, "CITATION.cff"), encoding="utf-8") as f:
        citation = yaml.safe_load(f)
    assert (citation["license"], citation["type"]) == ("MIT", "software")
    assert citation["title"].startswith("fairseq-normplug")
    assert [(r["title"], r["year"], r["authors"][0]["family-names"]) for r in citation["references"]] == [
        ("Transformers without Tears: Improving the Normalization of Self-Attention", 2019, "Nguyen"),
        ("Transformers without Normalization", 2025, "Zhu")]
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    assert 'dynamic = ["version", "license"]' in pyproject
    assert 'version = {attr = "fairseq_normplug.__version__"}' in pyproject
    for name in ("pyproject.toml", "setup.py", "README.md", "CITATION.cff", "hubconf.py"):
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            assert fairseq_normplug.__version__ not in f.read(), f"{name} repeats the version"
