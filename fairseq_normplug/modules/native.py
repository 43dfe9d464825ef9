"""Native CPU kernels of the fast paths (float32): one pass over each row for the forward
and one for the backward, parameter gradients accumulated per thread.

torch.compile's CPU code generator (inductor) fuses each norm's row statistics with its
pointwise work, but not the per-channel gradient sums (RMSNorm and DyT gains/shifts): those
become a second, strided pass over the whole input. The small C kernels below do both in one
pass, and cost a few microseconds per call where a compiled call costs about 20, so they are
used for every size. They are compiled once per machine with the system C compiler
(``$CC``, default ``cc``; OpenMP and ``-march=native`` when available) into
``$NORMPLUG_CACHE_DIR`` (default ``~/.cache/fairseq-normplug``) and loaded with ctypes: no
torch headers, well under a second to build. ``NORMPLUG_NATIVE=0`` disables them; without a
working compiler they are skipped with a one-time warning (see ``fused.py`` for the other
paths).
"""
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from typing import Optional

import torch

NATIVE_ENV = "NORMPLUG_NATIVE"
CACHE_ENV = "NORMPLUG_CACHE_DIR"

SQUASH_CODES = {"tanh": 0, "hardtanh": 1, "sigmoid": 2}

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#else
#define THREAD_ID 0
#endif

/* below this many elements a kernel runs on one thread (a parallel region costs more) */
#define PARALLEL_MIN 32768
#define THREADS(n, d, nt) (((n) * (d) >= PARALLEL_MIN) ? (nt) : 1)

/* tanh as a clamped rational function (the float32 fast tanh of Eigen/XLA), max relative
   error 4e-7 */
static inline float rational_tanh(float z) {
    const float c = 7.90531110763549805f;
    z = z < -c ? -c : (z > c ? c : z);
    float z2 = z * z;
    float p = -2.76076847742355e-16f;
    p = p * z2 + 2.00018790482477e-13f;
    p = p * z2 - 8.60467152213735e-11f;
    p = p * z2 + 5.12229709037114e-08f;
    p = p * z2 + 1.48572235717979e-05f;
    p = p * z2 + 6.37261928875436e-04f;
    p = p * z2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * z2 + 1.18534705686654e-04f;
    q = q * z2 + 2.26843463243900e-03f;
    q = q * z2 + 4.89352518554385e-03f;
    return z * p / q;
}

/* exp by Cody-Waite range reduction and a degree-7 Taylor polynomial, 2 ulp */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)k + 127) << 23;
    return p * scale.f;
}

/* squash(z) into *t and squash'(z) into *s; kind 0 tanh, 1 hardtanh, 2 sigmoid */
static inline void squash(int kind, float z, float *t, float *s) {
    if (kind == 0) {
        float v = rational_tanh(z);
        *t = v;
        *s = 1.0f - v * v;
    } else if (kind == 1) {
        *t = z < -1.0f ? -1.0f : (z > 1.0f ? 1.0f : z);
        *s = (z > -1.0f && z < 1.0f) ? 1.0f : 0.0f;
    } else {
        float v = 1.0f / (1.0f + exp_approx(-z));
        *t = v;
        *s = v * (1.0f - v);
    }
}

/* Per-channel gradients (RMSNorm and DyT gains, DyT shift) are summed over rows by each
   thread into float accumulators, flushed into per-thread double sums every BLOCK rows (cheap
   and accurate), and the threads' sums are added at the end. A thread's rows: [lo, hi). */
#define BLOCK 32
#ifdef _OPENMP
#define NUM_THREADS omp_get_num_threads()
#else
#define NUM_THREADS 1
#endif
#define THREAD_ROWS(n, lo, hi)                                                   \
    int64_t lo = (n) * THREAD_ID / NUM_THREADS, hi = (n) * (THREAD_ID + 1) / NUM_THREADS

static void flush(float *acc, double *sum, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        sum[j] += acc[j];
        acc[j] = 0.0f;
    }
}

static void reduce_partials(const double *part, int threads, int64_t d, double *out) {
    for (int64_t j = 0; j < d; j++) {
        double acc = 0.0;
        for (int t = 0; t < threads; t++) acc += part[t * d + j];
        out[j] = acc;
    }
}

/* ScaleNorm, eq. (8): y = x * g / max(||x||, eps); norm = ||x|| per row */
void scale_norm_fwd(const float *x, float *y, float *norm, int64_t n, int64_t d, float g,
                    float eps, int nt) {
    #pragma omp parallel for schedule(static) num_threads(THREADS(n, d, nt))
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * d;
        float *yr = y + i * d;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < d; j++) ss += xr[j] * xr[j];
        float nr = sqrtf(ss);
        norm[i] = nr;
        float s = g / (nr > eps ? nr : eps);
        #pragma omp simd
        for (int64_t j = 0; j < d; j++) yr[j] = xr[j] * s;
    }
}

/* dx = g r (dy - x <x,dy> r^2 [n >= eps]), r = 1/max(n, eps); dg = sum <x,dy> r */
void scale_norm_bwd(const float *gy, const float *x, const float *norm, float *gx,
                    double *gg, int64_t n, int64_t d, float g, float eps, int nt) {
    double acc = 0.0;
    #pragma omp parallel for schedule(static) reduction(+:acc) num_threads(THREADS(n, d, nt))
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * d, *gr = gy + i * d;
        float *out = gx + i * d;
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int64_t j = 0; j < d; j++) dot += xr[j] * gr[j];
        float nr = norm[i];
        float inv = 1.0f / (nr > eps ? nr : eps);
        float coef = nr >= eps ? dot * inv * inv : 0.0f;
        float s = g * inv;
        #pragma omp simd
        for (int64_t j = 0; j < d; j++) out[j] = (gr[j] - xr[j] * coef) * s;
        acc += (double)dot * inv;
    }
    *gg = acc;
}

/* RMSNorm: y = x r w, r = 1/sqrt(mean x^2 + eps) per row */
void rms_norm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t n, int64_t d,
                  float eps, int nt) {
    #pragma omp parallel for schedule(static) num_threads(THREADS(n, d, nt))
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * d;
        float *yr = y + i * d;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < d; j++) ss += xr[j] * xr[j];
        float r = 1.0f / sqrtf(ss / (float)d + eps);
        rstd[i] = r;
        #pragma omp simd
        for (int64_t j = 0; j < d; j++) yr[j] = xr[j] * r * w[j];
    }
}

/* u = dy w: dx = r (u - x r^2 mean(u x)); dw = sum_rows dy x r */
void rms_norm_bwd(const float *gy, const float *x, const float *rstd, const float *w,
                  float *gx, double *gw, int64_t n, int64_t d, int nt) {
    int threads = THREADS(n, d, nt);
    double *part = (double *)calloc((size_t)threads * d, sizeof(double));
    float *accs = (float *)calloc((size_t)threads * d, sizeof(float));
    #pragma omp parallel num_threads(threads)
    {
        THREAD_ROWS(n, lo, hi);
        double *pw = part + THREAD_ID * d;
        float *aw = accs + THREAD_ID * d;
        for (int64_t i = lo; i < hi; i++) {
            const float *xr = x + i * d, *gr = gy + i * d;
            float *out = gx + i * d;
            float r = rstd[i], dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t j = 0; j < d; j++) dot += gr[j] * w[j] * xr[j];
            float coef = dot * r * r / (float)d;
            #pragma omp simd
            for (int64_t j = 0; j < d; j++) {
                out[j] = (gr[j] * w[j] - xr[j] * coef) * r;
                aw[j] += gr[j] * xr[j] * r;
            }
            if ((i - lo) % BLOCK == BLOCK - 1 || i == hi - 1) flush(aw, pw, d);
        }
    }
    reduce_partials(part, threads, d, gw);
    free(accs);
    free(part);
}

/* DyT, eq. (1): y = w squash(a x) + b. The row functions are inlined with a constant
   kind, so each squash gets its own vectorised loop. */
static inline __attribute__((always_inline)) void dyt_fwd_row(
        int kind, const float *xr, const float *w, const float *b, float *yr, int64_t d,
        float a) {
    #pragma omp simd
    for (int64_t j = 0; j < d; j++) {
        float t, s;
        squash(kind, a * xr[j], &t, &s);
        yr[j] = w[j] * t + b[j];
    }
}

void dynamic_tanh_fwd(const float *x, const float *w, const float *b, float *y, int64_t n,
                      int64_t d, float a, int kind, int nt) {
    #pragma omp parallel for schedule(static) num_threads(THREADS(n, d, nt))
    for (int64_t i = 0; i < n; i++) {
        if (kind == 0) dyt_fwd_row(0, x + i * d, w, b, y + i * d, d, a);
        else if (kind == 1) dyt_fwd_row(1, x + i * d, w, b, y + i * d, d, a);
        else dyt_fwd_row(2, x + i * d, w, b, y + i * d, d, a);
    }
}

/* e = dy w squash'(a x): dx = a e; returns sum_j e x; adds dy squash(a x) to aw, dy to ab */
static inline __attribute__((always_inline)) float dyt_bwd_row(
        int kind, const float *gr, const float *xr, const float *w, float *out, float *aw,
        float *ab, int64_t d, float a) {
    float row = 0.0f;
    #pragma omp simd reduction(+:row)
    for (int64_t j = 0; j < d; j++) {
        float t, s;
        squash(kind, a * xr[j], &t, &s);
        float e = gr[j] * w[j] * s;
        out[j] = e * a;
        row += e * xr[j];
        aw[j] += gr[j] * t;
        ab[j] += gr[j];
    }
    return row;
}

/* da = sum e x; dw = sum_rows dy squash(a x); db = sum_rows dy */
void dynamic_tanh_bwd(const float *gy, const float *x, const float *w, float *gx, double *ga,
                      double *gw, double *gb, int64_t n, int64_t d, float a, int kind,
                      int nt) {
    int threads = THREADS(n, d, nt);
    double *part = (double *)calloc((size_t)threads * 2 * d, sizeof(double));
    float *accs = (float *)calloc((size_t)threads * 2 * d, sizeof(float));
    double acc = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+:acc)
    {
        THREAD_ROWS(n, lo, hi);
        double *pwb = part + 2 * THREAD_ID * d;
        float *aw = accs + 2 * THREAD_ID * d, *ab = aw + d;
        for (int64_t i = lo; i < hi; i++) {
            const float *gr = gy + i * d, *xr = x + i * d;
            float *out = gx + i * d;
            if (kind == 0) acc += dyt_bwd_row(0, gr, xr, w, out, aw, ab, d, a);
            else if (kind == 1) acc += dyt_bwd_row(1, gr, xr, w, out, aw, ab, d, a);
            else acc += dyt_bwd_row(2, gr, xr, w, out, aw, ab, d, a);
            if ((i - lo) % BLOCK == BLOCK - 1 || i == hi - 1) flush(aw, pwb, 2 * d);
        }
    }
    *ga = acc;
    double *sums = (double *)calloc(2 * d, sizeof(double));
    reduce_partials(part, threads, 2 * d, sums);
    for (int64_t j = 0; j < d; j++) { gw[j] = sums[j]; gb[j] = sums[d + j]; }
    free(sums);
    free(accs);
    free(part);
}
"""

_I64, _F32, _INT, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
SIGNATURES = {
    "scale_norm_fwd": [_P, _P, _P, _I64, _I64, _F32, _F32, _INT],
    "scale_norm_bwd": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _F32, _INT],
    "rms_norm_fwd": [_P, _P, _P, _P, _I64, _I64, _F32, _INT],
    "rms_norm_bwd": [_P, _P, _P, _P, _P, _P, _I64, _I64, _INT],
    "dynamic_tanh_fwd": [_P, _P, _P, _P, _I64, _I64, _F32, _INT, _INT],
    "dynamic_tanh_bwd": [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _F32, _INT, _INT],
}
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)

_lock = threading.Lock()
_library = None
_failure: Optional[str] = None


def enabled() -> bool:
    """False when ``NORMPLUG_NATIVE`` is set to 0/false/no/off."""
    return os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


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


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    errors = []
    for flags in FLAG_SETS:
        args = [compiler, *flags, "-std=gnu99", "-fPIC", "-shared"]
        key = hashlib.sha256("\n".join([SOURCE, *args, _cpu_signature()]).encode()).hexdigest()
        path = os.path.join(_cache_dir(), f"normplug_kernels_{key[:20]}.so")
        if not os.path.exists(path):
            os.makedirs(_cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
                src, out = os.path.join(tmp, "kernels.c"), os.path.join(tmp, "kernels.so")
                with open(src, "w") as f:
                    f.write(SOURCE)
                try:
                    proc = subprocess.run([*args, src, "-o", out, "-lm"], capture_output=True,
                                          text=True, timeout=300)
                except (OSError, subprocess.SubprocessError) as exc:
                    errors.append(f"{' '.join(flags)}: {exc}")
                    continue
                if proc.returncode != 0:
                    errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[:300]}")
                    continue
                os.replace(out, path)  # atomic: concurrent builders do not clash
        lib = ctypes.CDLL(path)
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        return lib
    raise RuntimeError("; ".join(errors))


def library() -> Optional[ctypes.CDLL]:
    """The kernels, built on first use; None (after one warning) where they cannot be."""
    global _library, _failure
    if _library is None and _failure is None:
        with _lock:
            if _library is None and _failure is None:
                try:
                    _library = _build()
                except Exception as exc:  # no compiler, read-only cache, exotic platform
                    _failure = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"fairseq-normplug: native CPU norm kernels unavailable "
                                  f"({_failure}); using the other fast paths", RuntimeWarning)
    return _library


def failure() -> Optional[str]:
    """Why the kernels could not be built, or None."""
    return _failure


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` (a ``(rows, dim)`` matrix) can run on the native kernels."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and enabled()
            and (_library is not None or library() is not None))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _param(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def scale_norm_forward(x, g, eps):
    x = _rows(x)
    n, d = x.shape
    y, norm = torch.empty_like(x), x.new_empty(n, 1)
    library().scale_norm_fwd(x.data_ptr(), y.data_ptr(), norm.data_ptr(), n, d, float(g),
                             eps, torch.get_num_threads())
    return y, norm


def scale_norm_backward(grad, x, norm, g, eps):
    grad, x = _rows(grad), _rows(x)
    n, d = x.shape
    gx, gg = torch.empty_like(x), torch.empty((), dtype=torch.float64)
    library().scale_norm_bwd(grad.data_ptr(), x.data_ptr(), norm.data_ptr(), gx.data_ptr(),
                             gg.data_ptr(), n, d, float(g), eps, torch.get_num_threads())
    return gx, gg


def rms_norm_forward(x, weight, eps):
    x, weight = _rows(x), _param(weight)
    n, d = x.shape
    y, rstd = torch.empty_like(x), x.new_empty(n, 1)
    library().rms_norm_fwd(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), n,
                           d, eps, torch.get_num_threads())
    return y, rstd


def rms_norm_backward(grad, x, rstd, weight):
    grad, x, weight = _rows(grad), _rows(x), _param(weight)
    n, d = x.shape
    gx, gw = torch.empty_like(x), torch.empty(d, dtype=torch.float64)
    library().rms_norm_bwd(grad.data_ptr(), x.data_ptr(), rstd.data_ptr(), weight.data_ptr(),
                           gx.data_ptr(), gw.data_ptr(), n, d, torch.get_num_threads())
    return gx, gw


def dynamic_tanh_forward(x, alpha, weight, bias, squash):
    x, weight, bias = _rows(x), _param(weight), _param(bias)
    n, d = x.shape
    y = torch.empty_like(x)
    library().dynamic_tanh_fwd(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
                               n, d, float(alpha), SQUASH_CODES[squash],
                               torch.get_num_threads())
    return y


def dynamic_tanh_backward(grad, x, alpha, weight, squash):
    grad, x, weight = _rows(grad), _rows(x), _param(weight)
    n, d = x.shape
    gx = torch.empty_like(x)
    ga = torch.empty((), dtype=torch.float64)
    gw, gb = torch.empty(d, dtype=torch.float64), torch.empty(d, dtype=torch.float64)
    library().dynamic_tanh_bwd(grad.data_ptr(), x.data_ptr(), weight.data_ptr(), gx.data_ptr(),
                               ga.data_ptr(), gw.data_ptr(), gb.data_ptr(), n, d, float(alpha),
                               SQUASH_CODES[squash], torch.get_num_threads())
    return gx, ga, gw, gb
