"""Issue 36: the DyT ablations (--dyt-alpha-per-channel, --dyt-no-affine, --derf-no-affine) and
the four details found by comparing the layers with their authors' code: ResiDual's final-norm
eps, QKNorm's projection dtype, the authors' (1,)-shaped DyT/Derf scalars, RMSNorm's eps."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.modules.derf import Derf
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.norm_registry import AUTO, NormSlot, build_norm, norm_args
from fairseq_normplug.modules.norm_stats import norm_scale_stats
from fairseq_normplug.modules.qknorm import HeadNormProjection, install_qknorm
from fairseq_normplug.modules.rms_norm import RMSNorm
from model_helpers import (assert_incremental_matches_full, assert_training_steps_reach_every_parameter, build,
                           randomized, toy_batch)
from test_cli import HALF_BATCHES, NO_LOADER_WORKERS, USER_DIR, log_records, train

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers
D = 16


# ---- DyT / Derf ablations -----------------------------------------------------------------

def test_dyt_per_channel_alpha_values_gradients_and_path():
    """One alpha per channel: the fused kernels (not the native operator, which takes one alpha)
    give the formula's values and per-channel gradients."""
    norm = randomized(DynamicTanh(D, alpha_per_channel=True))
    assert norm.alpha.shape == (D,) and norm.alpha.unique().numel() == D
    x = (3 * torch.randn(4, 5, D)).requires_grad_(True)
    assert norm.fast_path(x) in ("eager", "compiled")
    out = norm(x)
    out.backward(torch.ones_like(out))
    grads = [x.grad.clone(), norm.alpha.grad.clone(), norm.weight.grad.clone()]
    x.grad = None
    norm.zero_grad()
    expected = norm.weight * torch.tanh(norm.alpha * x) + norm.bias
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, [x.grad, norm.alpha.grad, norm.weight.grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ablations_compute_in_float32_for_half_input(dtype):
    # seeded: the fast path's float32 tanh and the formula's round to different float16 values (1 ulp)
    # for about one draw in 150, so an unseeded draw made the result depend on the tests run before it
    torch.manual_seed(0)
    x = (3 * torch.randn(6, D)).to(dtype)
    for norm in (randomized(DynamicTanh(D, alpha_per_channel=True)), DynamicTanh(D, alpha_init=0.7, affine=False),
                 randomized(Derf(D, affine=False))):
        norm.to(dtype)
        params = {name: p.float() for name, p in norm.named_parameters()}
        expected = norm.formula(x.float(), **params).to(dtype)
        out = norm(x)
        assert out.dtype == dtype and torch.equal(out, expected)


def test_no_affine_has_no_gain_and_is_the_bare_squash():
    dyt, derf = DynamicTanh(D, alpha_init=0.7, affine=False), randomized(Derf(D, affine=False))
    assert list(dyt.state_dict()) == ["alpha"] and list(derf.state_dict()) == ["alpha", "shift"]
    x = 3 * torch.randn(4, D)
    torch.testing.assert_close(dyt(x), torch.tanh(0.7 * x))
    torch.testing.assert_close(derf(x), torch.erf(derf.alpha * x + derf.shift))
    assert dyt.fast_path(x) == derf.fast_path(x) == "plain"
    assert "gain" not in norm_scale_stats(dyt) and norm_scale_stats(dyt)["alpha"] == pytest.approx(0.7)


def test_ablation_flags_compose_with_init_squash_and_freeze():
    args = norm_args("dyt", dyt_alpha_per_channel=True, dyt_no_affine=True, dyt_alpha_init=0.3,
                     dyt_squash="hardtanh", dyt_freeze_alpha=True)
    norm = build_norm(args, D)
    assert torch.equal(norm.alpha, torch.full((D,), 0.3)) and not norm.alpha.requires_grad
    assert norm.squash == "hardtanh" and not hasattr(norm, "weight")
    x = torch.randn(3, D)
    torch.testing.assert_close(norm(x), (0.3 * x).clamp(-1, 1))
    # auto: every channel starts at the one 1/std of the whole input (auto_init.py's moments)
    auto = build_norm(norm_args("dyt", dyt_alpha_per_channel=True, dyt_alpha_init=AUTO), D, NormSlot())
    assert auto.auto_init
    inputs = 0.2 + 4 * torch.randn(200, D, dtype=torch.float64)
    value = auto.init_from_input(inputs.mean().item(), inputs.pow(2).mean().item())
    assert value == pytest.approx(1 / inputs.std(unbiased=False).item())
    torch.testing.assert_close(auto.alpha, torch.full((D,), value, dtype=torch.float32))
    assert norm_scale_stats(auto)["alpha"] == pytest.approx(value, rel=1e-6)
    derf = build_norm(norm_args("derf", derf_no_affine=True, derf_alpha_init=0.9), D)
    assert derf.alpha.item() == pytest.approx(0.9) and not hasattr(derf, "weight")


@pytest.mark.parametrize("values,message", [
    ({"norm_type": "dyt", "dyt_no_affine": True, "zero_centered_gamma": True},
     "--dyt-no-affine cannot be combined with --zero-centered-gamma"),
    ({"norm_type": "derf", "derf_no_affine": True, "zero_centered_gamma": True},
     "--derf-no-affine cannot be combined with --zero-centered-gamma"),
    ({"norm_type": "rmsnorm", "dyt_alpha_per_channel": True}, "--dyt-alpha-per-channel needs --norm-type dyt"),
    ({"norm_type": "dyt", "derf_no_affine": True}, "--derf-no-affine needs --norm-type derf"),
])
def test_contradictions_are_refused_in_one_line(values, message):
    with pytest.raises(NormplugError, match=message) as error:
        norm_args(**values)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags", [["--dyt", "--dyt-alpha-per-channel"], ["--dyt", "--dyt-no-affine"],
                                   ["--norm-type", "derf", "--derf-no-affine"]], ids=["per-channel", "dyt-no-affine",
                                                                                     "derf-no-affine"])
def test_ablation_models_train_and_decode_incrementally(tiny_bin, flags):
    model, task, args = build(tiny_bin, TINY, "--prenorm", *flags)
    norms = named_norms(model).values()
    if "--dyt-alpha-per-channel" in flags:
        assert all(n.alpha.shape == (64,) for n in norms)
    else:
        assert all(not hasattr(n, "weight") and not hasattr(n, "bias") for n in norms)
    assert_training_steps_reach_every_parameter(model, task, args)
    assert_incremental_matches_full(model, task)


def test_fairseq_train_20_updates_and_generate(tiny_bin, tmp_path):
    """Both DyT ablations at once through fairseq-train (20 updates) and fairseq-generate."""
    save_dir = tmp_path / "dyt"
    proc = train(tiny_bin, save_dir, ["--prenorm", "--dyt", "--dyt-alpha-per-channel", "--dyt-no-affine"], 20,
                 extra=["--log-interval", "1", *HALF_BATCHES])
    records = log_records(proc, "train_inner")
    assert len(records) == 20 and all(math.isfinite(float(r["loss"])) for r in records)
    checkpoint = str(save_dir / "checkpoint_last.pt")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    alphas = {k: v for k, v in state.items() if k.endswith("self_attn_layer_norm.alpha")}
    assert alphas and all(v.shape == (64,) and v.unique().numel() > 1 for v in alphas.values())  # trained per channel
    assert not any(k.endswith("self_attn_layer_norm.weight") for k in state)
    gen = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                       "--beam", "2", "--cpu", "--max-tokens", "4000", "--gen-subset", "test",
                       "--required-batch-size-multiple", "1", "--max-len-a", "0", "--max-len-b", "6",
                       *NO_LOADER_WORKERS])
    assert len([line for line in gen.stdout.splitlines() if line.startswith("H-")]) == 100


# ---- detail: the authors' (1,)-shaped alpha and shift load -------------------------------

def authors_state(dim, **scalars):
    """A state dict as the authors' DyT/Derf modules save it: scalars as ``torch.ones(1) * v``."""
    g = torch.Generator().manual_seed(4)
    return {**{name: torch.ones(1) * value for name, value in scalars.items()},
            "weight": 1 + torch.randn(dim, generator=g), "bias": torch.randn(dim, generator=g)}


@pytest.mark.parametrize("make,scalars,formula", [
    (DynamicTanh, {"alpha": 0.7}, lambda s, x: s["weight"] * torch.tanh(s["alpha"] * x) + s["bias"]),
    (Derf, {"alpha": 0.7, "shift": 0.2},
     lambda s, x: s["weight"] * torch.erf(s["alpha"] * x + s["shift"]) + s["bias"]),
], ids=["dyt", "derf"])
def test_authors_and_our_own_state_dicts_load(make, scalars, formula):
    authors = authors_state(D, **scalars)
    ours = make(D)
    ours.load_state_dict(authors)
    assert all(getattr(ours, name).shape == () for name in scalars)  # our shape, and our checkpoints' shape
    x = 3 * torch.randn(5, D)
    torch.testing.assert_close(ours(x), formula(authors, x))
    old = randomized(make(D)).state_dict()  # this project's checkpoints: 0-dim scalars
    again = make(D)
    again.load_state_dict(old)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in old.items())
    with pytest.raises(RuntimeError, match="size mismatch"):  # only (1,) is reshaped
        make(D).load_state_dict({**authors, "alpha": torch.ones(2)})


def test_per_channel_alpha_loads_its_own_shape_and_a_model_loads_authors_scalars(tiny_bin):
    per_channel = randomized(DynamicTanh(D, alpha_per_channel=True))
    fresh = DynamicTanh(D, alpha_per_channel=True)
    fresh.load_state_dict(per_channel.state_dict())
    assert fresh.alpha.shape == (D,) and torch.equal(fresh.alpha, per_channel.alpha)
    model, task, _ = build(tiny_bin, TINY, "--prenorm", "--dyt")
    state = model.state_dict()
    state = {k: (v.reshape(1) * 0 + 0.3 if k.endswith(".alpha") else v) for k, v in state.items()}
    model.load_state_dict(state)  # through fairseq's model.load_state_dict
    assert all(n.alpha.shape == () and n.alpha.item() == pytest.approx(0.3) for n in named_norms(model).values())


# ---- detail: ResiDual's final norm of the PreNorm stream uses eps 1e-7 --------------------

@pytest.mark.parametrize("flags,final_eps,other_eps", [
    ([], 1e-7, 1e-5), (["--zero-centered-gamma"], 1e-7, 1e-5), (["--rmsnorm", "--norm-eps", "1e-6"], 1e-6, 1e-6),
], ids=["layernorm", "layernorm1p", "rmsnorm"])
def test_resi_dual_final_norm_eps(tiny_bin, flags, final_eps, other_eps):
    """LN_f of the PreNorm stream: the authors' eps 1e-7 for a LayerNorm; other norm types keep
    --norm-eps; every other norm keeps its own eps."""
    model, _, _ = build(tiny_bin, TINY, "--norm-placement", "resi-dual", *flags)
    for stack in (model.encoder, model.decoder):
        assert stack.layers[-1].resi_dual_layer_norm.eps == final_eps
        assert stack.layers[-1].final_layer_norm.eps == other_eps
    if not flags:  # numerically: a small-variance input shows the eps
        final = model.decoder.layers[-1].resi_dual_layer_norm
        x = 1e-3 * torch.randn(3, 64)
        with torch.no_grad():
            torch.testing.assert_close(final(x), F.layer_norm(x, (64,), final.weight, final.bias, 1e-7))
            assert not torch.allclose(final(x), F.layer_norm(x, (64,), final.weight, final.bias, 1e-5), atol=1e-2)


# ---- detail: QKNorm's projections keep the attention module's dtype ----------------------

def test_qknorm_in_float64(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--qknorm", "--qknorm-g0", "3")
    src, lengths, prev = toy_batch(task)
    model.eval()
    with torch.no_grad():
        single = model(src, lengths, prev)[0]
        model.double()
        double = model(src, lengths, prev)[0]
    assert double.dtype == torch.float64 and torch.allclose(double.float(), single, atol=1e-4)
    # installed on a model that is float64 already: the weights are not rounded through float32
    plain, task, _ = build(tiny_bin, TINY)
    plain.double().eval()
    weights = {id(a): (a.q_proj.weight.clone(), a.k_proj.weight.clone())
               for a in (plain.encoder.layers[0].self_attn, plain.decoder.layers[1].encoder_attn)}
    install_qknorm(plain, 3.0)
    for attn in (plain.encoder.layers[0].self_attn, plain.decoder.layers[1].encoder_attn):
        q, k = weights[id(attn)]
        assert isinstance(attn.q_proj, HeadNormProjection) and attn.q_proj.g.dtype == torch.float64
        assert torch.equal(attn.q_proj.weight, q) and torch.equal(attn.k_proj.weight, k)
    h = torch.randn(5, 64, dtype=torch.float64)
    attn = plain.encoder.layers[0].self_attn
    expected = 3.0 * F.normalize((h @ attn.q_proj.weight.t() + attn.q_proj.bias).view(5, 2, 32), dim=-1).view(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(attn.q_proj(h), expected)
        assert plain(src, lengths, prev)[0].dtype == torch.float64


# ---- detail: RMSNorm keeps eps inside the square root -------------------------------------

def test_rmsnorm_eps_convention():
    """Ours (torch nn.RMSNorm, LLaMA): x / sqrt(mean(x^2) + eps) * g. The RMSNorm authors
    (bzhangGo/rmsnorm rmsnorm_torch.py:47-48): x / (rms + eps) * g. Equal for rms >> sqrt(eps);
    for rms = 1e-3 and eps = 1e-5 ours is (rms + eps) / sqrt(rms^2 + eps) = 0.3045 of theirs."""
    eps, rms = 1e-5, 1e-3
    norm = randomized(RMSNorm(D, eps=eps))
    x = torch.randn(4, D, dtype=torch.float64)
    x = (x * rms / x.pow(2).mean(-1, keepdim=True).sqrt()).float()  # every row has rms 1e-3
    out = norm(x)
    torch.testing.assert_close(out, F.rms_norm(x, (D,), norm.weight, eps))
    torch.testing.assert_close(out, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight)
    authors = x / (x.norm(dim=-1, keepdim=True) * D ** -0.5 + eps) * norm.weight
    torch.testing.assert_close(out / authors, torch.full_like(out, (rms + eps) / math.sqrt(rms ** 2 + eps)),
                               rtol=1e-4, atol=0)
    assert (rms + eps) / math.sqrt(rms ** 2 + eps) == pytest.approx(0.3045, abs=1e-4)
    big = 3 * torch.randn(4, D)  # rms ~ 3: the two conventions agree to ~1e-6
    authors_big = big / (big.norm(dim=-1, keepdim=True) * D ** -0.5 + eps) * norm.weight
    torch.testing.assert_close(norm(big), authors_big, rtol=1e-5, atol=1e-5)


# ---- what --norm-stats-interval logs of the new designs ------------------------------------

def logged_once(model, task):
    """The metrics of one training forward at a sampled update (--norm-stats-interval 5)."""
    from fairseq.logging import metrics
    src, lengths, prev = toy_batch(task)
    model.train()
    model.set_num_updates(5)
    with metrics.aggregate(new_root=True) as agg:
        model(src, lengths, prev)
    return agg.get_smoothed_values()


@pytest.mark.parametrize("flags,expected", [
    (["--prenorm", "--norm-type", "tapernorm", "--taper-updates", "10", "20"],
     {"taper_gate:enc0.attn": 1.0, "taper_gate:dec.final": 1.0}),
    (["--prenorm", "--norm-type", "seednorm"], {"seed_alpha:enc1.ffn": 1.0, "seed_beta:dec0.cross": 0.0}),
    (["--prenorm", "--gpas"], {"gate:enc0.gpas": 0.0, "gate:dec1.gpas": 0.0}),
])
def test_the_new_designs_log_their_own_statistics(tiny_bin, flags, expected):
    """TaperNorm's gate g and scaling s, SeeDNorm's mean |alpha| and |beta|, GPAS's gates (with
    the std of what each scales), at their inits."""
    model, task, _ = build(tiny_bin, TINY, *flags, "--norm-stats-interval", "5")
    model.train()
    model(*toy_batch(task))  # update 0, not sampled: TaperNorm calibrates s (logged below)
    values = logged_once(model, task)
    for key, value in expected.items():
        assert values[key] == pytest.approx(value), key
    if "--gpas" in flags:
        assert values["in_std:enc0.gpas"] > 0
    if "tapernorm" in flags:
        assert values["taper_s:enc0.attn"] > 0 and "taper_s:dec.final" in values
