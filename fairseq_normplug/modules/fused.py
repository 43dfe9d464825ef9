"""Machinery shared by the fast paths of ScaleNorm, RMSNorm and DyT.

A norm call takes the first suitable of three paths:

1. ``native``: CPU float32 tensors run the C++ operators of ``native.py`` (forward, backward
   and autograd node in C++, one pass per row each way), whatever their size.
2. ``compiled``: other tensors with at least ``NORMPLUG_COMPILE_MIN_NUMEL`` elements
   (default 65536; GPU, fp16/bf16 on CPU, or CPU float32 when the native operators are off)
   run the norm's Python forward and hand-derived backward ("kernels": plain tensor functions
   on a contiguous ``(rows, dim)`` view, wrapped in :class:`Kernel`) through ``torch.compile``
   (inductor: fused loops on CPU, triton on GPU). The row dimension is marked dynamic, so
   NMT's variable batch shapes compile once per (kernel, width, dtype, device), not once per
   batch; compiled code is cached on disk by inductor, so later processes start in about a
   second.
3. ``eager``: everything else (float64, e.g. gradcheck; small tensors, where a compiled
   call's fixed cost of about 20 us dominates) runs the same kernels op by op.

``NORMPLUG_NATIVE=0`` and ``NORMPLUG_COMPILE=0`` switch paths 1 and 2 off for a process,
:func:`disable` for a block. A path that fails to build (no C++ compiler, no triton, an
unsupported platform) is reported once as a warning and skipped from then on; an error
while a built kernel runs (out of memory, bad input) is raised, never swallowed.
"""
import contextlib
import logging
import os
import warnings

import torch

from fairseq_normplug.modules import native

logger = logging.getLogger(__name__)

COMPILE_ENV = "NORMPLUG_COMPILE"
MIN_NUMEL_ENV = "NORMPLUG_COMPILE_MIN_NUMEL"
DEFAULT_MIN_NUMEL = 65536

# One compiled graph per (kernel, width, dtype, device, squash): allow more than dynamo's
# default 8 per function (a GPU benchmark of 3 dtypes x 2 widths x 3 squashes needs 18).
RECOMPILE_LIMIT = 64


def dynamo():
    """``torch._dynamo``, imported on the first compiled call (importing it costs every process
    that loads the plugin about a second), with :data:`RECOMPILE_LIMIT` set."""
    import torch._dynamo

    if getattr(torch._dynamo.config, "recompile_limit", RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    return torch._dynamo

# Rational approximation of tanh on [-c, c] (the float32 "fast tanh" of Eigen/XLA):
# tanh(x) ~ x * P(x^2) / Q(x^2); max relative error 4e-7 over all float32 inputs.
_TANH_CLAMP = 7.90531110763549805
_TANH_P = (
    4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
    -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16,
)
_TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)

_disabled = set()

#: what compiling a kernel raises when it cannot be built (no C++ compiler, no triton,
#: an unsupported operator): dynamo's and inductor's own exceptions (``InductorError``
#: and ``BackendCompilerFailed`` derive from ``TorchDynamoException``). Anything else
#: raised by a compiled call, e.g. out of memory while it runs, is a runtime error and
#: propagates.
def build_errors() -> tuple:
    """What compiling a kernel raises when it cannot be built (the comment above)."""
    return (dynamo().exc.TorchDynamoException,)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype norm statistics are computed in: float32 for fp16/bf16/fp32, float64 stays."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype norm statistics are computed in (float32 for fp16/bf16; float32
    and float64 tensors are returned as they are)."""
    return t.to(compute_dtype(t))


def rational_tanh(z: torch.Tensor) -> torch.Tensor:
    """float32 tanh as a clamped rational function (FMAs and one division): a few times
    cheaper than libm/Sleef tanh once fused by the compiler, max relative error 4e-7."""
    z = z.clamp(-_TANH_CLAMP, _TANH_CLAMP)
    z2 = z * z
    p = _TANH_P[-1]
    for c in reversed(_TANH_P[:-1]):
        p = p * z2 + c
    q = _TANH_Q[-1]
    for c in reversed(_TANH_Q[:-1]):
        q = q * z2 + c
    return z * p / q


def tanh(z: torch.Tensor) -> torch.Tensor:
    """tanh for the kernels: the rational approximation when compiled for float32 on CPU
    (fused into the surrounding loop), ``torch.tanh`` otherwise (eager: one op instead of
    twenty; GPU: the compiler's native tanh is already cheap; float64: exact)."""
    if torch.compiler.is_compiling() and z.dtype == torch.float32 and z.device.type == "cpu":
        return rational_tanh(z)
    return torch.tanh(z)


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def compile_enabled() -> bool:
    """False when ``NORMPLUG_COMPILE`` is 0/false/no/off or inside ``disable("compiled")``."""
    return "compiled" not in _disabled and _env_on(COMPILE_ENV)


def native_enabled() -> bool:
    """False when ``NORMPLUG_NATIVE`` is 0/false/no/off or inside ``disable("native")``."""
    return "native" not in _disabled and native.enabled()


@contextlib.contextmanager
def disable(*paths: str):
    """Skip the given paths ("native", "compiled") inside this block, as the environment
    variables do for a whole process; used to compare the paths in one process."""
    unknown = set(paths) - {"native", "compiled"}
    if unknown:
        raise ValueError(f"unknown fast paths {sorted(unknown)}; choose native or compiled")
    added = set(paths) - _disabled
    _disabled.update(added)
    try:
        yield
    finally:
        _disabled.difference_update(added)


def worth_compiling(x: torch.Tensor) -> bool:
    """Whether ``x`` is a candidate for the compiled path (if the native one does not take it)."""
    return (
        x.dtype != torch.float64
        and x.numel() >= int(os.environ.get(MIN_NUMEL_ENV, DEFAULT_MIN_NUMEL))
        and compile_enabled()
        and not torch.compiler.is_compiling()
    )


def failed_kernels():
    """Names of the kernels whose compilation failed (they run eagerly)."""
    return [k.__name__ for k in Kernel.instances if k._failed]


def native_ops(x: torch.Tensor, param: torch.Tensor):
    """``torch.ops.normplug`` when a norm call with input ``x`` and parameters like ``param``
    runs on the native path, else None."""
    if "native" in _disabled or not native.usable(x, param):
        return None
    return native.ops()


def path(kernel: "Kernel", x: torch.Tensor, param: torch.Tensor) -> str:
    """The path a norm call with input ``x`` and parameter ``param`` takes: native, or where
    ``kernel`` runs."""
    if native_ops(x, param) is not None:
        return "native"
    return kernel.path(rows(x))


class Kernel:
    """A tensor function ``fn(rows, *args)`` (a norm's Python forward or backward), run
    compiled or eagerly (module docstring)."""

    instances = []

    def __init__(self, fn):
        Kernel.instances.append(self)
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._compiled = None
        self._failed = False

    def path(self, x: torch.Tensor) -> str:
        """The path a call with ``x`` takes: compiled or eager."""
        if not self._failed and worth_compiling(x):
            return "compiled"
        return "eager"

    def __call__(self, x: torch.Tensor, *args):
        if self.path(x) == "compiled":
            # detached: a requires_grad flag would be guarded on and cost a recompile
            x, *args = [t.detach() if isinstance(t, torch.Tensor) else t for t in (x, *args)]
            dyn = dynamo()  # imported and configured before the first compile
            for t in (x, *args):
                if isinstance(t, torch.Tensor) and t.dim() == 2:
                    dyn.maybe_mark_dynamic(t, 0)
            compiled = self._build()
            if compiled is not None:
                try:
                    return compiled(x, *args)
                except build_errors() as exc:  # compiling for a new width/dtype failed
                    self._give_up(exc)
        return self.fn(x, *args)

    def _build(self):
        """The ``torch.compile`` wrapper of ``fn``, None once building it has failed."""
        if self._compiled is None and not self._failed:
            logger.info("compiling fused norm kernel %s (once per width/dtype)", self.__name__)
            try:
                self._compiled = torch.compile(self.fn, dynamic=False, fullgraph=True)
            except Exception as exc:  # unsupported platform or Python: torch.compile refuses
                self._give_up(exc)
        return self._compiled

    def _give_up(self, exc: Exception) -> None:
        """Switch this kernel to eager for good, with one warning naming why."""
        self._failed = True
        self._compiled = None
        cause = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
        first_line = str(cause).splitlines()[0] if str(cause) else ""
        warnings.warn(
            f"fairseq-normplug: torch.compile of {self.__name__} failed "
            f"({type(cause).__name__}: {first_line}); using the eager fast path",
            RuntimeWarning,
        )


def needs_autograd(*tensors: torch.Tensor) -> bool:
    """True when a backward pass can reach any of ``tensors``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``(rows, dim)`` matrix (a view when ``x`` is contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()
