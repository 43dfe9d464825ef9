"""The install is what the README says: the torch build set-up chooses (with and without
CUDA, without installing anything), the version floor (one value in install_plan.py and
pyproject.toml), and `pip install .` keeping torch. Set-up itself: tests/test_setup_env.py;
the built wheel: tests/test_wheel.py."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from fairseq_normplug import install_plan
from fairseq_normplug.install_plan import CPU_INDEX, choose_torch, cuda_packages, cuda_present

PLAN_PY = os.path.join(REPO, "fairseq_normplug", "install_plan.py")


def never_probed():
    raise AssertionError("the CPU index must not be probed here")


def test_torch_choice_without_cuda_takes_the_cpu_index_when_it_answers():
    plan = choose_torch({}, cuda=False, cpu_index_reachable=lambda: True)
    assert (plan.spec, plan.index, plan.expect) == ("torch==2.13.0", CPU_INDEX, "cpu")


def test_torch_choice_without_cuda_falls_back_to_the_default_index_but_expects_cpu():
    plan = choose_torch({"NORMPLUG_TORCH": "torch==2.6.0"}, cuda=False,
                        cpu_index_reachable=lambda: False)
    assert (plan.spec, plan.index, plan.expect) == ("torch==2.6.0", "", "cpu")


def test_torch_choice_with_cuda_takes_the_default_index():
    plan = choose_torch({}, cuda=True, cpu_index_reachable=never_probed)
    assert (plan.index, plan.expect) == ("", "cuda")


def test_a_user_index_is_used_as_given():
    env = {"NORMPLUG_TORCH": "torch==2.6.0", "NORMPLUG_TORCH_INDEX": "https://x/cu124"}
    for cuda in (False, True):
        plan = choose_torch(env, cuda=cuda, cpu_index_reachable=never_probed)
        assert (plan.spec, plan.index, plan.expect) == ("torch==2.6.0", "https://x/cu124", "user")


class FakeRun:
    def __init__(self, returncode, stdout):
        self.calls = []
        self.returncode, self.stdout = returncode, stdout

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, self.returncode, self.stdout, "")


def test_cuda_probe(tmp_path):
    no_driver = str(tmp_path / "no-such-file")
    assert not cuda_present(which=lambda name: None, driver_file=no_driver)
    gpu = FakeRun(0, "GPU 0: NVIDIA H200 (UUID: GPU-1)\n")
    assert cuda_present(which=lambda name: "/usr/bin/nvidia-smi", run=gpu, driver_file=no_driver)
    assert gpu.calls == [["/usr/bin/nvidia-smi", "-L"]]
    broken_smi = FakeRun(9, "NVIDIA-SMI has failed")
    assert not cuda_present(which=lambda name: "/x/nvidia-smi", run=broken_smi,
                            driver_file=no_driver)
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 550\n")
    assert cuda_present(which=lambda name: None, driver_file=str(driver))


@pytest.mark.parametrize("env,plan", [
    ({"NORMPLUG_CUDA": "1"}, ["torch==2.13.0", "", "cuda"]),
    ({"NORMPLUG_CUDA": "0", "NORMPLUG_TORCH_INDEX": CPU_INDEX, "NORMPLUG_TORCH": "torch==2.6.0"},
     ["torch==2.6.0", CPU_INDEX, "user"]),
])
@pytest.mark.slow
def test_setup_env_plan_from_the_command_line(env, plan):
    """What scripts/setup_env.sh reads: spec, index, expected build and a reason, one a line
    (the driver probe forced by NORMPLUG_CUDA; these two need no network)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NORMPLUG_TORCH")}, **env}
    out = subprocess.run([sys.executable, PLAN_PY, "torch"], capture_output=True, text=True,
                         env=env, check=True, timeout=60).stdout.split("\n")
    assert out[:3] == plan and out[3]


CUDA_REPORT = {"install": [
    {"metadata": {"name": "torch", "version": "2.13.0"}},
    {"metadata": {"name": "nvidia-cublas-cu12", "version": "12.6.4.1"}},
]}
CPU_REPORT = {"install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu"}},
                          {"metadata": {"name": "sympy", "version": "1.14.0"}}]}


@pytest.mark.slow
def test_a_cuda_build_from_the_default_index_is_refused_before_download(tmp_path):
    assert cuda_packages(CUDA_REPORT) == ["nvidia-cublas-cu12==12.6.4.1"]
    assert cuda_packages({"install": [{"metadata": {"name": "torch",
                                                    "version": "2.6.0+cu124"}}]})
    assert cuda_packages(CPU_REPORT) == []
    for report, rc in ((CUDA_REPORT, 1), (CPU_REPORT, 0)):
        path = tmp_path / "report.json"
        path.write_text(json.dumps(report))
        proc = subprocess.run([sys.executable, PLAN_PY, "check-report", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == rc
        assert ("NORMPLUG_TORCH_INDEX" in proc.stderr) == (rc == 1)


def test_torch_floor():
    assert install_plan.torch_too_old("2.13.0+cpu") is None
    assert install_plan.torch_too_old("2.3.0") is None
    assert "needs torch >= 2.3, found 2.2.2" in install_plan.torch_too_old("2.2.2")
    assert "found 1.13.1+cu117" in install_plan.torch_too_old("1.13.1+cu117")


@pytest.mark.slow
def test_missing_fairseq_names_the_command_that_installs_it():
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; sys.modules['fairseq'] = None; import fairseq_normplug"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fairseq-normplug needs fairseq")
    assert "pip install --no-deps --no-build-isolation fairseq-fixed==0.12.3.1" in last


@pytest.mark.slow
def test_pip_install_from_a_clone_keeps_torch(tmp_path):
    """Resolve `pip install .` in this environment (a dry run): nothing replaces torch, and
    the metadata carries the real floor and no fairseq (whose torchaudio would pin torch)."""
    if not install_plan.index_reachable("https://pypi.org/simple"):
        pytest.skip("PyPI not reachable")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
         "--report", str(report), REPO], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in installs}
    assert not names & {"torch", "torchaudio", "torchvision"}
    assert not [n for n in names if n.startswith("nvidia-")]
    ours = next(item["metadata"] for item in installs
                if item["metadata"]["name"] == "fairseq-normplug")
    requires = ours["requires_dist"]
    assert f"torch>={install_plan.MIN_TORCH}" in requires
    assert "tensorboardX" in requires
    assert not [r for r in requires if r.startswith("fairseq")]


def read_pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pyproject_and_install_plan_agree():
    """The torch floor is written in install_plan.py (set-up, import check) and pyproject.toml
    (package metadata): one value. fairseq stays out of the metadata; the extras are there."""
    project = read_pyproject()["project"]
    requires = project["dependencies"]
    assert [r for r in requires if r.split(">")[0].split("=")[0].strip() == "torch"] == [
        f"torch>={install_plan.MIN_TORCH}"]
    assert not [r for r in requires if r.startswith(("fairseq", "torchaudio", "torchvision"))]
    extras = project["optional-dependencies"]
    assert {r.split(">")[0] for r in extras["test"]} == {"pytest", "pytest-timeout", "pytest-xdist", "submitit"}
    assert extras["slurm"] == ["submitit>=1.5"]
    assert extras["export"] == ["ctranslate2>=4.5"]
    assert project["scripts"] == {"fairseq-normplug-path": "fairseq_normplug.cli:print_user_dir",
                                  "fairseq-normplug-hydra-train": "fairseq_normplug.hydra_train:cli_main",
                                  "fairseq-normplug-ct2": "fairseq_normplug.export.ct2:main"}


def test_every_test_has_a_time_limit(request):
    """pytest-timeout is active with pyproject.toml's limit (a hang fails one test)."""
    assert request.config.pluginmanager.hasplugin("timeout")
    assert float(request.config.getini("timeout")) == read_pyproject()["tool"]["pytest"]["ini_options"]["timeout"]
