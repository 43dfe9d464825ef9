"""SeeDNorm (``--norm-type seednorm``) and GPAS (``--gpas``): SeeDNorm against its equation
written out, its bf16 backward, GPAS's forward value and its preserved gradient on PreNorm,
Sandwich and DeepNorm (checked against the same model without GPAS), the refused
placements, incremental decoding, and 20 updates of fairseq-train followed by beam search."""
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_parameters import norm_parameter_names
from fairseq_normplug.models.placements.gpas import GPASGate, GPASLayer
from fairseq_normplug.modules.norm_registry import build_norm, norm_args
from fairseq_normplug.modules.seed_norm import SeeDNorm
from model_helpers import assert_incremental_matches_full, build, randomized
from test_beyond import beam_search, toy_sample
from test_placements import one_backward
from test_resume import train_in_process

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers
D = 64

# ---- SeeDNorm ------------------------------------------------------------------------------


def seednorm_by_hand(x, gamma, beta, alpha, eps, heads):
    """The paper's equation, one token and one head at a time:
    [tanh(x_h . beta_h) alpha_h + gamma_h] x_h / sqrt(mean(x^2) + eps)."""
    out = torch.empty_like(x)
    width = x.shape[-1] // heads
    for t in range(x.shape[0]):
        rms = math.sqrt(sum(v * v for v in x[t].tolist()) / x.shape[-1] + eps)
        for h in range(heads):
            part = slice(h * width, (h + 1) * width)
            dynamic = math.tanh(float(x[t, part] @ beta[part]))
            out[t, part] = (dynamic * alpha[part] + gamma[part]) * x[t, part] / rms
    return out


@pytest.mark.parametrize("heads", [1, 4])
def test_seednorm_is_the_papers_equation(heads):
    norm = build_norm(norm_args("seednorm", seednorm_heads=heads, norm_eps=1e-6), D).double()
    assert isinstance(norm, SeeDNorm) and norm.heads == heads
    x = torch.randn(5, D, dtype=torch.float64) * 3
    rms_norm = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    assert torch.allclose(norm(x), rms_norm)  # the inits: gamma 1, beta 0, alpha 1 give RMSNorm
    randomized(norm, seed=3)
    with torch.no_grad():
        norm.beta.normal_(0, 0.2)  # a beta of 0 would hide the dynamic term
    expected = seednorm_by_hand(x, norm.weight, norm.beta, norm.alpha, 1e-6, heads)
    assert torch.allclose(norm(x), expected, atol=1e-12)


def test_seednorm_bf16_backward_is_finite_with_float32_statistics():
    torch.manual_seed(0)
    norm = build_norm(norm_args("seednorm", seednorm_heads=2), D)
    with torch.no_grad():
        norm.beta.normal_(0, 0.5)
    norm = norm.to(torch.bfloat16)
    # the float32 reference has the bf16 model's (rounded) parameters: only the arithmetic differs
    reference = build_norm(norm_args("seednorm", seednorm_heads=2), D)
    reference.load_state_dict({name: value.float() for name, value in norm.state_dict().items()})
    x = (torch.randn(4, 7, D) * 300).to(torch.bfloat16).requires_grad_()  # x^2 is past bf16's precision
    y = norm(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    grads = [x.grad, *(p.grad for p in norm.parameters())]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    expected = reference(x.detach().float())
    assert torch.allclose(y.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("heads,message", [(0, "--seednorm-heads must be >= 1, got 0"),
                                           (3, "--seednorm-heads 3 does not divide --encoder-embed-dim 64")])
def test_bad_seednorm_heads_are_refused_in_one_line(tiny_bin, heads, message):
    with pytest.raises(NormplugError, match=message):
        build(tiny_bin, TINY, "--prenorm", "--norm-type", "seednorm", "--seednorm-heads", str(heads))


def test_seednorm_heads_needs_seednorm(tiny_bin):
    with pytest.raises(NormplugError, match="--seednorm-heads needs --norm-type seednorm, got --norm-type rmsnorm"):
        build(tiny_bin, TINY, "--prenorm", "--rmsnorm", "--seednorm-heads", "2")


# ---- GPAS ----------------------------------------------------------------------------------

#: the three placements GPAS is defined on
GPAS_PLACEMENTS = {"pre": ["--prenorm"], "sandwich": ["--norm-placement", "sandwich"],
                   "deepnorm": ["--postnorm", "--residual-scale", "deepnorm"]}


def test_gpas_value_is_scaled_and_its_gradient_preserved():
    gate = GPASGate(on_residual=False)
    with torch.no_grad():
        gate.gate.fill_(1.5)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = gate(x)
    assert torch.allclose(y, (1 - F.silu(torch.tensor(1.5, dtype=torch.float64))) * x)
    weights = torch.randn(3, 4, dtype=torch.float64)
    (y * weights).sum().backward()
    assert torch.equal(x.grad, weights)  # dGPAS/dx = I: the stop-gradient
    silu_grad = torch.sigmoid(torch.tensor(1.5)) * (1 + 1.5 * (1 - torch.sigmoid(torch.tensor(1.5))))
    assert gate.gate.grad.item() == pytest.approx(-(silu_grad * (weights * x.detach()).sum()).item(), rel=1e-6)


def gated(tiny_bin, placement, gate_value, seed=4):
    """A GPAS model of ``placement`` with every gate set to ``gate_value`` (eval mode)."""
    model, task, _ = build(tiny_bin, TINY, *GPAS_PLACEMENTS[placement], "--gpas", seed=seed)
    randomized(model, seed=2)
    with torch.no_grad():
        for layer in (*model.encoder.layers, *model.decoder.layers):
            layer.gpas.gate.fill_(gate_value)
    return model.eval(), task


def gpas_encoder_layer_by_hand(layer, x, placement, s):
    """The authors' layer (modeling_llama.py, forward of pre_gpas / sandwich_gpas /
    deeppost_gpas) with GPAS written as (1 - s) x, from the layer's own modules (eval mode)."""
    subs = [("self_attn_layer_norm", "self_attn_out_layer_norm",
             lambda h: layer.self_attn(query=h, key=h, value=h, key_padding_mask=None, need_weights=False)[0]),
            ("final_layer_norm", "final_out_layer_norm", lambda h: layer.fc2(F.relu(layer.fc1(h))))]
    for norm, out_norm, sublayer in subs:
        if placement == "deepnorm":  # LN(alpha * GPAS(x) + F(x))
            x = getattr(layer, norm)(layer.residual_scale.alpha * (1 - s) * x + sublayer(x))
            continue
        branch = sublayer(getattr(layer, norm)(x))
        if placement == "sandwich":
            branch = getattr(layer, out_norm)(branch)
        x = (1 - s) * (x + branch)  # GPAS after the residual addition
    return x


@pytest.mark.parametrize("placement", list(GPAS_PLACEMENTS))
def test_gpas_layer_forward_is_the_authors_formula(tiny_bin, placement):
    """An encoder layer with gate g = 1 is the authors' GPAS layer; g = 0 is the layer without GPAS."""
    model, _ = gated(tiny_bin, placement, 1.0)
    layer = model.encoder.layers[0]
    assert isinstance(layer, GPASLayer) and layer.gpas.on_residual == (placement == "deepnorm")
    s = F.silu(torch.tensor(1.0)).item()
    x = torch.randn(5, 2, D)
    with torch.no_grad():
        out = layer(x, None)
        assert torch.allclose(out, gpas_encoder_layer_by_hand(layer, x, placement, s), atol=1e-5)
        layer.gpas.gate.zero_()
        assert torch.allclose(layer(x, None), gpas_encoder_layer_by_hand(layer, x, placement, 0.0), atol=1e-5)
        assert not torch.allclose(layer(x, None), out, atol=1e-3)


@pytest.mark.parametrize("placement", list(GPAS_PLACEMENTS))
def test_gpas_residual_connection_scales_the_value_and_keeps_the_gradient(tiny_bin, placement):
    """A layer's residual connection with gate g = 1 against g = 0 (= without GPAS): the value
    is scaled (after the addition, or DeepNorm's residual before alpha), the gradients with
    respect to the residual and to the branch are the same (the stop-gradient)."""
    model, _ = gated(tiny_bin, placement, 1.0)
    layer = model.encoder.layers[0]
    s = F.silu(torch.tensor(1.0)).item()
    x, branch, weights = torch.randn(3, 5, 2, D).unbind(0)
    values, grads = [], []
    for g in (1.0, 0.0):
        with torch.no_grad():
            layer.gpas.gate.fill_(g)
        xi, bi = x.clone().requires_grad_(), branch.clone().requires_grad_()
        y = layer.residual_connection(bi, xi)
        grads.append(torch.autograd.grad((y * weights).sum(), (xi, bi)))
        values.append(y.detach())
    if placement == "deepnorm":
        alpha = layer.residual_scale.alpha
        assert alpha > 1 and torch.allclose(values[1], alpha * x + branch, atol=1e-6)
        assert torch.allclose(values[0], alpha * (1 - s) * x + branch, atol=1e-6)
    else:
        assert torch.allclose(values[1], x + branch, atol=1e-6)
        assert torch.allclose(values[0], (1 - s) * (x + branch), atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_gpas_model_gradient_matches_the_model_without_gpas_at_gate_zero(tiny_bin):
    """Flag off vs on with g = 0: the same outputs and the same gradients of every shared
    parameter (GPAS only adds one gate per layer, named ``gpas.gate``), and every gate gets one."""
    plain, task, _ = build(tiny_bin, TINY, "--prenorm", seed=6)
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--gpas", seed=6)
    extra = sorted(set(dict(model.named_parameters())) - set(dict(plain.named_parameters())))
    assert extra == [f"{stack}.layers.{i}.gpas.gate" for stack in ("decoder", "encoder") for i in range(2)]
    assert set(extra) <= set(norm_parameter_names(model))  # a learnable scalar: --norm-weight-decay's group
    sample = toy_sample(task)
    outputs = []
    for m in (plain, model):
        m.eval()
        out = m(**sample["net_input"])[0]
        out.float().pow(2).mean().backward()
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    gate_grads = [layer.gpas.gate.grad for layer in (*model.encoder.layers, *model.decoder.layers)]
    assert all(g is not None and g.item() != 0 for g in gate_grads)
    shared = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if name in shared:
            assert torch.allclose(p.grad, shared[name].grad, atol=1e-7), name


@pytest.mark.parametrize("flags,got", [
    (["--postnorm"], "--norm-placement post without --residual-scale deepnorm"),
    (["--norm-placement", "resi-dual"], "--norm-placement resi-dual"),
    (["--encoder-normalize-before"], "--encoder-normalize-before (fairseq's PreNorm in one stack)"),
])
def test_gpas_elsewhere_is_refused_in_one_line(tiny_bin, flags, got):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *flags, "--gpas")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--gpas is defined on PreNorm (--prenorm), Sandwich (--norm-placement sandwich) "
                              "and DeepNorm (--postnorm --residual-scale deepnorm) only; got " + got)


@pytest.mark.parametrize("placement", list(GPAS_PLACEMENTS))
def test_gpas_incremental_decoding_equals_the_full_forward(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, *GPAS_PLACEMENTS[placement], "--gpas", "--norm-type", "seednorm")
    assert_incremental_matches_full(model, task)


def test_gpas_with_checkpoint_activations_gives_the_same_gradients(tiny_bin):
    """--checkpoint-activations re-runs the layers' forward in backward: same gradients, gates included."""
    flags = [*GPAS_PLACEMENTS["deepnorm"], "--gpas"]
    plain, task, _ = build(tiny_bin, TINY, *flags, seed=7)
    wrapped, _, _ = build(tiny_bin, TINY, *flags, "--checkpoint-activations", seed=7)
    for model in (plain, wrapped):
        with torch.no_grad():
            for layer in (*model.encoder.layers, *model.decoder.layers):
                layer.gpas.gate.fill_(0.5)
    expected, grads = one_backward(plain, task), one_backward(wrapped, task)
    assert grads.keys() == expected.keys() and grads["encoder.layers.0.gpas.gate"].abs() > 0
    assert all(torch.allclose(grads[name], expected[name], atol=1e-6) for name in grads)


# ---- 20 updates of fairseq-train, then beam search -------------------------------------------

@pytest.mark.parametrize("flags", [
    ["--prenorm", "--gpas", "--norm-type", "seednorm"],
    ["--norm-placement", "sandwich", "--gpas", "--norm-type", "seednorm", "--seednorm-heads", "2"],
    ["--postnorm", "--residual-scale", "deepnorm", "--gpas"],
], ids=["pre-gpas-seednorm", "sandwich-gpas-seednorm2", "deepnorm-gpas"])
def test_twenty_updates_finite_and_beam_search(tiny_bin, tmp_path, flags):
    # batches of 500 tokens (a quarter of test_resume's): twenty updates of fairseq-train, cheaply
    records = train_in_process(tiny_bin, str(tmp_path), *flags, "--max-epoch", "8", "--max-update", "20",
                               "--update-freq", "1", "--max-tokens", "500")
    losses = [loss for _, micro, _ in records for loss in micro]
    assert records[-1][0] == 20 and all(math.isfinite(loss) for loss in losses)
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "checkpoint_last.pt")])
    layers = (*model.encoder.layers, *model.decoder.layers)
    assert all(layer.gpas.gate.item() != 0 for layer in layers)  # trained from 0, and reloaded
    if "seednorm" in flags:
        assert all(layer.final_layer_norm.beta.abs().sum() > 0 for layer in layers)  # trained from 0
    hypotheses = beam_search(task, model.eval(), toy_sample(task))
    assert len(hypotheses) == 4 and all(torch.isfinite(h["score"]) and len(h["tokens"]) > 0 for h in hypotheses)
