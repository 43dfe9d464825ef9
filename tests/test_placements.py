"""--norm-placement (post, pre, sandwich, resi-dual, b2t, mix, hybrid), --mix-ln-ratio and
--layernorm-scaling: each placement's formula against a direct re-implementation with the
layer's own modules, the count and place of its norms, incremental decoding against the full
forward, training steps in-process and through fairseq-train, flags-off equality with stock
fairseq, and the refused combinations."""
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms, output_norm
from fairseq_normplug.models.placements import PLACEMENTS
from fairseq_normplug.models.placements.mix import post_layers
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from fairseq_normplug.modules.rms_norm import RMSNorm
from model_helpers import (assert_incremental_matches_full, assert_same_model,
                           assert_training_steps_reach_every_parameter, build, norm_type_flags, one_backward,
                           parse_args, randomized, toy_batch)
from test_cli import log_records, train

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers
PLACEMENT_NAMES = tuple(PLACEMENTS)
NEW = ("sandwich", "resi-dual", "b2t", "mix", "hybrid", "siamese", "output-norm", "hyper-connections")


def placed(tiny_bin, placement, *flags, seed=1):
    model, task, args = build(tiny_bin, TINY, "--norm-placement", placement, *flags, seed=seed)
    randomized(model, seed=2)  # norms with non-default gains and biases
    model.eval()
    return model, task, args


# ---- plain re-implementations of the papers' formulas, from the layer's own modules --------

def attn(layer, h, mask=None):
    return layer.self_attn(query=h, key=h, value=h, key_padding_mask=None, need_weights=False, attn_mask=mask)[0]


def cross(layer, h, enc):
    return layer.encoder_attn(query=h, key=enc, value=enc, static_kv=True, need_weights=False)[0]


def ffn(layer, h):
    return layer.fc2(F.relu(layer.fc1(h)))


def sublayers(layer, mask, enc):
    """[(name of fairseq's norm for it, F)] of one layer, in order."""
    subs = [("self_attn_layer_norm", lambda h: attn(layer, h, mask))]
    if enc is not None:
        subs.append(("encoder_attn_layer_norm", lambda h: cross(layer, h, enc)))
    return subs + [("final_layer_norm", lambda h: ffn(layer, h))]


def reference_layer(placement, layer, x, mask=None, enc=None):
    """One layer's output by the formula of the placement's paper (docs/placements)."""
    subs = sublayers(layer, mask, enc)
    if placement == "post":
        for norm, f in subs:
            x = getattr(layer, norm)(x + f(x))
    elif placement == "pre":
        for norm, f in subs:
            x = x + f(getattr(layer, norm)(x))
    elif placement == "sandwich":  # x + LN_out(F(LN_in(x)))
        for norm, f in subs:
            out = getattr(layer, norm.replace("layer_norm", "out_layer_norm"))
            x = x + out(f(getattr(layer, norm)(x)))
    elif placement == "b2t":  # h = LN(x + Attn(x)) ...; out = LN(x + h + FFN(h))
        x0 = x
        for norm, f in subs[:-1]:
            x = getattr(layer, norm)(x + f(x))
        x = layer.final_layer_norm(x0 + x + ffn(layer, x))
    elif placement == "hybrid":  # y = x + Attn_QKVnorm(x); z = LN(y); z + FFN(z)
        for norm, f in subs[:-1]:
            x = x + f(x)
        z = layer.final_layer_norm(x)
        x = z + ffn(layer, z)
    return x


def hybrid_attention(attn_module, query, key, mask=None):
    """softmax(N_q(q) N_k(k)^T / sqrt(d_k)) N_v(v) W_o, with plain per-head arithmetic."""
    h = attn_module.num_heads

    def heads(x, proj):
        y = F.linear(x, proj.weight, proj.bias)  # T x B x C
        return proj.norm(y.view(y.size(0), y.size(1), h, -1)).permute(1, 2, 0, 3)  # normalised per head

    q, k, v = heads(query, attn_module.q_proj), heads(key, attn_module.k_proj), heads(key, attn_module.v_proj)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores + mask
    out = torch.softmax(scores, dim=-1) @ v
    return attn_module.out_proj(out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1))


def future_mask(t):
    return torch.triu(torch.full((t, t), float("-inf")), 1)


@pytest.mark.parametrize("placement", ["post", "pre", "sandwich", "b2t", "hybrid"])
def test_layer_formula(tiny_bin, placement):
    model, _, _ = placed(tiny_bin, placement)
    x, enc = torch.randn(5, 3, 64), torch.randn(7, 3, 64)
    mask = future_mask(5)
    with torch.no_grad():
        for layer in model.encoder.layers:
            assert torch.allclose(layer(x, None), reference_layer(placement, layer, x), atol=1e-5)
        for layer in model.decoder.layers:
            ours = layer(x, enc, None, self_attn_mask=mask)[0]
            assert torch.allclose(ours, reference_layer(placement, layer, x, mask, enc), atol=1e-5)
    if placement == "hybrid":  # the QKV-normalised attention itself, against plain arithmetic
        layer = model.decoder.layers[1]
        with torch.no_grad():
            assert torch.allclose(attn(layer, x, mask), hybrid_attention(layer.self_attn, x, x, mask), atol=1e-5)
            assert torch.allclose(cross(layer, x, enc), hybrid_attention(layer.encoder_attn, x, enc), atol=1e-5)


def test_resi_dual_stack_formula(tiny_bin):
    """x_{k+1} = LN(x_k + F_k(x_k)), y_{k+1} = y_k + F_k(x_k), y_0 = x_0; output x_N + LN_f(y_N)."""
    model, task, _ = placed(tiny_bin, "resi-dual")
    src, lengths, prev = toy_batch(task)  # no padding
    enc_layers, dec_layers = model.encoder.layers, model.decoder.layers

    def reference(layers, x, mask=None, enc=None):
        y = x
        for layer in layers:
            for norm, f in sublayers(layer, mask, enc):
                branch = f(x)
                x, y = getattr(layer, norm)(x + branch), y + branch
        return x + layers[-1].resi_dual_layer_norm(y)

    with torch.no_grad():
        x0 = model.encoder.forward_embedding(src)[0].transpose(0, 1)
        encoder_out = model.encoder(src, src_lengths=lengths)
        enc = encoder_out["encoder_out"][0]
        assert torch.allclose(enc, reference(enc_layers, x0), atol=1e-5)
        features = model.decoder.extract_features(prev, encoder_out=encoder_out)[0]
        positions = model.decoder.embed_positions(prev)
        y0 = (model.decoder.embed_scale * model.decoder.embed_tokens(prev) + positions).transpose(0, 1)
        expected = reference(dec_layers, y0, future_mask(prev.size(1)), enc).transpose(0, 1)
        assert torch.allclose(features, expected, atol=1e-5)
    assert model.encoder.layer_norm is None and model.decoder.layer_norm is None


def test_mix_layers_and_final_norm(tiny_bin):
    """floor(R L) leading PostNorm layers, then PreNorm, and a final norm when PreNorm layers end the stack."""
    assert [post_layers(12, r) for r in (0, 0.25, 0.3, 0.5, 1)] == [0, 3, 3, 6, 12]
    assert [post_layers(2, r) for r in (0.25, 0.5, 0.99, 1.0)] == [0, 1, 1, 2]
    model, _, _ = placed(tiny_bin, "mix", "--mix-ln-ratio", "0.5")
    x, enc = torch.randn(5, 3, 64), torch.randn(7, 3, 64)
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            assert [layer.normalize_before for layer in stack.layers] == [False, True]
            assert stack.layer_norm is not None
        layers = model.encoder.layers
        assert torch.allclose(layers[0](x, None), reference_layer("post", layers[0], x), atol=1e-5)
        assert torch.allclose(layers[1](x, None), reference_layer("pre", layers[1], x), atol=1e-5)
        layer = model.decoder.layers[0]
        assert torch.allclose(layer(x, enc, None)[0], reference_layer("post", layer, x, enc=enc), atol=1e-5)
    # R = 0 is PreNorm exactly, R = 1 PostNorm exactly (same parameters, same outputs)
    for ratio, same in (("0", ["--prenorm"]), ("1", [])):
        mixed, task, _ = build(tiny_bin, TINY, "--norm-placement", "mix", "--mix-ln-ratio", ratio, seed=4)
        other, _, _ = build(tiny_bin, TINY, *same, seed=4)
        assert_same_model(mixed, other, task, same_stack_classes=False)  # mix: fairseq's layers, placed stacks


# ---- norms: how many, where, and every --norm-type reaches them -----------------------------

def layer_names(prefix, layers, shorts):
    return {f"{prefix}{i}.{s}" for i in range(layers) for s in shorts}


POST = layer_names("enc", 2, ["attn", "ffn"]) | layer_names("dec", 2, ["attn", "cross", "ffn"])
EXPECTED_NORMS = {
    "post": POST,
    "b2t": POST,
    "pre": POST | {"enc.final", "dec.final"},
    "mix": POST | {"enc.final", "dec.final"},  # --mix-ln-ratio 0.5: layer 0 PostNorm, layer 1 PreNorm
    "sandwich": POST | {"enc.final", "dec.final"} | layer_names("enc", 2, ["attn_out", "ffn_out"])
    | layer_names("dec", 2, ["attn_out", "cross_out", "ffn_out"]),
    "resi-dual": POST | {"enc1.resi_final", "dec1.resi_final"},
    "hybrid": layer_names("enc", 2, ["ffn", "attn_q", "attn_k", "attn_v"])
    | layer_names("dec", 2, ["ffn", "attn_q", "attn_k", "attn_v", "cross_q", "cross_k", "cross_v"])
    | {"enc.final", "dec.final"},
    "siamese": POST | {"enc.final", "dec.final", "enc1.post_final", "enc1.pre_final", "dec1.post_final", "dec1.pre_final"}
    | layer_names("enc", 2, ["attn_post", "attn_pre", "ffn_post", "ffn_pre"])
    | layer_names("dec", 2, ["attn_post", "attn_pre", "cross_post", "cross_pre", "ffn_post", "ffn_pre"]),
    "output-norm": layer_names("enc", 2, ["attn_out", "ffn_out"]) | layer_names("dec", 2, ["attn_out", "cross_out", "ffn_out"])
    | {"enc.final", "dec.final"},
    "hyper-connections": POST | {"enc.final", "dec.final"} | layer_names("enc", 2, ["hc_attn", "hc_ffn"])
    | layer_names("dec", 2, ["hc_attn", "hc_cross", "hc_ffn"]),
    # Keel's first layers are PreNorm layers (section 3.1): no LN_1 (attn, cross, ffn) there
    "keel": (POST - {"enc0.attn", "enc0.ffn", "dec0.attn", "dec0.cross", "dec0.ffn"})
    | layer_names("enc", 2, ["keel_attn_in", "keel_ffn_in"])
    | layer_names("dec", 2, ["keel_attn_in", "keel_cross_in", "keel_ffn_in"]),
    "attention-residuals": POST | {"enc.final", "dec.final"},
}


@pytest.mark.parametrize("placement", PLACEMENT_NAMES)
def test_norm_count_place_and_type(tiny_bin, placement):
    extra = ["--mix-ln-ratio", "0.5"] if placement == "mix" else []
    model, _, _ = build(tiny_bin, TINY, "--norm-placement", placement, *extra)
    norms = named_norms(model)
    assert set(norms) == EXPECTED_NORMS[placement]
    # every norm the placement uses is one of them, and --norm-type replaces all of them
    rms, _, _ = build(tiny_bin, TINY, "--norm-placement", placement, "--rmsnorm", *extra)
    rms_norms = named_norms(rms)
    assert set(rms_norms) == set(norms) and all(isinstance(m, RMSNorm) for m in rms_norms.values())
    assert not any(type(m).__name__ == "LayerNorm" for m in rms.modules())
    if placement == "resi-dual":
        assert output_norm(model) is model.decoder.layers[-1].resi_dual_layer_norm
    if placement == "hybrid":
        assert tuple(model.state_dict()["encoder.layers.0.self_attn.q_proj.norm.weight"].shape) == (32,)  # d_k
        assert model.encoder.layers[0].self_attn_layer_norm is None


# ---- incremental decoding = full forward ----------------------------------------------------

INCREMENTAL = {name: ["--norm-placement", name] for name in PLACEMENT_NAMES}
INCREMENTAL.update({
    "mix-0.5-scalenorm": ["--norm-placement", "mix", "--mix-ln-ratio", "0.5", "--scalenorm"],
    "sandwich-dyt-fixnorm": ["--norm-placement", "sandwich", "--dyt", "--fixnorm"],
    "resi-dual-rmsnorm": ["--norm-placement", "resi-dual", "--rmsnorm"],
    "hybrid-rmsnorm-smallinit": ["--norm-placement", "hybrid", "--rmsnorm", "--smallinit"],
    "b2t-rezero-derf": ["--norm-placement", "b2t", "--residual-scale", "rezero", "--norm-type", "derf"],
    "sandwich-identity-tfixup": ["--norm-placement", "sandwich", "--norm-type", "identity", "--weight-init", "tfixup"],
    "resi-dual-dyisru-xavier": ["--norm-placement", "resi-dual", "--norm-type", "dyisru", "--weight-init", "xavier"],
    "b2t-cross-self-attention": ["--norm-placement", "b2t", "--cross-self-attention"],
    "mhc-3-rmsnorm": ["--norm-placement", "hyper-connections", "--hc-streams", "3", "--hc-manifold", "--rmsnorm"],
    "pre-qknorm-layerscale-lns": ["--prenorm", "--qknorm", "--qknorm-g0", "3", "--residual-scale", "layerscale",
                                  "--layernorm-scaling"],
})


@pytest.mark.parametrize("name", list(INCREMENTAL))
def test_incremental_decoding_equals_the_full_forward(tiny_bin, name):
    model, task, _ = build(tiny_bin, TINY, *INCREMENTAL[name])
    assert_incremental_matches_full(model, task)


# ---- training -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(INCREMENTAL))
def test_training_steps_reach_every_parameter(tiny_bin, name):
    """Forward/backward + Adam steps: finite losses, a gradient for every parameter (no unused
    norm, which would break DDP), and the loss goes down on a repeated batch."""
    assert_training_steps_reach_every_parameter(*build(tiny_bin, TINY, *INCREMENTAL[name]))


@pytest.mark.slow
@pytest.mark.parametrize("placement,flags", [("resi-dual", ["--checkpoint-activations"]), ("b2t", ["--rmsnorm"])])
def test_fairseq_train_and_reload(tiny_bin, tmp_path, placement, flags):
    save_dir = tmp_path / placement
    proc = train(tiny_bin, save_dir, ["--norm-placement", placement, *flags], 5, extra=["--log-interval", "1"])
    records = log_records(proc, "train_inner")
    assert len(records) == 5 and all(math.isfinite(float(r["loss"])) for r in records)
    (model,), cfg, _ = checkpoint_utils.load_model_ensemble_and_task([str(save_dir / "checkpoint_last.pt")])
    assert cfg.model.norm_placement == placement
    assert all(layer.placement.name == placement for layer in (*model.encoder.layers, *model.decoder.layers))


# ---- --layernorm-scaling ----------------------------------------------------------------------

def test_layernorm_scaling_multiplies_each_layer_norm_by_one_over_sqrt_l(tiny_bin):
    model, task, _ = placed(tiny_bin, "pre", "--layernorm-scaling", seed=5)
    plain, _, _ = placed(tiny_bin, "pre", seed=5)
    assert list(model.state_dict()) == list(plain.state_dict())
    x = torch.randn(4, 2, 64)
    norms = named_norms(model)
    for name, norm in norms.items():
        stock = F.layer_norm(x, (64,), norm.weight, norm.bias, norm.eps)
        scale = 1.0 if name.endswith(".final") else 1 / math.sqrt(int(name.split(".")[0][3:]) + 1)
        assert torch.allclose(norm(x), stock * scale, atol=1e-6), name
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        assert not torch.allclose(model(src, lengths, prev)[0], plain(src, lengths, prev)[0])


# ---- flags off: stock fairseq -----------------------------------------------------------------

STOCK_SIZES = ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48", "--encoder-layers", "2",
               "--decoder-layers", "2", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


@pytest.mark.parametrize("stock_flags,ours_flags", [
    ([], []), ([], ["--norm-placement", "post"]), ([], ["--postnorm"]),
    (["--encoder-normalize-before", "--decoder-normalize-before"], ["--norm-placement", "pre"]),
    (["--encoder-normalize-before", "--decoder-normalize-before"], ["--prenorm"]),
    (["--encoder-normalize-before", "--decoder-normalize-before"], ["--prenorm", "--norm-placement", "pre"]),
    (["--encoder-normalize-before"], ["--encoder-normalize-before"]),  # fairseq's mixed model, kept
])
def test_post_and_pre_are_stock_fairseq(tiny_bin, stock_flags, ours_flags):
    stock, task, _ = build(tiny_bin, "transformer", *STOCK_SIZES, *stock_flags, seed=3)
    ours, _, args = build(tiny_bin, "transformer_normplug", *STOCK_SIZES, *ours_flags, seed=3)
    assert type(ours.encoder.layers[0]) is type(stock.encoder.layers[0])
    assert_same_model(ours, stock, task)
    ours.load_state_dict(stock.state_dict(), strict=True)


# ---- refused in one line ----------------------------------------------------------------------

BAD = [
    (["--norm-placement", "sandwich", "--prenorm"], "--prenorm contradicts --norm-placement sandwich"),
    (["--norm-placement", "pre", "--postnorm"], "--postnorm contradicts --norm-placement pre"),
    (["--norm-placement", "b2t", "--encoder-normalize-before"],
     "--encoder-normalize-before (fairseq's PreNorm) contradicts --norm-placement b2t"),
    (["--norm-placement", "post", "--decoder-normalize-before"], "contradicts --norm-placement post"),
    (["--mix-ln-ratio", "0.5"], "--mix-ln-ratio needs --norm-placement mix, got --norm-placement post"),
    (["--norm-placement", "mix", "--mix-ln-ratio", "1.5"], "--mix-ln-ratio must be in [0, 1]"),
    (["--norm-placement", "mix", "--mix-ln-ratio", "-0.1"], "got -0.1"),
    (["--norm-placement", "sandwich", "--residual-scale", "deepnorm"],
     "deepnorm is defined for PostNorm only (DeepNet, Wang et al. 2022); it cannot be combined with "
     "--norm-placement sandwich"),
    (["--norm-placement", "b2t", "--residual-scale", "deepnorm"], "--norm-placement b2t"),
    (["--norm-placement", "pre", "--residual-scale", "deepnorm"], "defined for PostNorm only"),
    (["--norm-placement", "resi-dual", "--residual-scale", "rezero"],
     "--residual-scale rezero cannot be combined with --norm-placement resi-dual"),
    (["--norm-placement", "resi-dual", "--norm-type", "identity", "--weight-init", "tfixup"],
     "--weight-init tfixup cannot be combined with --norm-placement resi-dual"),
    (["--norm-placement", "hybrid", "--qknorm"], "--qknorm cannot be combined with --norm-placement hybrid"),
    (["--norm-placement", "hybrid", "--quant-noise-pq", "0.1"], "--quant-noise-pq 0.1 cannot be combined"),
    (["--residual-scale", "deepnorm", "--encoder-normalize-before"],
     "deepnorm is defined for PostNorm only (DeepNet, Wang et al. 2022); it cannot be combined with "
     "--encoder-normalize-before (fairseq's PreNorm in one stack)"),
    (["--residual-scale", "admin", "--decoder-normalize-before"],
     "admin is defined for PostNorm only (Admin, Liu et al. 2020); it cannot be combined with "
     "--decoder-normalize-before"),
    *[(["--layernorm-scaling", *flags], f"--layernorm-scaling cannot be combined with {described}: LayerNorm "
       f"Scaling is defined for PreNorm layers") for flags, described in (
        ([], "--norm-placement post"), (["--norm-placement", "hybrid"], "--norm-placement hybrid"),
        (["--norm-placement", "b2t"], "--norm-placement b2t"), (["--norm-placement", "mix"], "--norm-placement mix"),
        (["--norm-placement", "sandwich"], "--norm-placement sandwich"),
        (["--norm-placement", "resi-dual"], "--norm-placement resi-dual"),
        (["--encoder-normalize-before"], "--encoder-normalize-before (fairseq's PreNorm in one stack)"))],
    (["--norm-placement", "resi-dual", "--encoder-layerdrop", "0.1"],
     "--encoder-layerdrop 0.1 cannot be combined with --norm-placement resi-dual"),
    (["--norm-placement", "resi-dual", "--decoder-layerdrop", "0.2"],
     "--decoder-layerdrop 0.2 cannot be combined with --norm-placement resi-dual"),
    *[(["--norm-placement", placement, "--no-decoder-final-norm"],
       f"--no-decoder-final-norm cannot be combined with --norm-placement {placement}: its formula ends each "
       f"stack with a final norm") for placement in ("sandwich", "mix", "hybrid", "resi-dual")],
    (["--norm-placement", "b2t", "--norm-type", "identity", "--weight-init", "tfixup"],
     "--weight-init tfixup cannot be combined with --norm-placement b2t"),
    (["--norm-placement", "hybrid", "--encoder-xformers-att-config", '{"name": "scaled_dot_product"}'],
     "--encoder-xformers-att-config cannot be combined with --norm-placement hybrid"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_combinations_are_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_unknown_placement_is_an_argparse_error(tiny_bin):
    with pytest.raises(SystemExit):
        parse_args(tiny_bin, TINY, "--norm-placement", "peri")


# ---- more compositions ------------------------------------------------------------------------

def test_mix_default_ratio_on_deeper_stacks(tiny_bin):
    model, _, args = build(tiny_bin, TINY, "--norm-placement", "mix", "--encoder-layers", "6", "--decoder-layers", "4")
    assert args.mix_ln_ratio == 0.25
    assert [layer.normalize_before for layer in model.encoder.layers] == [False] + [True] * 5
    assert [layer.normalize_before for layer in model.decoder.layers] == [False] + [True] * 3


@pytest.mark.parametrize("placement", NEW)
def test_auto_init_and_norm_stats_see_the_new_norms(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, "--norm-placement", placement, "--dyt", "--dyt-alpha-init", "auto")
    src, lengths, prev = toy_batch(task)
    model.train()
    model(src, lengths, prev)[0].sum().backward()
    assert not model.auto_scale_init.waiting
    assert set(model.auto_scale_init.chosen) == set(named_norms(model))
    assert all(math.isfinite(v) and v > 0 for v in model.auto_scale_init.chosen.values())


def test_hybrid_with_identity_norms_and_tfixup(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--norm-placement", "hybrid", "--norm-type", "identity",
                           "--weight-init", "tfixup")
    src, lengths, prev = toy_batch(task)
    assert torch.isfinite(model(src, lengths, prev)[0]).all()


def test_b2t_rescales_the_layer_weights_as_the_authors_code(tiny_bin):
    """takase/b2t_connection ``rescaling_init``: with the B2T connection every layer weight that
    is not a norm's is multiplied by N^-0.5 (N = 2 layers per stack here); nothing else moves."""
    post, _, _ = build(tiny_bin, TINY, "--norm-placement", "post")
    b2t, _, _ = build(tiny_bin, TINY, "--norm-placement", "b2t")
    stock, ours = post.state_dict(), b2t.state_dict()
    assert stock.keys() == ours.keys()
    scaled = [k for k in stock if ".layers." in k and "weight" in k and "layer_norm" not in k]
    assert len(scaled) == 2 * 6 + 2 * 10  # encoder: q,k,v,out,fc1,fc2; decoder: + cross q,k,v,out
    for key in stock:
        factor = 2 ** -0.5 if key in scaled else 1.0
        assert torch.equal(ours[key], stock[key] * factor) if factor != 1 else torch.equal(ours[key], stock[key]), key


# ---- every accepted placement x norm type; activation checkpointing -----------------------------

#: every placement, and the modifiers on the placement they are defined for
DESIGNS = {**{name: ["--norm-placement", name] for name in PLACEMENT_NAMES},
           "pre+normformer": ["--prenorm", "--normformer"], "pre+layernorm-scaling": ["--prenorm", "--layernorm-scaling"]}


@pytest.mark.parametrize("design", list(DESIGNS))
def test_every_norm_type_is_finite_decodes_incrementally_and_trains_every_parameter(tiny_bin, design):
    for norm_type in NORM_TYPES:
        model, task, _ = build(tiny_bin, TINY, *DESIGNS[design], *norm_type_flags(norm_type))
        assert_incremental_matches_full(model, task)  # also: finite
        grads = one_backward(model, task)
        missing = [name for name, grad in grads.items() if grad is None]
        assert not missing, (norm_type, missing)
        assert all(torch.isfinite(grad).all() for grad in grads.values()), norm_type


@pytest.mark.parametrize("design", list(DESIGNS))
def test_checkpoint_activations_give_the_same_gradients(tiny_bin, design):
    """fairseq's --checkpoint-activations (and --offload-activations) wrap the placement's own
    layers: the same weights, outputs and gradients as without, and the layers are really wrapped."""
    flags = DESIGNS[design]
    plain, task, _ = build(tiny_bin, TINY, *flags, seed=7)
    expected = one_backward(plain, task)
    for wrapper in ("--checkpoint-activations", "--offload-activations"):
        model, _, _ = build(tiny_bin, TINY, *flags, wrapper, seed=7)
        layers = (*model.encoder.layers, *model.decoder.layers)
        assert all(hasattr(layer, "precheckpoint_forward") for layer in layers)
        assert all(type(layer) is type(other) for layer, other in zip(layers, (*plain.encoder.layers,
                                                                               *plain.decoder.layers)))
        grads = one_backward(model, task)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, expected[name], atol=1e-6), (wrapper, name)
