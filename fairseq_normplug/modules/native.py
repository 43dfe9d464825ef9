"""Native CPU fast paths (float32): C++ torch operators with their autograd in C++.

``csrc/norm_kernels.cpp`` defines ``torch.ops.normplug.scale_norm``, ``.rms_norm`` and
``.dynamic_tanh``: one pass over each row forward and one backward, per-channel gradients
summed per thread, tanh as a rational function (max relative error 4e-7). Operator, autograd
node and kernel are all C++, so a call costs what torch's own ``layer_norm`` costs (a Python
autograd function or a ctypes call adds 10-20 us, most of a decoding step's norm).

The library is built once per machine and torch installation (by ``scripts/setup_env.sh``, or
else on first use) with the system C++ compiler (``$CXX``, default ``c++``; OpenMP and
``-march=native`` when available) against the installed torch's headers (10-25 s), into
``$NORMPLUG_CACHE_DIR`` (default ``~/.cache/fairseq-normplug``), and loaded with
``torch.ops.load_library``. Concurrent processes (data-parallel workers) wait for one build.
``NORMPLUG_NATIVE=0`` disables it; where it cannot be built (no compiler, no torch headers) a
one-time warning says why and the other fast paths (``fused.py``) take over.
"""
import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Optional

import torch

from fairseq_normplug.atomic_files import move_into_place

logger = logging.getLogger(__name__)

NATIVE_ENV = "NORMPLUG_NATIVE"
CACHE_ENV = "NORMPLUG_CACHE_DIR"
SOURCE_PATH = os.path.join(os.path.dirname(__file__), "csrc", "norm_kernels.cpp")

SQUASH_CODES = {"tanh": 0, "hardtanh": 1, "sigmoid": 2}

FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)

_lock = threading.Lock()
_ops = None
_failure: Optional[str] = None
_enabled: Optional[bool] = None


def enabled() -> bool:
    """False when ``NORMPLUG_NATIVE`` is set to 0/false/no/off (read once per process)."""
    global _enabled
    if _enabled is None:
        value = os.environ.get(NATIVE_ENV, "1").strip().lower()
        _enabled = value not in ("0", "false", "no", "off")
    return _enabled


def _cache_dir() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                           "fairseq-normplug")
    return os.environ.get(CACHE_ENV, default)


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({l for l in f if l.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _torch_build_args():
    """Include, define and link arguments for building against the installed torch."""
    root = os.path.dirname(torch.__file__)
    lib = os.path.join(root, "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        f"-I{os.path.join(root, 'include')}",
        f"-I{os.path.join(root, 'include', 'torch', 'csrc', 'api', 'include')}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch",
    ]


@contextlib.contextmanager
def _build_lock(directory: str):
    """An exclusive lock on ``directory`` across processes (where fcntl exists)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builders may race, the atomic rename keeps it safe
        yield
        return
    with open(os.path.join(directory, "build.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> str:
    """Path of the built library (built now unless cached); raises with the compiler's words."""
    compiler = os.environ.get("CXX", "c++")
    with open(SOURCE_PATH) as f:
        source = f.read()
    errors = []
    for flags in FLAG_SETS:
        args = [compiler, *flags, "-std=c++17", "-fPIC", "-shared"]
        key = hashlib.sha256("\n".join(
            [source, *args, *_torch_build_args(), torch.__version__, sys.version,
             _cpu_signature()]).encode()).hexdigest()
        path = os.path.join(_cache_dir(), f"normplug_ops_{key[:20]}.so")
        if os.path.exists(path):
            return path
        os.makedirs(_cache_dir(), exist_ok=True)
        with _build_lock(_cache_dir()):
            if os.path.exists(path):  # another process built it while we waited
                return path
            logger.info("building the native norm kernels with %s %s (once per machine and "
                        "torch version, 10-25 s)", compiler, " ".join(flags))
            start = time.time()
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
                out = os.path.join(tmp, "ops.so")
                cmd = [*args, SOURCE_PATH, "-o", out, *_torch_build_args()]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                except (OSError, subprocess.SubprocessError) as exc:
                    errors.append(f"{' '.join(flags)}: {exc}")
                    continue
                if proc.returncode != 0:
                    errors.append(f"{' '.join(flags)}: {_first_error(proc.stderr)}")
                    continue
                move_into_place(out, path)  # no half-written library is ever loaded
            logger.info("built %s in %.1f s", path, time.time() - start)
            return path
    raise RuntimeError("; ".join(errors))


def _first_error(stderr: str) -> str:
    """The compiler's first error line (or its last words)."""
    lines = [l.strip() for l in stderr.splitlines() if "error" in l.lower()]
    return (lines[0] if lines else stderr.strip()[-300:])[:300]


def ops():
    """``torch.ops.normplug`` with the native operators loaded, or None (after one warning)
    where they cannot be built."""
    global _ops, _failure
    if _ops is None and _failure is None:
        with _lock:
            if _ops is None and _failure is None:
                try:
                    torch.ops.load_library(_build())
                    _ops = torch.ops.normplug
                except Exception as exc:  # no compiler, no headers, read-only cache...
                    _failure = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"fairseq-normplug: native CPU norm kernels unavailable "
                                  f"({_failure}); using the other fast paths", RuntimeWarning)
    return _ops


def failure() -> Optional[str]:
    """Why the kernels could not be built, or None."""
    return _failure


def usable(x: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a norm call with input ``x`` and parameters like ``param`` (a module's
    parameters share a dtype and device) can run natively: float32 on the CPU, not inside
    ``torch.compile`` tracing, and the library loads. Cheap: it runs on every call."""
    return (x.dtype is torch.float32 and param.dtype is torch.float32 and x.is_cpu
            and param.is_cpu and (_enabled if _enabled is not None else enabled())
            and not torch.compiler.is_compiling() and (_ops is not None or ops() is not None))
