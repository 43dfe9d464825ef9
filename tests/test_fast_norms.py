"""The fast paths of ScaleNorm, RMSNorm and DyT (fused kernels, compiled or eager) against
their reference formulas: values and gradients to 1e-5 relative in float32, gradcheck in
float64, fallbacks, and smoke runs of the benchmarks. No timing assertions."""
import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from fairseq_normplug.modules import fused, native
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm
from inprocess import forked_commands
from model_helpers import randomized

D = 128
#: (time, batch, dim): 131,072 elements (compiled path), a decoding step (eager path)
TRAIN_SHAPE, DECODE_SHAPE = (64, 16, D), (1, 8, D)

#: the width of gradcheck's input: float64 takes the eager path, whose formulas do not depend on
#: the width, and gradcheck's cost grows with it (a numerical derivative per input element)
GRADCHECK_D = 16

MODULES = {
    "scalenorm": lambda dim=D: ScaleNorm(dim),
    "scalenorm-fixed-g": lambda dim=D: ScaleNorm(dim, learnable=False),
    "rmsnorm": lambda dim=D: RMSNorm(dim),
    "dyt": lambda dim=D: DynamicTanh(dim),
    "dyt-fixed-alpha": lambda dim=D: DynamicTanh(dim, learnable_alpha=False),
    "dyt-hardtanh": lambda dim=D: DynamicTanh(dim, squash="hardtanh"),
    "dyt-sigmoid": lambda dim=D: DynamicTanh(dim, squash="sigmoid"),
}


def values_and_grads(fn, module, x, grad):
    x = x.detach().requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]
    out = fn(x)
    return [out.detach()] + list(torch.autograd.grad(out, [x] + params, grad))


def assert_rel_close(actual, expected, rel=1e-5):
    """Equal to ``rel`` relative to the tensor's scale (elementwise rtol plus an atol of
    ``rel`` times the largest magnitude: float32 rounding differs between formulas)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def make_input(shape, contiguous=True, seed=1, tiny_rows=True):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        x = 3 * torch.randn(shape, generator=g)
    else:  # the same shape as a transposed view of a (batch, time, dim) tensor
        x = 3 * torch.randn(shape[1], shape[0], shape[2], generator=g).transpose(0, 1)
    if tiny_rows:
        x[0, 0] = 0.0  # an all-zero row: ScaleNorm's eps clamp, RMSNorm's eps
        if shape[0] > 1:
            x[1, 0] = 1e-7  # a row with norm below eps
    return x


PATH_SWITCHES = {"native": (), "compiled": ("native",), "eager": ("native", "compiled")}


@pytest.fixture(params=list(PATH_SWITCHES))
def path(request):
    """Run the test on each path: native C++ operators (the CPU float32 default), torch.compile
    (native off) and eager (both off)."""
    with fused.disable(*PATH_SWITCHES[request.param]):
        yield request.param


#: the native operators are built with the system C++ compiler; without one they cannot be
HAS_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None


def expected_path(path, x):
    """Where a call with ``x`` lands when ``path`` is the best path left on."""
    if path == "native" and x.dtype == torch.float32 and HAS_CXX:
        return "native"
    if path in ("native", "compiled") and x.numel() >= fused.DEFAULT_MIN_NUMEL:
        return "compiled"
    return "eager"


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("shape,contiguous", [(TRAIN_SHAPE, True), (TRAIN_SHAPE, False),
                                              (DECODE_SHAPE, True)],
                         ids=["train", "train-noncontiguous", "decode-step"])
def test_fast_path_matches_reference_float32(name, shape, contiguous, path):
    assert_fast_path_matches_reference(randomized(MODULES[name]()), make_input(shape, contiguous), path)


def assert_fast_path_matches_reference(module, x, path):
    """``module``'s forward (its fast path) agrees with its ``reference`` in values and gradients
    on ``x``, and takes the path expected under the ``path`` fixture's switches."""
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    fast = values_and_grads(module, module, x, grad)
    ref = values_and_grads(module.reference, module, x, grad)
    for a, b in zip(fast, ref):
        assert_rel_close(a, b)
    assert module.fast_path(x) == expected_path(path, x)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("no_autograd", [torch.no_grad, torch.inference_mode])
def test_inference_without_autograd(name, no_autograd, path):
    module = randomized(MODULES[name]())
    x = make_input(TRAIN_SHAPE)
    with no_autograd():
        out = module(x)
    assert not out.requires_grad
    assert_rel_close(out, module.reference(x).detach())


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "noncontiguous"])
def test_gradcheck_float64(name, contiguous):
    module = randomized(MODULES[name](GRADCHECK_D)).double()
    x = make_input((3, 2, GRADCHECK_D), contiguous).double().requires_grad_(True)
    assert module.fast_path(x) == "eager"
    params = [p for p in module.parameters() if p.requires_grad]
    names = [n for n, p in module.named_parameters() if p.requires_grad]

    def fn(inp, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (inp,))

    assert torch.autograd.gradcheck(fn, (x, *[p.detach().requires_grad_(True) for p in params]),
                                    eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", ["scalenorm", "rmsnorm", "dyt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_dtype_and_values(name, dtype, path):
    module = randomized(MODULES[name]())
    # fp16 sums of squares would overflow; no tiny rows (their gradient g/eps overflows fp16)
    x = (make_input(TRAIN_SHAPE, tiny_rows=False) * 100).to(dtype)
    grad = torch.randn(TRAIN_SHAPE).to(dtype)
    fast = values_and_grads(module, module, x, grad)
    ref = values_and_grads(module.reference, module, x, grad)
    assert fast[0].dtype == dtype and fast[1].dtype == dtype
    assert module.fast_path(x) == expected_path(path, x)
    for a, b in zip(fast, ref):
        assert torch.isfinite(a.float()).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2,
                                   atol=2e-2 * b.abs().max().item())


def test_frozen_parameters_get_no_gradient():
    for module in (ScaleNorm(D, learnable=False), DynamicTanh(D, learnable_alpha=False)):
        x = make_input(TRAIN_SHAPE).requires_grad_(True)
        module(x).sum().backward()
        frozen = module.g if isinstance(module, ScaleNorm) else module.alpha
        assert frozen.grad is None and x.grad is not None


def test_variable_rows_do_not_recompile():
    """The row dimension is dynamic: new batch shapes reuse the compiled kernels."""
    module = DynamicTanh(D)
    with fused.disable("native"):
        module(make_input((64, 8, D)).requires_grad_(True)).sum().backward()
    with fused.disable("native"), torch._dynamo.config.patch(error_on_recompile=True):
        for shape in [(40, 12, D), (33, 7, D)]:
            module(make_input(shape).requires_grad_(True)).sum().backward()
    assert not fused.failed_kernels()  # a recompile would have raised and been caught


def test_rational_tanh_accuracy():
    x = torch.cat([torch.linspace(-20, 20, 400001), torch.logspace(-30, 1, 20001)])
    x = torch.cat([x, -x])
    exact = torch.tanh(x.double())
    err = (fused.rational_tanh(x).double() - exact).abs() / exact.abs().clamp(min=1e-300)
    assert err.max() < 1e-6


PATH_PROBE = """
import torch
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
module, x = DynamicTanh(128), torch.randn(64, 16, 128)
error = (module(x) - module.reference(x)).abs()
print(module.fast_path(x), float(error.max()))
"""


@pytest.mark.parametrize("env,expected", [({}, "native" if HAS_CXX else "compiled"),
                                          ({"NORMPLUG_NATIVE": "0"}, "compiled"),
                                          ({"NORMPLUG_NATIVE": "off", "NORMPLUG_COMPILE": "0"},
                                           "eager")])
@pytest.mark.slow
def test_paths_disabled_by_environment(env, expected):
    """The environment switches paths off for a whole process (read once, at first use)."""
    proc = subprocess.run([sys.executable, "-c", PATH_PROBE], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    path_taken, error = proc.stdout.split()
    assert path_taken == expected and float(error) < 1e-5


def _fails_in_torch_compile(fn, **kwargs):
    raise RuntimeError("torch.compile is not supported on this platform")


def _fails_when_first_compiled(fn, **kwargs):
    def run(*args):  # what inductor raises without a working C++ compiler or triton
        raise torch._dynamo.exc.BackendCompilerFailed(run, RuntimeError("no C++ compiler"), None)
    return run


@pytest.fixture
def scratch_kernel():
    """A kernel ``x * w`` of its own (taken out of ``Kernel.instances`` afterwards) and an
    input that takes the compiled path."""
    def scratch_scale(x, w):
        return x * w

    kernel = fused.Kernel(scratch_scale)
    yield kernel, make_input(TRAIN_SHAPE).reshape(-1, D), torch.rand(D)
    fused.Kernel.instances.remove(kernel)


@pytest.mark.parametrize("broken_compile,message", [
    (_fails_in_torch_compile, "not supported on this platform"),
    (_fails_when_first_compiled, "RuntimeError: no C\\+\\+ compiler"),
])
def test_compile_failure_falls_back_to_eager_once(monkeypatch, scratch_kernel, broken_compile,
                                                   message):
    monkeypatch.setattr(torch, "compile", broken_compile)
    kernel, x, w = scratch_kernel
    assert kernel.path(x) == "compiled"
    with pytest.warns(RuntimeWarning, match=message):
        out = kernel(x, w)
    torch.testing.assert_close(out, x * w)
    assert kernel.path(x) == "eager" and "scratch_scale" in fused.failed_kernels()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # for good, no second warning
        torch.testing.assert_close(kernel(x, w), x * w)


def test_runtime_error_in_a_compiled_kernel_raises(monkeypatch, scratch_kernel):
    """Out of memory (or any error) while a built kernel runs is not a reason to go eager."""
    def out_of_memory_at_run_time(fn, **kwargs):
        def run(*args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run

    monkeypatch.setattr(torch, "compile", out_of_memory_at_run_time)
    kernel, x, w = scratch_kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
                kernel(x, w)
    assert kernel.path(x) == "compiled" and "scratch_scale" not in fused.failed_kernels()


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: the native operators cannot be built")
def test_native_operators_build_and_load():
    assert native.ops() is not None, native.failure()
    for name in ("scale_norm", "rms_norm", "dynamic_tanh"):
        assert callable(getattr(native.ops(), name))  # AttributeError if not registered


@pytest.mark.slow
def test_native_build_failure_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_ops", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    x = make_input(TRAIN_SHAPE)
    module = randomized(RMSNorm(D))
    with pytest.warns(RuntimeWarning, match="native CPU norm kernels unavailable.*no-such"):
        assert module.fast_path(x) == "compiled"
    assert_rel_close(module(x).detach(), module.reference(x).detach())


@pytest.mark.slow
def test_bench_norms_smoke(tmp_path):
    """Two rounds, each a process of its own (forks of this one: tests/inprocess.py)."""
    from fairseq_normplug.bench import bench_norms

    out = tmp_path / "bench_norms.md"
    with forked_commands():
        text = bench_norms.main(["--shapes", "2x3x16,1x2x16", "--reps", "2", "--reference",
                                 "--eager", "--rounds", "2", "--out", str(out)])
    assert out.read_text() == text
    for name in ["layernorm", "scalenorm", "rmsnorm", "dyt", "dyt-hardtanh", "dyt-sigmoid", "derf", "dyisru",
                 "scalenorm-ref", "dyt-eager", "(copy floor)"]:
        assert f"| {name} " in text
    assert "### 2x3x16 float32" in text and "### 1x2x16 float32" in text
    data = json.loads((tmp_path / "bench_norms.json").read_text())
    medians = data["results"][0]["medians_s"]
    assert all(math.isfinite(v) and v > 0 for v in medians.values())
    assert {"layernorm|fwd", "layernorm|fwd+bwd", "floor|fwd", "floor|fwd+bwd"} <= set(medians)
    # two fresh processes: median ratios, with each ratio's range over the rounds around it
    assert data["rounds"] == 2 and "| f+b /LN range |" in text
    for result in data["results"]:
        assert result["ratios"]["layernorm|fwd+bwd|LN"] == 1.0
        for key, (low, high) in result["ratio_ranges"].items():
            assert low <= result["ratios"][key] <= high


def test_bench_norms_bad_rounds():
    from fairseq_normplug.bench import bench_norms

    with pytest.raises(SystemExit) as exit_info:
        bench_norms.main(["--rounds", "0"])
    assert exit_info.value.code == 2


@pytest.mark.slow
def test_bench_train_smoke(tiny_bin, tmp_path):
    """On the session's binarized corpus (--data): no synthetic corpus made, no fairseq-preprocess
    process (prepare_data's command is tested in test_fairseq_commands.py). The trainings are forks
    of this process (tests/inprocess.py's forked_commands, through the seam
    fairseq_normplug/command_start.py): the subject is the benchmark's runs and table, not the
    start of a Python."""
    from fairseq_normplug.bench import bench_train

    out = tmp_path / "bench_train.md"
    with forked_commands():
        text = bench_train.main([
            "--variants", "stock,off,scalenorm", "--reps", "1", "--max-update", "4",
            "--skip-updates", "1", "--log-interval", "1", "--data", tiny_bin,
            "--max-tokens", "512", "--workdir", str(tmp_path / "work"), "--out", str(out),
            "--also-against", "off",
        ])
    assert out.read_text() == text
    assert f"corpus {tiny_bin})" in text and not os.path.exists(tmp_path / "work")
    for variant in ["stock", "off", "scalenorm"]:
        assert f"| {variant} " in text
    runs = json.loads((tmp_path / "bench_train.json").read_text())["runs"]
    assert runs["stock"][0]["wps"] > 0 and runs["scalenorm"][0]["peak_rss_mb"] > 0
    table = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    header, cells = [c.strip() for c in table[0]], {row[0].strip(): [c.strip() for c in row] for row in table[1:]}
    assert header[-2:] == ["vs off", "RSS vs off"]
    assert cells["off"][-2:] == ["1.000", "1.000"] and cells["stock"][3] == "1.000"
    expected = runs["scalenorm"][0]["wps"] / runs["off"][0]["wps"]
    assert float(cells["scalenorm"][-2]) == pytest.approx(expected, abs=1e-3)
    with pytest.raises(SystemExit) as refused:  # a reference that is not benchmarked
        bench_train.main(["--variants", "stock,off", "--also-against", "prenorm", "--out", str(out)])
    assert refused.value.code == 2


def test_bench_train_refuses_data_that_is_not_binarized(tmp_path, capsys):
    from fairseq_normplug.bench import bench_train

    with pytest.raises(SystemExit) as refused:
        bench_train.main(["--data", str(tmp_path), "--out", str(tmp_path / "b.md")])
    assert refused.value.code == 2
    assert f"--data {tmp_path} is not a binarized corpus" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # refused before any work
