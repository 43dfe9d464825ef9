"""--normformer (NormFormer, Shleifer, Weston & Ott 2021): the layer formula against a direct
re-implementation from the layer's own modules (encoder and decoder), the count, width and
place of the new norms, the head scales acting *before* the output projection, incremental
decoding against the full forward, training steps in-process and through fairseq-train with
a reload, compositions (norm types, inits, QKNorm, residual scales, LayerNorm Scaling,
quant-noise) and the refused combinations."""
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placement_args import resolve_placement_args
from fairseq_normplug.models.placements.layers import PlacementDecoderLayer, PlacementEncoderLayer
from fairseq_normplug.models.placements.normformer import HeadScaledProjection
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from fairseq_normplug.modules.qknorm import HeadNormProjection
from model_helpers import (assert_incremental_matches_full, assert_training_steps_reach_every_parameter, build,
                           norm_type_flags, parse_args, randomized, toy_batch)
from test_cli import log_records, train

TINY = "transformer_normplug_tiny"  # d=64, FFN 128, 2 heads (d_k 32), 2+2 layers
NF = ["--prenorm", "--normformer"]


def normformer(tiny_bin, *flags, seed=1):
    model, task, args = build(tiny_bin, TINY, *NF, *flags, seed=seed)
    randomized(model, seed=2)  # norms, head scales and projections off their init values
    model.eval()
    return model, task, args


def future_mask(t):
    return torch.triu(torch.full((t, t), float("-inf")), 1)


# ---- the paper's formulas, with plain arithmetic on the layer's own modules ------------------

def head_scaled_attention(attn, query, key, mask=None):
    """Concat(gamma_1 head_1, ..., gamma_h head_h) W_O + b, head_i = softmax(q_i k_i^T) v_i
    (q scaled by the module's own scaling: 1/sqrt(d_k), or 1 with QKNorm's normalised q/k)."""
    h, (t, b, d) = attn.num_heads, query.shape

    def heads(x, proj):  # T x B x C -> B x H x T x d_k
        return proj(x).view(x.size(0), b, h, -1).permute(1, 2, 0, 3)

    q = heads(query, attn.q_proj) * attn.scaling
    k, v = heads(key, attn.k_proj), heads(key, attn.v_proj)
    scores = q @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores + mask
    per_head = torch.softmax(scores, dim=-1) @ v  # B x H x T x d_k
    gamma = attn.out_proj.head_scale.view(1, h, 1, 1)
    concat = (gamma * per_head).permute(2, 0, 1, 3).reshape(t, b, d)
    return F.linear(concat, attn.out_proj.weight, attn.out_proj.bias)


def reference_layer(layer, x, mask=None, enc=None):
    """x + LN_post(HeadScaleMHA(LN(x))); [x + CrossAttn(LN(x))]; x + W2 LN_ffn(relu(W1 LN(x)))."""
    h = layer.self_attn_layer_norm(x)
    x = x + layer.attn_ln(head_scaled_attention(layer.self_attn, h, h, mask))
    if enc is not None:
        h = layer.encoder_attn_layer_norm(x)
        x = x + layer.encoder_attn(query=h, key=enc, value=enc, static_kv=True, need_weights=False)[0]
    h = layer.final_layer_norm(x)
    return x + layer.fc2(layer.ffn_layernorm(F.relu(layer.fc1(h))))


@pytest.mark.parametrize("flags", [[], ["--qknorm", "--qknorm-g0", "3", "--rmsnorm"], ["--dyt"]],
                         ids=["layernorm", "qknorm-rmsnorm", "dyt"])
def test_layer_formula(tiny_bin, flags):
    model, _, _ = normformer(tiny_bin, *flags)
    x, enc = torch.randn(5, 3, 64), torch.randn(7, 3, 64)
    mask = future_mask(5)
    with torch.no_grad():
        for layer in model.encoder.layers:
            assert isinstance(layer, PlacementEncoderLayer)
            assert torch.allclose(layer(x, None), reference_layer(layer, x), atol=1e-5)
        for layer in model.decoder.layers:
            assert isinstance(layer, PlacementDecoderLayer)
            ours = layer(x, enc, None, self_attn_mask=mask)[0]
            assert torch.allclose(ours, reference_layer(layer, x, mask, enc), atol=1e-5)
    if "--qknorm" in flags:  # QKNorm still replaces q/k, and the head scales wrap out_proj of the same attention
        attn = model.decoder.layers[0].self_attn
        assert isinstance(attn.q_proj, HeadNormProjection) and isinstance(attn.out_proj, HeadScaledProjection)


def test_head_scale_acts_on_heads_before_the_output_projection(tiny_bin):
    """gamma_1 = 0 removes exactly head 1's contribution: the same output as zeroing that
    head's value slice (so its head output is 0) before out_proj, and not fairseq's c_attn
    (zeroing d/h channels of the projected output). Fast path off: the output does change."""
    model, _, _ = normformer(tiny_bin)
    x, enc = torch.randn(5, 3, 64), torch.randn(7, 3, 64)
    mask = future_mask(5)
    for layer, run in ((model.encoder.layers[1], lambda l: l(x, None)),
                       (model.decoder.layers[0], lambda l: l(x, enc, None, self_attn_mask=mask)[0])):
        attn = layer.self_attn
        with torch.no_grad():
            before = attn(query=x, key=x, value=x, need_weights=False)[0]
            layer_before = run(layer)
            attn.out_proj.head_scale[0] = 0.0
            scaled = attn(query=x, key=x, value=x, need_weights=False)[0]
            layer_scaled = run(layer)
            assert not torch.allclose(layer_scaled, layer_before, atol=1e-4)  # the wrapper is called
            # head 0's value slice zeroed instead (its gamma back to a non-zero value)
            attn.out_proj.head_scale[0] = 0.7
            attn.v_proj.weight[:32] = 0.0
            attn.v_proj.bias[:32] = 0.0
            assert torch.allclose(attn(query=x, key=x, value=x, need_weights=False)[0], scaled, atol=1e-6)
            assert torch.allclose(run(layer), layer_scaled, atol=1e-5)
            # fairseq's --scale-heads would zero output channels 0..31 of the projected output instead
            fairseq_style = before.clone()
            fairseq_style[..., :32] = 0.0
            assert not torch.allclose(scaled, fairseq_style, atol=1e-3)
            assert (scaled[..., :32].abs() > 1e-4).any()  # output channels of head 0's width stay on


# ---- norms: how many, where, how wide; every --norm-type reaches them -------------------------

def layer_names(prefix, layers, shorts):
    return {f"{prefix}{i}.{s}" for i in range(layers) for s in shorts}


PRE = (layer_names("enc", 2, ["attn", "ffn"]) | layer_names("dec", 2, ["attn", "cross", "ffn"])
       | {"enc.final", "dec.final"})
NORMFORMER_NORMS = PRE | layer_names("enc", 2, ["attn_inner", "ffn_inner"]) | layer_names("dec", 2, ["attn_inner", "ffn_inner"])


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_norm_count_place_width_and_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, *NF, *norm_type_flags(norm_type))
    norms = named_norms(model)
    assert set(norms) == NORMFORMER_NORMS
    layer = model.decoder.layers[1]
    assert norms["dec1.attn_inner"] is layer.attn_ln and norms["dec1.ffn_inner"] is layer.ffn_layernorm
    assert norms["enc0.ffn_inner"] is model.encoder.layers[0].ffn_layernorm
    if norm_type != "layernorm":  # every norm of the model is of the chosen type, the new ones too
        assert len({type(m) for m in norms.values()}) == 1
        assert not any(type(m).__name__ == "LayerNorm" for m in model.modules())
    sd = model.state_dict()
    for stack in ("encoder", "decoder"):
        for i in range(2):
            heads = sd[f"{stack}.layers.{i}.self_attn.out_proj.head_scale"]
            assert heads.shape == (2,) and torch.equal(heads, torch.ones(2))
            for name, width in (("attn_ln", 64), ("ffn_layernorm", 128)):  # ffn_inner: FFN width
                for key in [k for k in sd if k.startswith(f"{stack}.layers.{i}.{name}.")]:
                    if sd[key].dim() == 1:
                        assert sd[key].shape == (width,), key
    assert "decoder.layers.0.encoder_attn.out_proj.head_scale" not in sd  # self-attention only
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(src, lengths, prev)[0]).all()


@pytest.mark.parametrize("init", [["--weight-init", "fairseq"], ["--weight-init", "xavier"], ["--smallinit"],
                                  ["--weight-init", "tfixup", "--norm-type", "identity"]],
                         ids=["fairseq", "xavier", "smallinit", "tfixup"])
def test_shared_parameters_are_prenorm_ones_and_new_ones_start_neutral(tiny_bin, init):
    """Same seed: every PreNorm parameter (names, order, values) is as without --normformer,
    the init included (it reaches out_proj through the wrapper); the new ones are the norms at
    1/0 and the head scales at 1."""
    ours, _, _ = build(tiny_bin, TINY, *NF, *init, seed=7)
    pre, _, _ = build(tiny_bin, TINY, "--prenorm", *init, seed=7)
    ours_sd, pre_sd = ours.state_dict(), pre.state_dict()
    new = [k for k in ours_sd if k not in pre_sd]
    assert [k for k in ours_sd if k in pre_sd] == list(pre_sd)
    for key in pre_sd:
        assert torch.equal(ours_sd[key], pre_sd[key]), key
    expected = {k.split(".", 3)[-1].rsplit(".", 1)[0] for k in new}
    assert expected <= {"attn_ln", "ffn_layernorm", "self_attn.out_proj"}
    assert len([k for k in new if k.endswith("head_scale")]) == 4
    for key in new:
        value = ours_sd[key]
        fill = 0.0 if key.endswith(".bias") else 1.0
        assert torch.equal(value, torch.full_like(value, fill)), key
    # fairseq's order: attn_ln right after self_attn, ffn_layernorm right before fc1
    dec = [k[len("decoder.layers.0."):] for k in ours_sd if k.startswith("decoder.layers.0.")]
    modules = list(dict.fromkeys(k.split(".")[0] for k in dec))
    if "attn_ln" in modules:
        assert modules.index("attn_ln") == modules.index("self_attn") + 1
        assert modules.index("ffn_layernorm") == modules.index("fc1") - 1


def test_layernorm_scaling_reaches_the_new_norms(tiny_bin):
    model, _, _ = normformer(tiny_bin, "--layernorm-scaling")
    x = torch.randn(4, 2, 128)
    norm = named_norms(model)["enc1.ffn_inner"]
    stock = F.layer_norm(x, (128,), norm.weight, norm.bias, norm.eps)
    assert torch.allclose(norm(x), stock / math.sqrt(2), atol=1e-6)


# ---- incremental decoding = full forward; training --------------------------------------------

COMBINATIONS = {
    "plain": [],
    "rmsnorm-qknorm-layerscale-lns": ["--rmsnorm", "--qknorm", "--qknorm-g0", "3", "--residual-scale", "layerscale",
                                      "--layernorm-scaling"],
    "dyt-fixnorm-rezero": ["--dyt", "--fixnorm", "--residual-scale", "rezero"],
    "scalenorm-smallinit": ["--scalenorm", "--smallinit"],
    "derf-xavier-cross-self-attention": ["--norm-type", "derf", "--weight-init", "xavier", "--cross-self-attention"],
    "identity-tfixup": ["--norm-type", "identity", "--weight-init", "tfixup"],
    "dyisru": ["--norm-type", "dyisru"],
    "quant-noise": ["--quant-noise-pq", "0.1", "--quant-noise-pq-block-size", "8"],
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_incremental_decoding_equals_the_full_forward(tiny_bin, name):
    model, task, _ = build(tiny_bin, TINY, *NF, *COMBINATIONS[name])
    assert_incremental_matches_full(model, task)


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_training_steps_reach_every_parameter(tiny_bin, name):
    """Forward/backward + Adam steps: finite losses, a gradient for every parameter (head
    scales and the new norms included), and the loss goes down on a repeated batch."""
    model, task, args = build(tiny_bin, TINY, *NF, *COMBINATIONS[name])

    def head_scales_learn(model):
        head_grads = [p.grad for n, p in model.named_parameters() if n.endswith("head_scale")]
        assert len(head_grads) == 4
        if "rezero" not in COMBINATIONS[name]:  # ReZero's alpha = 0 at init zeroes every branch's gradient
            assert all(g.abs().sum() > 0 for g in head_grads)

    assert_training_steps_reach_every_parameter(model, task, args, head_scales_learn)
    if "--quant-noise-pq" in COMBINATIONS[name]:  # quant-noise's hook moved to the wrapped out_proj
        out_proj = model.encoder.layers[0].self_attn.out_proj
        assert len(out_proj._forward_pre_hooks) == len(model.encoder.layers[0].self_attn.v_proj._forward_pre_hooks) == 1


def test_auto_init_and_norm_stats_see_the_new_norms(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, *NF, "--dyt", "--dyt-alpha-init", "auto")
    src, lengths, prev = toy_batch(task)
    model.train()
    model(src, lengths, prev)[0].sum().backward()
    assert not model.auto_scale_init.waiting
    assert set(model.auto_scale_init.chosen) == NORMFORMER_NORMS
    assert all(math.isfinite(v) and v > 0 for v in model.auto_scale_init.chosen.values())


@pytest.mark.slow
def test_fairseq_train_and_reload(tiny_bin, tmp_path):
    save_dir = tmp_path / "normformer"
    proc = train(tiny_bin, save_dir, [*NF, "--rmsnorm"], 5, extra=["--log-interval", "1"])
    records = log_records(proc, "train_inner")
    assert len(records) == 5 and all(math.isfinite(float(r["loss"])) for r in records)
    path = str(save_dir / "checkpoint_last.pt")
    (model,), cfg, _ = checkpoint_utils.load_model_ensemble_and_task([path])
    assert cfg.model.normformer is True and cfg.model.norm_placement == "pre"
    assert isinstance(model.encoder.layers[0], PlacementEncoderLayer)
    assert isinstance(model.decoder.layers[0], PlacementDecoderLayer)
    saved = checkpoint_utils.load_checkpoint_to_cpu(path)["model"]
    heads = saved["decoder.layers.1.self_attn.out_proj.head_scale"]
    assert not torch.equal(heads, torch.ones(2))  # the head scales were trained ...
    assert torch.equal(model.decoder.layers[1].self_attn.out_proj.head_scale.detach(), heads)  # ... and reloaded
    assert saved["encoder.layers.0.ffn_layernorm.weight"].shape == (128,)


# ---- refused in one line ----------------------------------------------------------------------

BAD = [
    (["--normformer"], "--normformer needs the PreNorm placement (--prenorm / --norm-placement pre), "
                       "got --norm-placement post"),
    (["--normformer", "--norm-placement", "sandwich"], "got --norm-placement sandwich"),
    (["--normformer", "--norm-placement", "hybrid"], "got --norm-placement hybrid"),
    (["--normformer", "--postnorm"], "got --norm-placement post"),
    (["--normformer", "--encoder-normalize-before"], "got only --encoder-normalize-before"),
    ([*NF, "--no-decoder-final-norm"], "--no-decoder-final-norm cannot be combined with --normformer"),
    ([*NF, "--encoder-xformers-att-config", '{"name": "scaled_dot_product"}'],
     "--encoder-xformers-att-config cannot be combined with --normformer"),
    ([*NF, "--residual-scale", "deepnorm"], "defined for PostNorm only"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_combinations_are_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["scale_attn", "scale_fc", "scale_heads", "scale_resids"])
def test_fairseq_lm_normformer_switches_are_refused(tiny_bin, name):
    """``transformer`` has no --scale-* flags (an argparse error), but a namespace can carry
    them (fairseq's layer reads them off the config): with --normformer they are refused."""
    with pytest.raises(SystemExit):
        parse_args(tiny_bin, TINY, *NF, "--" + name.replace("_", "-"))
    args = parse_args(tiny_bin, TINY, *NF)
    setattr(args, name, True)
    with pytest.raises(NormplugError) as error:
        resolve_placement_args(args)
    assert f"--normformer cannot be combined with fairseq's --{name.replace('_', '-')}" in str(error.value)
    assert "\n" not in str(error.value)
