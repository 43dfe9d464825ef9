"""--norm-placement hyper-connections [--hc-streams N] [--hc-manifold]: both stacks against a
direct implementation of the papers' equations (n = 2, HC and mHC), n = 1 at init is PreNorm
exactly, the init of the reference, mHC's residual mixing is doubly stochastic (also in bf16),
which parameters count as gains for --norm-weight-decay, the refusals, and 20 updates of
fairseq-train then fairseq-generate. The generic placement tests (every norm type, incremental
decoding, activation checkpointing) are in tests/test_placements.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_parameters import norm_parameter_names
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placements.hyper_connections import HyperConnection
from model_helpers import build, parse_args, randomized, toy_batch
from test_cli import USER_DIR, log_records, train
from test_placements import TINY, future_mask, sublayers
from test_precision import AGREEMENT, HALF, padded_batch, smoothed_loss

HC = ["--norm-placement", "hyper-connections"]


def plain_sinkhorn(logits, iterations=20):
    """mHC eq. 9: M(0) = exp(H), M(t) = T_r(T_c(M(t-1)))."""
    m = logits.exp()
    for _ in range(iterations):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def reference_stack(layers, x, manifold, n, mask=None, enc=None):
    """The stack's streams by the papers' equations (HC section 2.2 / Algorithm 2; mHC eqs. 7-9),
    stream by stream: expand to n copies, per sublayer the width connection, the PreNorm branch,
    the depth connection; the sum of the streams at the end."""
    streams = [x] * n
    for layer in layers:
        kinds = ["attn", "cross", "ffn"] if enc is not None else ["attn", "ffn"]
        for kind, (norm, f) in zip(kinds, sublayers(layer, mask, enc)):
            hc = layer.hyper_connections[kind]
            bar = [hc.norm(h) for h in streams]
            if manifold:
                pre = [torch.sigmoid(hc.static_alpha[s, 0] + hc.pre_scale * (bar[s] @ hc.dynamic_alpha[:, 0]))
                       for s in range(n)]
                logits = torch.stack([torch.stack([
                    hc.static_alpha[s, 1 + t] + hc.res_scale * (bar[s] @ hc.dynamic_alpha[:, 1 + t])
                    for t in range(n)], -1) for s in range(n)], -2)
                res = plain_sinkhorn(logits)
                res = [[res[..., s, t] for t in range(n)] for s in range(n)]
                beta = [2 * torch.sigmoid(hc.static_beta[s] + hc.beta_scale * (bar[s] @ hc.dynamic_beta))
                        for s in range(n)]
            else:
                pre = [hc.static_alpha[s, 0] + hc.alpha_scale * torch.tanh(bar[s] @ hc.dynamic_alpha[:, 0])
                       for s in range(n)]
                res = [[hc.static_alpha[s, 1 + t] + hc.alpha_scale * torch.tanh(bar[s] @ hc.dynamic_alpha[:, 1 + t])
                        for t in range(n)] for s in range(n)]
                beta = [hc.static_beta[s] + hc.beta_scale * torch.tanh(bar[s] @ hc.dynamic_beta) for s in range(n)]
            branch_input = sum(pre[s].unsqueeze(-1) * streams[s] for s in range(n))
            y = f(getattr(layer, norm)(branch_input))
            streams = [sum(res[s][t].unsqueeze(-1) * streams[s] for s in range(n)) + beta[t].unsqueeze(-1) * y
                       for t in range(n)]
    return sum(streams)


@pytest.mark.parametrize("manifold", [False, True], ids=["hc", "mhc"])
def test_both_stacks_follow_the_papers_equations(tiny_bin, manifold):
    flags = [*HC, "--hc-streams", "2"] + (["--hc-manifold"] if manifold else [])
    model, task, _ = build(tiny_bin, TINY, *flags)
    randomized(model, seed=2)
    model.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        x0 = model.encoder.forward_embedding(src)[0].transpose(0, 1)
        encoder_out = model.encoder(src, src_lengths=lengths)
        enc = encoder_out["encoder_out"][0]
        expected = model.encoder.layer_norm(reference_stack(model.encoder.layers, x0, manifold, 2))
        assert torch.allclose(enc, expected, atol=1e-5)
        features = model.decoder.extract_features(prev, encoder_out=encoder_out)[0]
        y0 = (model.decoder.embed_scale * model.decoder.embed_tokens(prev) + model.decoder.embed_positions(prev))
        streams = reference_stack(model.decoder.layers, y0.transpose(0, 1), manifold, 2, future_mask(prev.size(1)), enc)
        assert torch.allclose(features, model.decoder.layer_norm(streams).transpose(0, 1), atol=1e-5)


def test_one_stream_at_init_is_prenorm_and_the_init_is_the_references(tiny_bin):
    """n = 1: A_m = A_r = B = 1 and the dynamic parts 0, so the model is PreNorm exactly (same
    fairseq parameters for a seed, same output); n = 4: A_m = e_{k mod 4}, k counting sublayers."""
    hc, task, _ = build(tiny_bin, TINY, *HC, "--hc-streams", "1", "--dropout", "0", seed=4)
    pre, _, _ = build(tiny_bin, TINY, "--prenorm", "--dropout", "0", seed=4)
    ours = hc.state_dict()
    assert all(torch.equal(ours[key], value) for key, value in pre.state_dict().items())
    src, lengths, prev = toy_batch(task)
    for model in (hc, pre):
        model.eval()
    with torch.no_grad():
        assert torch.equal(hc(src, lengths, prev)[0], pre(src, lengths, prev)[0])
    model, _, args = build(tiny_bin, TINY, *HC)
    assert args.hc_streams == 4 and args.hc_manifold is False
    layer = model.decoder.layers[1]  # sublayers k = 3 (attn), 4 (cross), 5 (ffn)
    for kind, stream in (("attn", 3), ("cross", 0), ("ffn", 1)):
        connection = layer.hyper_connections[kind]
        assert torch.equal(connection.static_alpha[:, 0], F.one_hot(torch.tensor(stream), 4).float())
        assert torch.equal(connection.static_alpha[:, 1:], torch.eye(4))
        assert torch.equal(connection.static_beta, torch.ones(4))
        assert not connection.dynamic_alpha.any() and not connection.dynamic_beta.any()
        assert connection.alpha_scale.item() == connection.beta_scale.item() == pytest.approx(0.01)
    assert list(model.encoder.layers[0].hyper_connections) == ["attn", "ffn"]


def test_mhc_residual_mixing_is_doubly_stochastic_in_float32_and_bf16():
    torch.manual_seed(0)
    connection = randomized(HyperConnection(16, 4, index=1, manifold=True), seed=3)
    with torch.no_grad():
        connection.dynamic_alpha.mul_(20)  # far from the identity-like init
    streams = torch.randn(5, 3, 4, 16)
    for dtype in (torch.float32, torch.bfloat16):
        connection.to(dtype)
        assert connection.pre_scale.dtype == connection.res_scale.dtype == torch.float32
        alpha, beta = connection.coefficients(streams.to(dtype))
        assert alpha.dtype == beta.dtype == torch.float32
        residual = alpha[..., 1:]
        assert (residual >= 0).all() and residual.std() > 0.05
        for dim in (-1, -2):
            assert torch.allclose(residual.sum(dim), torch.ones(()), atol=1e-5), (dtype, dim)
        assert ((alpha[..., 0] > 0) & (alpha[..., 0] < 1)).all() and ((beta > 0) & (beta < 2)).all()
        branch_input, residuals, beta = connection(streams.to(dtype))
        assert branch_input.dtype == residuals.dtype == beta.dtype == dtype
        assert branch_input.shape == (5, 3, 16) and residuals.shape == (5, 3, 4, 16)


@pytest.mark.parametrize("dtype_name", list(HALF))
@pytest.mark.parametrize("manifold", [False, True], ids=["hc", "mhc"])
def test_half_precision_is_finite_close_to_float32_with_float32_scales(tiny_bin, manifold, dtype_name):
    model, task, _ = build(tiny_bin, TINY, *HC, "--hc-streams", "2", *(["--hc-manifold"] if manifold else []))
    batch = padded_batch(task)
    with torch.no_grad():
        _, reference, _ = smoothed_loss(model.eval(), batch)
    half = model.to(HALF[dtype_name])
    logits, lprobs, loss = smoothed_loss(half, batch)
    loss.backward()
    assert logits.dtype == HALF[dtype_name] and torch.isfinite(loss)
    assert (lprobs.float() - reference).abs().max() < AGREEMENT[HALF[dtype_name]]
    for name, p in half.named_parameters():
        assert torch.isfinite(p.grad).all(), name
        assert p.dtype == (torch.float32 if name.endswith("_scale") else HALF[dtype_name]), name


def test_mixing_coefficients_are_gains_for_norm_weight_decay(tiny_bin):
    """Static A, B and the scales s are gains (--norm-weight-decay), like ReZero's; the dynamic
    projections W are weight matrices (--weight-decay); the dynamic norms are norms."""
    model, _, _ = build(tiny_bin, TINY, *HC, "--hc-manifold")
    names = set(norm_parameter_names(model))
    prefix = "decoder.layers.1.hyper_connections.cross."
    gains = ["static_alpha", "pre_scale", "res_scale", "static_beta", "beta_scale", "norm.weight", "norm.bias"]
    assert {prefix + name for name in gains} <= names
    assert not {prefix + "dynamic_alpha", prefix + "dynamic_beta"} & names
    assert {"enc0.hc_attn", "enc1.hc_ffn", "dec1.hc_cross", "dec.final"} <= set(named_norms(model))


BAD = [
    ([*HC, "--hc-streams", "0"], "--hc-streams must be >= 1 (the number of residual streams; the papers use 4), got 0"),
    (["--hc-manifold"], "--hc-manifold needs --norm-placement hyper-connections, got --norm-placement post"),
    (["--prenorm", "--hc-streams", "2"],
     "--hc-streams needs --norm-placement hyper-connections, got --norm-placement pre"),
    ([*HC, "--residual-scale", "layerscale"],
     "--residual-scale layerscale cannot be combined with --norm-placement hyper-connections"),
    ([*HC, "--norm-type", "identity", "--weight-init", "tfixup"],
     "--weight-init tfixup cannot be combined with --norm-placement hyper-connections"),
    ([*HC, "--decoder-layerdrop", "0.1"], "--decoder-layerdrop 0.1 cannot be combined with --norm-placement hyper"),
    ([*HC, "--no-decoder-final-norm"], "--no-decoder-final-norm cannot be combined with --norm-placement hyper"),
    ([*HC, "--normformer"], "--normformer needs the PreNorm placement"),
    ([*HC, "--layernorm-scaling"], "--layernorm-scaling cannot be combined with --norm-placement hyper-connections"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow  # trains for more than about 10 s
def test_trains_20_updates_logs_its_norms_and_decodes(tiny_bin, tmp_path):
    flags = [*HC, "--hc-streams", "2", "--hc-manifold", "--norm-stats-interval", "10"]
    proc = train(tiny_bin, tmp_path, flags, 20)
    records = log_records(proc, "train_inner")
    assert len(records) == 2 and all(math.isfinite(float(r["loss"])) for r in records)
    assert "in_std:dec1.hc_cross" in records[-1] and "gain:enc0.hc_ffn" in records[-1]
    checkpoint = str(tmp_path / "checkpoint_last.pt")
    gen = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                       "--beam", "2", "--cpu", "--max-tokens", "4000", "--gen-subset", "valid",
                       "--required-batch-size-multiple", "1", "--max-len-a", "0", "--max-len-b", "6"])
    assert len([line for line in gen.stdout.splitlines() if line.startswith("H-")]) == 100
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert state["cfg"]["model"].hc_streams == 2 and state["cfg"]["model"].hc_manifold is True
    assert not torch.equal(state["model"]["encoder.layers.0.hyper_connections.attn.static_alpha"][:, 1:], torch.eye(2))
