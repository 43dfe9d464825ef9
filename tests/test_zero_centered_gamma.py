"""--zero-centered-gamma (TransformerEngine ``zero_centered_gamma``, Megatron-LM
``--apply-layernorm-1p``): each norm's gain stored as gamma (init 0) and applied as 1 + gamma.
Hand-computed formulas per norm type, the equivalence with a stock norm of gain 1 + gamma
(values and gradients), init-time equality of whole models with the flag on and off, the fast
paths against the reference, the readers of the gain, refusals, and fairseq-train + reload."""
import math
from types import SimpleNamespace

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf

from inprocess import run_forked
from fairseq_normplug.diagnostics import fitting
from fairseq_normplug.diagnostics.convert import converted_state
from fairseq_normplug.diagnostics.plot_norms import site_statistics
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.normplug_args import resolve_normplug_args
from fairseq_normplug.modules import fused
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.layer_norm_1p import LayerNorm1p
from fairseq_normplug.modules.norm_base import effective_gain
from fairseq_normplug.modules.norm_registry import NORM_TYPES, build_norm, norm_args, zero_centered_gamma_types
from fairseq_normplug.modules.norm_stats import norm_scale_stats
from fairseq_normplug.modules.rms_norm import RMSNorm
from model_helpers import build, parse_args, toy_batch
from test_cli import TRAIN_COMMON, cli, log_records
from test_fast_norms import (PATH_SWITCHES, assert_fast_path_matches_reference, assert_rel_close, make_input,
                             values_and_grads)

TINY = "transformer_normplug_tiny"
SUPPORTED = ("layernorm", "rmsnorm", "dyt", "derf", "dyisru")
EPS = 1e-5


def make(norm_type, dim, zero_centered):
    """One norm of ``norm_type`` built as the model builds it (``build_norm``)."""
    args = norm_args(norm_type)  # resolved without the flag, so build_norm's own refusal is tested too
    args.zero_centered_gamma = zero_centered
    return build_norm(args, dim)


def set_params(module, seed=0):
    """Non-default values for every parameter (gamma, beta, alpha, shift, beta of DyISRU)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "weight":
                p.copy_(0.3 * torch.randn(p.shape, generator=g))  # gamma: small, around 0
            elif name == "bias":
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:  # positive scalars: alpha, shift (any sign), DyISRU beta
                p.mul_(1.2).add_(0.05)
    return module


def by_hand(norm_type, module, x):
    """Each type's equation written out, with gain 1 + gamma (gamma = ``module.weight``)."""
    gain = 1 + module.weight.detach()
    if norm_type == "layernorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return gain * (x - mean) / torch.sqrt(var + EPS) + module.bias
    if norm_type == "rmsnorm":
        return gain * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    if norm_type == "dyt":
        return gain * torch.tanh(module.alpha * x) + module.bias
    if norm_type == "derf":
        return gain * torch.erf(module.alpha * x + module.shift) + module.bias
    return gain * math.sqrt(x.shape[-1]) * x / torch.sqrt(module.beta + x * x)  # dyisru


# ---- one norm --------------------------------------------------------------------------

def test_hand_numbers_of_layernorm_1p_and_rmsnorm():
    """x = (1, 3): mean 2, var 1, rms sqrt(5); gamma = (0.5, -0.25), beta = (0.1, 0)."""
    x = torch.tensor([[1.0, 3.0]])
    ln, rms = LayerNorm1p(2), RMSNorm(2, zero_centered_gamma=True)
    with torch.no_grad():
        ln.weight.copy_(torch.tensor([0.5, -0.25]))
        ln.bias.copy_(torch.tensor([0.1, 0.0]))
        rms.weight.copy_(torch.tensor([0.5, -0.25]))
    s = 1 / math.sqrt(1 + EPS)
    assert ln(x).tolist()[0] == pytest.approx([1.5 * -s + 0.1, 0.75 * s], rel=1e-6)
    r = 1 / math.sqrt(5 + EPS)
    assert rms(x).tolist()[0] == pytest.approx([1.5 * r, 0.75 * 3 * r], rel=1e-6)


@pytest.mark.parametrize("norm_type", zero_centered_gamma_types())
def test_every_gain_norm_type_starts_equal_to_its_stock_form(norm_type):
    """Every registered norm type with a per-channel gain (researchers' and the 2024-2026 designs
    included): gamma starts at 0 and the zero-centred norm then computes what the stock one does."""
    plain = build_norm(norm_args(norm_type), 16)
    centered = build_norm(norm_args(norm_type, zero_centered_gamma=True), 16)
    assert torch.equal(centered.weight, torch.zeros(16))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(centered(x), plain(x))


@pytest.mark.parametrize("norm_type", SUPPORTED)
def test_formula_and_equivalence_with_a_stock_gain_of_one_plus_gamma(norm_type):
    """The zero-centred norm computes its equation with gain 1 + gamma (forward and, for the
    FormulaNorms, ``reference``), and equals the stock norm whose weight is 1 + gamma, in values
    and in gradients: d/dgamma = d/dg, so the gradient reaches gamma unchanged."""
    zc = set_params(make(norm_type, 16, True))
    assert zc.zero_centered_gamma
    stock = make(norm_type, 16, False)
    assert not getattr(stock, "zero_centered_gamma", False)
    with torch.no_grad():
        for name, p in stock.named_parameters():
            p.copy_(1 + zc.weight if name == "weight" else getattr(zc, name))
    x = make_input((5, 3, 16), tiny_rows=False)
    grad = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(3))
    expected = by_hand(norm_type, zc, x)
    assert_rel_close(zc(x).detach(), expected)
    if hasattr(zc, "reference"):
        assert_rel_close(zc.reference(x).detach(), expected)
    zc_out = values_and_grads(zc, zc, x, grad)
    stock_out = values_and_grads(stock, stock, x, grad)
    for a, b in zip(zc_out, stock_out):  # output, dx, then the parameters in the same order
        assert_rel_close(a, b)
    names = [n for n, p in zc.named_parameters() if p.requires_grad]
    weight_grad = zc_out[1 + names.index("weight")]
    assert weight_grad.abs().max() > 1e-3  # the gradient reaches gamma


@pytest.mark.parametrize("norm_type", ["rmsnorm", "dyt"])
@pytest.mark.parametrize("shape", [(64, 16, 128), (1, 8, 128)], ids=["train", "decode-step"])
def test_fast_paths_take_the_effective_gain_and_match_the_reference(norm_type, shape, path):
    """RMSNorm and DyT keep their fast paths (native C++, eager) with the flag, and they agree with ``reference`` (the formula with 1 + gamma) in values and gradients."""
    assert_fast_path_matches_reference(set_params(make(norm_type, 128, True)), make_input(shape), path)


@pytest.mark.parametrize("norm_type", SUPPORTED)
def test_bf16_gain_is_computed_in_float32(norm_type):
    """In a bf16 model gamma is bf16, but 1 + gamma is formed in float32: a gamma of 2^-10
    survives (bf16 would round 1 + 2^-10 to 1), and the output is in the input's dtype."""
    module = make(norm_type, 8, True).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.fill_(2 ** -10)
    gain = effective_gain(module)
    assert gain.dtype == torch.float32 and torch.all(gain == 1 + 2 ** -10)
    x = torch.randn(4, 8).to(torch.bfloat16)
    out = module(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    reference = by_hand(norm_type, module.float(), x.float())
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.fixture(params=["native", "eager"])
def path(request):
    """The native CPU operators (the float32 default) and the eager kernels. The compiled path
    runs the same kernel functions with the same weight argument; test_fast_norms.py compiles
    them (skipped here: about 30 s of torch.compile)."""
    with fused.disable(*PATH_SWITCHES[request.param]):
        yield request.param


# ---- whole models ----------------------------------------------------------------------

FLAG_SETS = {
    "postnorm-layernorm": [],
    "prenorm-layernorm": ["--prenorm"],
    "prenorm-rmsnorm": ["--prenorm", "--rmsnorm"],
    "postnorm-dyt": ["--dyt"],
    "prenorm-derf": ["--prenorm", "--norm-type", "derf"],
    "postnorm-dyisru-smallinit": ["--norm-type", "dyisru", "--smallinit"],
}


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_model_at_init_equals_the_flag_off_model(tiny_bin, name):
    """Same seed, flag on vs off: every gamma starts at 0, the flag-off layernorm model keeps
    fairseq's own LayerNorm, the parameter names and every other value are the same, and the
    two models give the same output; after one backward every gamma has a gradient."""
    flags = FLAG_SETS[name]
    off, task, _ = build(tiny_bin, TINY, *flags)
    on, _, args = build(tiny_bin, TINY, *flags, "--zero-centered-gamma")
    assert args.zero_centered_gamma is True
    norms_off, norms_on = named_norms(off), named_norms(on)
    assert list(norms_off) == list(norms_on) and len(norms_on) >= 5
    for site, norm in norms_on.items():
        assert norm.zero_centered_gamma and torch.all(norm.weight == 0), site
        assert not getattr(norms_off[site], "zero_centered_gamma", False)
        if not flags or flags == ["--prenorm"]:
            assert type(norms_off[site]) is torch.nn.LayerNorm and type(norm) is LayerNorm1p
    state_off, state_on = off.state_dict(), on.state_dict()
    assert list(state_off) == list(state_on)
    gains = {f"{name}.weight" for name, m in on.named_modules() if getattr(m, "zero_centered_gamma", False)}
    for key, value in state_on.items():
        expected = state_off[key] - 1 if key in gains else state_off[key]
        assert torch.equal(value, expected), key
    off.eval(), on.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        out_off, out_on = off(src, lengths, prev)[0], on(src, lengths, prev)[0]
    assert torch.equal(out_on, out_off)  # gain exactly 1 + 0 = 1: bit for bit
    on.train()
    on(src, lengths, prev)[0].logsumexp(-1).sum().backward()
    for site, norm in norms_on.items():
        assert norm.weight.grad is not None and norm.weight.grad.abs().max() > 0, site


@pytest.mark.parametrize("norm_type,flags,message", [
    ("identity", ["--norm-type", "identity"],
     "--zero-centered-gamma cannot be used with --norm-type identity (it has no gain)"),
    ("scalenorm", ["--scalenorm"], "--zero-centered-gamma cannot be used with --norm-type scalenorm "
                                   "(its g is one learned scale initialised to sqrt(d)"),
])
def test_refused_norm_types_give_one_line_errors_before_data_is_read(tmp_path, norm_type, flags, message):
    """Refused while the arguments are resolved (the data directory does not even exist), and
    by ``build_norm`` too."""
    with pytest.raises(NormplugError) as error:
        parse_args(str(tmp_path / "no-such-data"), TINY, *flags, "--zero-centered-gamma")
    text = str(error.value)
    assert message in text and "\n" not in text
    applies = text.rsplit("it applies to ", 1)[1].split(", ")
    assert applies == list(zero_centered_gamma_types())  # the registry's list, whatever is registered
    assert {"layernorm", "rmsnorm", "dyt", "derf", "dyisru", "seednorm"} <= set(applies)
    assert norm_type not in applies
    with pytest.raises(NormplugError, match="--zero-centered-gamma cannot be used"):
        make(norm_type, 8, True)


def test_flag_off_resolves_to_a_stock_spec(tmp_path):
    args = parse_args(str(tmp_path / "none"), TINY, "--rmsnorm")
    assert resolve_normplug_args(args).norm is NORM_TYPES["rmsnorm"] and args.zero_centered_gamma is False
    args = parse_args(str(tmp_path / "none"), TINY, "--zero-centered-gamma")
    assert resolve_normplug_args(args).norm is NORM_TYPES["layernorm"] and args.zero_centered_gamma is True


# ---- readers of the gain ---------------------------------------------------------------

def test_stats_plots_and_conversion_read_the_applied_gain():
    """norm_stats' ``gain`` and plot_norms' ``gain`` column are mean |1 + gamma|; the LN->DyT
    conversion copies 1 + gamma into a stock DyT (and fits it to the LayerNorm1p's outputs), and
    the converted checkpoint's configuration switches the flag off."""
    ln = set_params(LayerNorm1p(16))
    applied = (1 + ln.weight.detach()).abs().mean().item()
    assert norm_scale_stats(ln)["gain"] == pytest.approx(applied)
    dyt = set_params(make("dyt", 16, True))
    stats = norm_scale_stats(dyt)
    assert stats["gain"] == pytest.approx((1 + dyt.weight.detach()).abs().mean().item())
    assert stats["alpha"] == pytest.approx(float(dyt.alpha))
    x = make_input((40, 16), tiny_rows=False)
    row = site_statistics("enc0.ffn", ln, x)
    assert row["norm_type"] == "layernorm" and row["gain"] == pytest.approx(applied)

    assert fitting.is_layer_norm(ln)
    naive = fitting.naive_dyt(ln)
    assert not naive.zero_centered_gamma and torch.equal(naive.weight, 1 + ln.weight.detach())
    with torch.no_grad():
        y = ln(x)
    fitted, info = fitting.fit_dyt(ln, x, y, refit_gamma=False)
    assert torch.equal(fitted.weight, 1 + ln.weight.detach())
    assert info["mse"] < info["naive_mse"]

    model_cfg = {"arch": "transformer_normplug", "_name": "transformer_normplug", "norm_type": "layernorm",
                 "zero_centered_gamma": True}
    loaded = SimpleNamespace(state={"cfg": OmegaConf.create({"model": model_cfg, "common": {}}), "model": {}})
    state = converted_state(loaded, torch.nn.Linear(1, 1), "dyt")
    assert state["cfg"]["model"]["norm_type"] == "dyt" and state["cfg"]["model"]["zero_centered_gamma"] is False
    loaded.state["cfg"] = OmegaConf.create({"model": {"norm_type": "layernorm"}, "common": {}})
    assert "zero_centered_gamma" not in converted_state(loaded, torch.nn.Linear(1, 1), "dyt")["cfg"]["model"]


# ---- the command line ------------------------------------------------------------------

RUNS = {"dyt": ["--dyt", "--norm-stats-interval", "5"], "prenorm-rmsnorm": ["--prenorm", "--rmsnorm"]}


@pytest.mark.slow
def test_fairseq_train_and_reload(tiny_bin, tmp_path):
    """10 updates of fairseq-train with --zero-centered-gamma (DyT; PreNorm RMSNorm), both at
    once: finite losses, the logged mean gain is that of 1 + gamma (about 1, not 0), and the
    checkpoint reloads, as fairseq-generate loads it, with zero-centred norms and the trained
    (now non-zero) gammas. The two trainings are forks of this process (tests/inprocess.py)."""
    commands = [[cli("fairseq-train"), tiny_bin, "--arch", TINY, *TRAIN_COMMON, "--save-dir",
                 str(tmp_path / name), "--max-update", "10", "--zero-centered-gamma", *flags]
                for name, flags in RUNS.items()]
    for name, proc in zip(RUNS, run_forked(commands)):
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = log_records(proc, "train")[-1]
        assert record["train_num_updates"] == "10" and math.isfinite(float(record["train_loss"]))
        if name == "dyt":
            inner = log_records(proc, "train_inner")[-1]
            assert float(inner["gain:enc0.attn"]) == pytest.approx(1.0, abs=0.05)
        (model,), cfg = checkpoint_utils.load_model_ensemble([str(tmp_path / name / "checkpoint_last.pt")],
                                                            arg_overrides={"data": tiny_bin})
        assert cfg.model.zero_centered_gamma is True
        norms = named_norms(model)
        assert norms and all(norm.zero_centered_gamma for norm in norms.values())
        assert all(norm.weight.abs().max() > 0 for norm in norms.values())  # trained away from 0
        expected_type = DynamicTanh if name == "dyt" else RMSNorm
        assert all(type(norm) is expected_type for norm in norms.values())
