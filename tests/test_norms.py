"""Each norm layer against its formula written out here, values and gradients."""
import math

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call

from fairseq.modules import LayerNorm
from fairseq_normplug.modules.derf import Derf
from fairseq_normplug.modules.dyisru import DyISRU
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.norm_registry import AUTO, ATTENTION, FFN, NORM_TYPES, NormSlot, build_norm, norm_args
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm
from model_helpers import randomized

D = 16


def test_scalenorm_formula_and_init():
    norm = ScaleNorm(D, eps=1e-5)
    assert norm.g.item() == pytest.approx(math.sqrt(D))
    x = torch.randn(4, 3, D)
    expected = math.sqrt(D) * x / x.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)
    # every output row has norm g
    torch.testing.assert_close(norm(x).norm(dim=-1), torch.full((4, 3), math.sqrt(D)), rtol=1e-5, atol=1e-5)


def test_scalenorm_clamps_tiny_norms_at_eps():
    norm = ScaleNorm(D, eps=1e-3)
    x = torch.full((1, D), 1e-6)
    torch.testing.assert_close(norm(x), norm.g * x / 1e-3)


def test_rmsnorm_formula():
    norm = randomized(RMSNorm(D, eps=1e-6))
    x = torch.randn(5, D)
    expected = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("squash,fn", [("tanh", torch.tanh), ("hardtanh", lambda v: v.clamp(-1, 1)),
                                       ("sigmoid", torch.sigmoid)])
def test_dyt_formula(squash, fn):
    norm = randomized(DynamicTanh(D, squash=squash))
    x = 3 * torch.randn(2, 7, D)
    expected = norm.weight * fn(norm.alpha * x) + norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_derf_formula_and_init():
    fresh = Derf(D)
    assert fresh.alpha.item() == 0.5 and fresh.shift.item() == 0  # the authors' code defaults
    assert torch.equal(fresh.weight, torch.ones(D)) and torch.equal(fresh.bias, torch.zeros(D))
    norm = randomized(Derf(D))
    x = 3 * torch.randn(2, 7, D)
    expected = norm.weight * torch.erf(norm.alpha * x + norm.shift) + norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)
    assert norm.shift.item() != 0  # the shift really enters the formula above


def test_dyisru_formula_and_init():
    fresh = DyISRU(D)
    assert fresh.beta.item() == D - 1 and torch.equal(fresh.weight, torch.ones(D))
    norm = randomized(DyISRU(D))
    x = 3 * torch.randn(2, 7, D)
    expected = norm.weight * math.sqrt(D) * x / torch.sqrt(norm.beta + x ** 2)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_dyisru_is_rmsnorm_when_beta_is_the_other_channels_sum_of_squares():
    """The paper's derivation: RMSNorm_i = sqrt(C) x_i / sqrt(x_i^2 + sum_{j != i} x_j^2)."""
    x = torch.randn(D, dtype=torch.float64)
    rms = RMSNorm(D, eps=0.0).double()(x)
    for i in (0, 5):
        norm = DyISRU(D, beta_init=float((x ** 2).sum() - x[i] ** 2)).double()
        torch.testing.assert_close(norm(x)[i], rms[i])


@pytest.mark.parametrize("make,name,expected", [
    (lambda: DynamicTanh(D), "alpha", lambda x: 1 / x.std(unbiased=False)),
    (lambda: Derf(D), "alpha", lambda x: 1 / x.std(unbiased=False)),
    (lambda: DyISRU(D), "beta", lambda x: (D - 1) * x.pow(2).mean()),
], ids=["dyt", "derf", "dyisru"])
def test_init_from_input_moments(make, name, expected):
    norm = make()
    x = 0.3 + 2.5 * torch.randn(50, D, dtype=torch.float64)
    value = norm.init_from_input(x.mean().item(), x.pow(2).mean().item())
    assert norm.auto_init_parameter == name
    assert value == pytest.approx(expected(x).item(), rel=1e-9)
    assert getattr(norm, name).item() == pytest.approx(value, rel=1e-6)


def test_identity_returns_its_input():
    norm = build_norm(norm_args("identity"), D)
    x = torch.randn(2, 3, D, requires_grad=True)
    assert norm(x) is x and norm.reference(x) is x
    assert list(norm.parameters()) == []


def test_dyt_init_values():
    norm = DynamicTanh(D, alpha_init=0.8)
    assert norm.alpha.item() == pytest.approx(0.8)
    assert torch.equal(norm.weight, torch.ones(D)) and torch.equal(norm.bias, torch.zeros(D))


@pytest.mark.parametrize("make", [
    lambda: ScaleNorm(D), lambda: RMSNorm(D), lambda: DynamicTanh(D),
    lambda: DynamicTanh(D, squash="sigmoid"), lambda: DynamicTanh(D, squash="hardtanh"),
    lambda: Derf(D), lambda: DyISRU(D),
], ids=["scalenorm", "rmsnorm", "dyt", "dyt-sigmoid", "dyt-hardtanh", "derf", "dyisru"])
def test_gradcheck_float64(make):
    torch.manual_seed(0)
    norm = randomized(make()).double()
    x = torch.randn(3, 2, D, dtype=torch.float64, requires_grad=True)
    names = [name for name, _ in norm.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in norm.parameters()]

    def fn(inp, *ps):
        return functional_call(norm, dict(zip(names, ps)), (inp,))

    # gradients with respect to the input and to every parameter
    assert gradcheck(fn, (x, *params), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("norm_type,count", [("layernorm", 2 * D), ("scalenorm", 1), ("rmsnorm", D),
                                             ("dyt", 2 * D + 1), ("derf", 2 * D + 2),
                                             ("dyisru", D + 1), ("seednorm", 3 * D), ("identity", 0),
                                             ("layernorm-fixed-std", 2 * D)])
def test_parameter_counts(norm_type, count):
    norm = build_norm(norm_args(norm_type), D)
    assert sum(p.numel() for p in norm.parameters()) == count


def test_registry_types_and_roles():
    # the package's own types (an extension another test loaded into this process stays registered)
    assert {name for name, norm in NORM_TYPES.items() if norm.source.startswith("fairseq_normplug.")} == {"layernorm", "scalenorm", "rmsnorm", "dyt", "derf", "dyisru", "seednorm", "identity",
                               "tapernorm", "layernorm-fixed-std", "bhyt"}
    assert isinstance(build_norm(norm_args(), D), type(LayerNorm(D)))
    attention, ffn_slot = NormSlot(ATTENTION), NormSlot(FFN)
    dyt = norm_args("dyt", dyt_alpha_init=0.2, dyt_attn_alpha_init=0.8, dyt_freeze_alpha=True)
    assert build_norm(dyt, D, attention).alpha.item() == pytest.approx(0.8)
    ffn = build_norm(dyt, D, ffn_slot)
    assert ffn.alpha.item() == pytest.approx(0.2) and not ffn.alpha.requires_grad
    fixed = norm_args("scalenorm", scalenorm_fixed_g=True)
    assert not build_norm(fixed, D, ffn_slot).g.requires_grad
    assert build_norm(fixed, D, NormSlot(FFN, feeds_output=True)).g.requires_grad
    # auto: built with the default value, marked for the first-batch init
    auto = norm_args("dyt", dyt_alpha_init=AUTO, dyt_attn_alpha_init=0.8)
    assert build_norm(auto, D, ffn_slot).auto_init and build_norm(auto, D, ffn_slot).alpha.item() == 0.5
    assert not build_norm(auto, D, attention).auto_init
    assert build_norm(norm_args("derf", derf_alpha_init=0.3), D).alpha.item() == pytest.approx(0.3)
    assert build_norm(norm_args("dyisru", dyisru_beta_init=AUTO), D).auto_init
    with pytest.raises(NormplugError, match="unknown --norm-type 'batchnorm'; choose from layernorm"):
        norm_args("batchnorm")
    with pytest.raises(NormplugError, match="^--dyt-squash needs --norm-type dyt \\(or --dyt\\), got --norm-type rmsnorm$"):
        norm_args("rmsnorm", dyt_squash="hardtanh")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda: ScaleNorm(D), lambda: RMSNorm(D), lambda: DynamicTanh(D),
                                  lambda: Derf(D), lambda: DyISRU(D)],
                         ids=["scalenorm", "rmsnorm", "dyt", "derf", "dyisru"])
def test_low_precision_inputs_use_fp32_statistics(make, dtype):
    norm = make()
    x = torch.randn(4, D) * 300  # sum of squares overflows fp16 (max 65504)
    out = norm.to(dtype)(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    reference = make()(x.to(dtype).float())
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
