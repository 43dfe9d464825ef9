"""What scripts/setup_env.sh installs, in one place: the torch build it chooses (CPU or
CUDA), the fairseq release it builds, and the torch floor that the import checks enforce
(``pyproject.toml`` declares the same floor, checked by tests/test_install.py; the other
requirements are listed there only).

Standard library only, Python 3.8 syntax, no package import: ``scripts/setup_env.sh`` runs it
as a script with the system Python, before any torch exists, and the plugin imports it when it
is loaded::

    python fairseq_normplug/install_plan.py torch          # spec, index URL, expected build
    python fairseq_normplug/install_plan.py fairseq        # the fairseq requirement to build
    python fairseq_normplug/install_plan.py check-report REPORT.json   # pip --dry-run --report
    python fairseq_normplug/install_plan.py check-installed cpu|cuda|user

Choosing torch (:func:`choose_torch`): ``NORMPLUG_TORCH_INDEX`` set: that index, as given. An
NVIDIA driver present (:func:`cuda_present`): the default index, whose Linux x86_64 torch is
a CUDA build. No driver: the CPU index (``CPU_INDEX``) where it answers, else the default
index, but only after a dry run showed that it would not bring a CUDA build (a multi-GB
download useless without a GPU): set-up then stops with one line naming the overrides.
"""
import json
import os
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional

#: the oldest torch the code runs on (pyproject.toml declares the same floor):
#: torch.compiler.is_compiling() (2.3) is called on every norm call. Optional newer APIs (used
#: only where present): add_safe_globals (2.4, checkpoint loading under torch >= 2.6),
#: torch._dynamo.config.recompile_limit (renamed in 2.6).
MIN_TORCH = "2.3"
DEFAULT_TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"

#: fairseq is not an install requirement: its metadata requires torchaudio, which pins (and so
#: replaces) torch. It is built with ``pip install --no-deps --no-build-isolation``; its real
#: runtime requirements are the plugin's own (``pyproject.toml``).
FAIRSEQ_PY311 = "fairseq-fixed==0.12.3.1"   # a Python 3.11 build of fairseq's main branch
FAIRSEQ_OLDER_PY = "fairseq==0.12.2"         # official fairseq does not import on 3.11
OVERRIDES_HINT = ("set NORMPLUG_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu, or "
                  "https://download.pytorch.org/whl/cu126 for a GPU) or NORMPLUG_TORCH")


class TorchPlan(NamedTuple):
    spec: str      # requirement, e.g. torch==2.13.0
    index: str     # --index-url, "" for pip's configured default
    expect: str    # "cpu", "cuda" or "user" (an index the user chose: not checked)
    reason: str    # one line for the set-up log


def fairseq_requirement(version_info=sys.version_info) -> str:
    """The fairseq release that imports on this Python."""
    return FAIRSEQ_PY311 if tuple(version_info[:2]) >= (3, 11) else FAIRSEQ_OLDER_PY


def version_tuple(version: str):
    """(major, minor) of a version string such as ``2.13.0+cpu`` or ``2.3``."""
    parts = version.split("+")[0].split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:2])


def torch_too_old(version: str) -> Optional[str]:
    """A one-line message when torch ``version`` is below ``MIN_TORCH``, else None."""
    if version_tuple(version) >= version_tuple(MIN_TORCH):
        return None
    return (f"fairseq-normplug needs torch >= {MIN_TORCH}, found {version}; upgrade it "
            f"(scripts/setup_env.sh, or pip install 'torch>={MIN_TORCH}')")


def fairseq_missing_message() -> str:
    return (f"fairseq-normplug needs fairseq, which is not installed: run scripts/setup_env.sh, "
            f"or pip install cython numpy && pip install --no-deps --no-build-isolation "
            f"{fairseq_requirement()} (--no-deps: fairseq's metadata would replace torch)")


def check_requirements() -> None:
    """Raise ImportError with one line naming the fix when fairseq is missing or torch is
    older than ``MIN_TORCH`` (run when the plugin is imported)."""
    try:
        import fairseq  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "fairseq":
            raise
        raise ImportError(fairseq_missing_message()) from None
    import torch

    too_old = torch_too_old(torch.__version__)
    if too_old:
        raise ImportError(too_old)


def cuda_present(which: Callable = shutil.which, run: Callable = subprocess.run,
                 driver_file: str = NVIDIA_DRIVER_FILE) -> bool:
    """Whether this machine has an NVIDIA GPU with its driver: ``nvidia-smi -L`` lists a GPU,
    or the kernel driver's version file exists. ``NORMPLUG_CUDA=0/1`` in the environment
    overrides the probe (see :func:`main`)."""
    smi = which("nvidia-smi")
    if smi:
        try:
            proc = run([smi, "-L"], capture_output=True, text=True, timeout=20)
            if proc.returncode == 0 and "GPU" in proc.stdout:
                return True
        except (OSError, subprocess.SubprocessError):
            pass
    return os.path.exists(driver_file)


def index_reachable(url: str = CPU_INDEX, timeout: float = 5.0) -> bool:
    """Whether the package index ``url`` answers for torch."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as response:
            return response.status == 200
    except Exception:  # any failure (DNS, proxy, TLS, HTTP error) means: not usable here
        return False


def choose_torch(env: Mapping[str, str], cuda: bool,
                 cpu_index_reachable: Callable[[], bool]) -> TorchPlan:
    """Which torch to install: see the module docstring. ``cpu_index_reachable`` is called
    only when the CPU index is a candidate."""
    spec = env.get("NORMPLUG_TORCH") or DEFAULT_TORCH
    index = env.get("NORMPLUG_TORCH_INDEX", "")
    if index:
        return TorchPlan(spec, index, "user", f"NORMPLUG_TORCH_INDEX={index}")
    if cuda:
        return TorchPlan(spec, "", "cuda", "NVIDIA driver found: the default index's build "
                                           "(a CUDA build on Linux x86_64)")
    if cpu_index_reachable():
        return TorchPlan(spec, CPU_INDEX, "cpu", f"no NVIDIA driver: the CPU build from {CPU_INDEX}")
    return TorchPlan(spec, "", "cpu", f"no NVIDIA driver, {CPU_INDEX} unreachable: the default "
                                      f"index, provided it serves a CPU build")


def cuda_packages(report: Dict) -> List[str]:
    """The CUDA builds a ``pip install --dry-run --report`` would install: nvidia-* runtime
    wheels and local versions like ``+cu126``/``+rocm6.2``."""
    found = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = meta.get("name", ""), meta.get("version", "")
        if name.lower().startswith("nvidia-") or "+cu" in version or "+rocm" in version:
            found.append(f"{name}=={version}")
    return found


def check_installed(expect: str) -> str:
    """One line about the installed torch; raises SystemExit when a CPU build was expected
    and a CUDA build is there. Needs torch (run with the environment's Python)."""
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    line = f"torch {torch.__version__} ({build} build)"
    too_old = torch_too_old(torch.__version__)
    if too_old:
        raise SystemExit(too_old)
    if expect == "cpu" and torch.version.cuda:
        raise SystemExit(f"{line} on a machine without an NVIDIA driver; {OVERRIDES_HINT}")
    if expect == "cuda" and not torch.cuda.is_available():
        line += (f"; WARNING: torch sees no GPU (driver older than this CUDA build?): "
                 f"{OVERRIDES_HINT}")
    return line


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    if command == "torch":
        forced = os.environ.get("NORMPLUG_CUDA", "").strip()
        cuda = forced == "1" if forced in ("0", "1") else cuda_present()
        plan = choose_torch(os.environ, cuda, index_reachable)
        print("\n".join(plan))
    elif command == "fairseq":
        print(fairseq_requirement())
    elif command == "check-report":
        with open(argv[1]) as f:
            found = cuda_packages(json.load(f))
        if found:
            print(f"the default index would install a CUDA build ({', '.join(found[:3])}) on a "
                  f"machine without an NVIDIA driver; {OVERRIDES_HINT}", file=sys.stderr)
            return 1
    elif command == "check-installed":
        print(check_installed(argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
