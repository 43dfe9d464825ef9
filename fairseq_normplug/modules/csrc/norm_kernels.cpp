// Native CPU fast paths of ScaleNorm, RMSNorm and DyT (float32), registered as torch
// operators with their autograd in C++:
//
//   torch.ops.normplug.scale_norm(x, g, eps)                    "Transformers without Tears", eq. (5)
//   torch.ops.normplug.rms_norm(x, weight, eps)                 RMSNorm (Table 7 of the same paper)
//   torch.ops.normplug.dynamic_tanh(x, alpha, weight, bias, squash)  DyT, "Transformers without
//                                                                    Normalization", eq. (1)
//
// Each operator is one pass over each row forward and one backward (the forward saves x and
// one number per row, or nothing for DyT); per-channel gradients are summed per thread.
// Operator, autograd node and kernel are all C++, so a call costs what torch's own
// layer_norm costs. Built on the user's machine against the installed torch by native.py;
// the readable reference formulas and the Python fast paths live in scale_norm.py,
// rms_norm.py and dynamic_tanh.py, and tests/test_fast_norms.py checks all against each other.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#define NUM_THREADS omp_get_num_threads()
#else
#define THREAD_ID 0
#define NUM_THREADS 1
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

/* squash(z); kind 0 tanh, 1 hardtanh, 2 sigmoid. Values, not pointers: an address-taken
   local in a simd loop becomes a per-lane stack array, several times slower. */
static inline float squash(int kind, float z) {
    if (kind == 0) return rational_tanh(z);
    if (kind == 1) return z < -1.0f ? -1.0f : (z > 1.0f ? 1.0f : z);
    return 1.0f / (1.0f + exp_approx(-z));
}

/* squash'(z), given t = squash(z) */
static inline float squash_slope(int kind, float z, float t) {
    if (kind == 0) return 1.0f - t * t;
    if (kind == 1) return (z > -1.0f && z < 1.0f) ? 1.0f : 0.0f;
    return t * (1.0f - t);
}

/* Per-channel gradients (RMSNorm and DyT gains, DyT shift) are summed over rows by each
   thread into float accumulators, flushed into per-thread double sums every BLOCK rows (cheap
   and accurate), and the threads' sums are added at the end. A thread's rows: [lo, hi). */
#define BLOCK 32
#define THREAD_ROWS(n, lo, hi)                                                   \
    int64_t lo = (n) * THREAD_ID / NUM_THREADS, hi = (n) * (THREAD_ID + 1) / NUM_THREADS

static void flush(float *acc, double *sum, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        sum[j] += acc[j];
        acc[j] = 0.0f;
    }
}

/* out[j] = sum over threads t of part[t * stride + j], j < count */
static void reduce_partials(const double *part, int threads, int64_t stride, int64_t count,
                            float *out) {
    for (int64_t j = 0; j < count; j++) {
        double acc = 0.0;
        for (int t = 0; t < threads; t++) acc += part[t * stride + j];
        out[j] = (float)acc;
    }
}

static inline float sum_of_squares(const float *xr, int64_t d) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int64_t j = 0; j < d; j++) ss += xr[j] * xr[j];
    return ss;
}

/* ScaleNorm, eq. (5): y = x * g / max(||x||, eps); norm = ||x|| per row */
static void scale_norm_fwd(const float *x, float *y, float *norm, int64_t n, int64_t d,
                           float g, float eps, int nt) {
    #pragma omp parallel for schedule(static) num_threads(THREADS(n, d, nt))
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * d;
        float *yr = y + i * d;
        float nr = sqrtf(sum_of_squares(xr, d));
        norm[i] = nr;
        float s = g / (nr > eps ? nr : eps);
        #pragma omp simd
        for (int64_t j = 0; j < d; j++) yr[j] = xr[j] * s;
    }
}

/* dx = g r (dy - x <x,dy> r^2 [n >= eps]), r = 1/max(n, eps); returns dg = sum <x,dy> r */
static double scale_norm_bwd(const float *gy, const float *x, const float *norm, float *gx,
                             int64_t n, int64_t d, float g, float eps, int nt) {
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
    return acc;
}

/* RMSNorm: y = x r w, r = 1/sqrt(mean x^2 + eps) per row */
static void rms_norm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t n,
                         int64_t d, float eps, int nt) {
    #pragma omp parallel for schedule(static) num_threads(THREADS(n, d, nt))
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * d;
        float *yr = y + i * d;
        float r = 1.0f / sqrtf(sum_of_squares(xr, d) / (float)d + eps);
        rstd[i] = r;
        #pragma omp simd
        for (int64_t j = 0; j < d; j++) yr[j] = xr[j] * r * w[j];
    }
}

/* u = dy w: dx = r (u - x r^2 mean(u x)); dw = sum_rows dy x r */
static void rms_norm_bwd(const float *gy, const float *x, const float *rstd, const float *w,
                         float *gx, float *gw, int64_t n, int64_t d, int nt) {
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
    reduce_partials(part, threads, d, d, gw);
    free(accs);
    free(part);
}

/* DyT, eq. (1): y = w squash(a x) + b. The row functions are inlined with a constant
   kind, so each squash gets its own vectorised loop. */
static inline __attribute__((always_inline)) void dyt_fwd_row(
        int kind, const float *xr, const float *w, const float *b, float *yr, int64_t d,
        float a) {
    #pragma omp simd
    for (int64_t j = 0; j < d; j++) yr[j] = w[j] * squash(kind, a * xr[j]) + b[j];
}

static void dynamic_tanh_fwd(const float *x, const float *w, const float *b, float *y,
                             int64_t n, int64_t d, float a, int kind, int nt) {
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
        float z = a * xr[j], t = squash(kind, z);
        float e = gr[j] * w[j] * squash_slope(kind, z, t);
        out[j] = e * a;
        row += e * xr[j];
        aw[j] += gr[j] * t;
        ab[j] += gr[j];
    }
    return row;
}

/* returns da = sum e x; dw = sum_rows dy squash(a x); db = sum_rows dy */
static double dynamic_tanh_bwd(const float *gy, const float *x, const float *w, float *gx,
                               float *gw, float *gb, int64_t n, int64_t d, float a, int kind,
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
    reduce_partials(part, threads, 2 * d, d, gw);
    reduce_partials(part + d, threads, 2 * d, d, gb);
    free(accs);
    free(part);
    return acc;
}

/* ---- torch operators: argument checks, buffers, autograd ---- */

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

static void check_float_cpu(const Tensor &t, const char *name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(),
                "normplug native kernels take float32 CPU tensors; ", name, " is ",
                t.scalar_type(), " on ", t.device());
}

/* x as contiguous rows of width d (a channel vector of length d for per-channel params) */
static Tensor contiguous_rows(const Tensor &x, const char *name) {
    check_float_cpu(x, name);
    TORCH_CHECK(x.dim() >= 1, "normplug: ", name, " needs at least one dimension");
    return x.contiguous();
}

static Tensor channel_param(const Tensor &p, int64_t d, const char *name) {
    check_float_cpu(p, name);
    TORCH_CHECK(p.numel() == d, "normplug: ", name, " has ", p.numel(), " elements, expected ",
                d);
    return p.contiguous();
}

static float scalar_param(const Tensor &p, const char *name) {
    check_float_cpu(p, name);
    TORCH_CHECK(p.numel() == 1, "normplug: ", name, " must hold one number, got ", p.sizes());
    return *p.data_ptr<float>();  /* the one element, without a dispatched item() */
}

/* a per-channel gradient in p's shape (p is float32, checked in the forward) */
static Tensor as_grad(const Tensor &grad, const Tensor &p) { return grad.view(p.sizes()); }

static int64_t width(const Tensor &x) { return x.size(-1); }
static int64_t count_rows(const Tensor &x) { return width(x) ? x.numel() / width(x) : 0; }

struct ScaleNormFunction : public torch::autograd::Function<ScaleNormFunction> {
    static Tensor forward(AutogradContext *ctx, const Tensor &x_in, const Tensor &g,
                          double eps) {
        Tensor x = contiguous_rows(x_in, "x");
        int64_t d = width(x), n = count_rows(x);
        Tensor y = at::empty_like(x), norm = at::empty({n}, x.options());
        scale_norm_fwd(x.data_ptr<float>(), y.data_ptr<float>(), norm.data_ptr<float>(), n, d,
                       scalar_param(g, "g"), (float)eps, at::get_num_threads());
        ctx->save_for_backward({x, norm, g});
        ctx->saved_data["eps"] = eps;
        return y;
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        auto saved = ctx->get_saved_variables();
        Tensor x = saved[0], norm = saved[1], g = saved[2];
        Tensor gy = grads[0].contiguous(), gx = at::empty_like(x);
        int64_t d = width(x), n = count_rows(x);
        double gg = scale_norm_bwd(gy.data_ptr<float>(), x.data_ptr<float>(),
                                   norm.data_ptr<float>(), gx.data_ptr<float>(), n, d,
                                   *g.data_ptr<float>(), (float)ctx->saved_data["eps"].toDouble(),
                                   at::get_num_threads());
        Tensor grad_g = ctx->needs_input_grad(1) ? at::full_like(g, gg) : Tensor();
        return {gx, grad_g, Tensor()};
    }
};

struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
    static Tensor forward(AutogradContext *ctx, const Tensor &x_in, const Tensor &w_in,
                          double eps) {
        Tensor x = contiguous_rows(x_in, "x");
        int64_t d = width(x), n = count_rows(x);
        Tensor w = channel_param(w_in, d, "weight");
        Tensor y = at::empty_like(x), rstd = at::empty({n}, x.options());
        rms_norm_fwd(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(),
                     rstd.data_ptr<float>(), n, d, (float)eps, at::get_num_threads());
        ctx->save_for_backward({x, rstd, w_in});
        return y;
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        auto saved = ctx->get_saved_variables();
        Tensor x = saved[0], rstd = saved[1], w_in = saved[2];
        int64_t d = width(x), n = count_rows(x);
        Tensor w = w_in.contiguous(), gy = grads[0].contiguous(), gx = at::empty_like(x);
        Tensor gw = at::empty({d}, x.options());
        rms_norm_bwd(gy.data_ptr<float>(), x.data_ptr<float>(), rstd.data_ptr<float>(),
                     w.data_ptr<float>(), gx.data_ptr<float>(), gw.data_ptr<float>(), n, d,
                     at::get_num_threads());
        return {gx, ctx->needs_input_grad(1) ? as_grad(gw, w_in) : Tensor(), Tensor()};
    }
};

struct DynamicTanhFunction : public torch::autograd::Function<DynamicTanhFunction> {
    static Tensor forward(AutogradContext *ctx, const Tensor &x_in, const Tensor &alpha,
                          const Tensor &w_in, const Tensor &b_in, int64_t kind) {
        TORCH_CHECK(kind >= 0 && kind <= 2, "normplug: squash code ", kind,
                    " is not 0 (tanh), 1 (hardtanh) or 2 (sigmoid)");
        Tensor x = contiguous_rows(x_in, "x");
        int64_t d = width(x), n = count_rows(x);
        Tensor w = channel_param(w_in, d, "weight"), b = channel_param(b_in, d, "bias");
        Tensor y = at::empty_like(x);
        dynamic_tanh_fwd(x.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(),
                         y.data_ptr<float>(), n, d, scalar_param(alpha, "alpha"), (int)kind,
                         at::get_num_threads());
        ctx->save_for_backward({x, alpha, w_in, b_in});
        ctx->saved_data["kind"] = kind;
        return y;
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        auto saved = ctx->get_saved_variables();
        Tensor x = saved[0], alpha = saved[1], w_in = saved[2], b_in = saved[3];
        int64_t d = width(x), n = count_rows(x);
        Tensor w = w_in.contiguous(), gy = grads[0].contiguous(), gx = at::empty_like(x);
        Tensor gw = at::empty({d}, x.options()), gb = at::empty({d}, x.options());
        double ga = dynamic_tanh_bwd(gy.data_ptr<float>(), x.data_ptr<float>(),
                                     w.data_ptr<float>(), gx.data_ptr<float>(),
                                     gw.data_ptr<float>(), gb.data_ptr<float>(), n, d,
                                     *alpha.data_ptr<float>(),
                                     (int)ctx->saved_data["kind"].toInt(),
                                     at::get_num_threads());
        return {gx,
                ctx->needs_input_grad(1) ? at::full_like(alpha, ga) : Tensor(),
                ctx->needs_input_grad(2) ? as_grad(gw, w_in) : Tensor(),
                ctx->needs_input_grad(3) ? as_grad(gb, b_in) : Tensor(),
                Tensor()};
    }
};

static Tensor scale_norm(const Tensor &x, const Tensor &g, double eps) {
    return ScaleNormFunction::apply(x, g, eps);
}

static Tensor rms_norm(const Tensor &x, const Tensor &weight, double eps) {
    return RMSNormFunction::apply(x, weight, eps);
}

static Tensor dynamic_tanh(const Tensor &x, const Tensor &alpha, const Tensor &weight,
                           const Tensor &bias, int64_t squash_code) {
    return DynamicTanhFunction::apply(x, alpha, weight, bias, squash_code);
}

TORCH_LIBRARY(normplug, m) {
    m.def("scale_norm(Tensor x, Tensor g, float eps) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("dynamic_tanh(Tensor x, Tensor alpha, Tensor weight, Tensor bias, int squash) -> Tensor");
}

/* One implementation serves both keys: the autograd function records a node only when
   gradients are wanted (Autograd), and runs the kernel alone otherwise (inference mode). */
TORCH_LIBRARY_IMPL(normplug, Autograd, m) {
    m.impl("scale_norm", scale_norm);
    m.impl("rms_norm", rms_norm);
    m.impl("dynamic_tanh", dynamic_tanh);
}

TORCH_LIBRARY_IMPL(normplug, CPU, m) {
    m.impl("scale_norm", scale_norm);
    m.impl("rms_norm", rms_norm);
    m.impl("dynamic_tanh", dynamic_tanh);
}
