"""BHyT with statistics computed once per block (``--bhyt-block-statistics``): an encoder and a
decoder layer against a transcription of the authors' block forward, c_attn against their
``update_scaler``, its schedule and checkpoint, the one-line refusals, and the tiny preset
through fairseq's parser: finite output, incremental decoding equal to the full forward within
1e-5, a gradient for every parameter, bf16 close to float32."""
import pytest
import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements.bhyt_block import (BHyTBlockLayer, MeasuringBHyT, PredictingBHyT,
                                                          attention_variance_gain, default_scaler_interval)
from fairseq_normplug.modules.bhyt import BHyT
from model_helpers import (assert_bf16_close_to_float32, assert_every_parameter_trains, one_backward,
                           assert_incremental_equals_full, build, randomized, toy_batch)

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers
BLOCK = ("--prenorm", "--norm-type", "bhyt", "--bhyt-block-statistics")


# ---- a transcription of the authors' code (MLAI-Yonsei/BHyT e170c9b, models/hf_src/llama/modeling_llama.py)

def authors_update_scaler(self_attn, seq_len, hidden_size):
    """``LlamaDecoderLayer.update_scaler``, lines 623-645 (MHA: no GQA expansion)."""
    W_in_V = self_attn.v_proj.weight.detach().to(dtype=torch.float32)
    W_out = self_attn.out_proj.weight.detach().to(dtype=torch.float32)
    W_combined = torch.matmul(W_in_V.T, W_out.T)
    w_vo = torch.norm(W_combined, p='fro') ** 2
    denom = float(seq_len * hidden_size)
    return (w_vo / denom).detach()


def authors_bhyt(norm, hidden_states, rstd):
    """``BHyT.forward``, line 209 and 215 (gain on, no fold)."""
    tanh_out = torch.tanh(norm.lam * rstd * hidden_states)
    return norm.weight * tanh_out


def authors_rstd1(x, inv_kappa, var_dtype=torch.float32):
    """``LayerWiseVarApproxParrallel.compute_rstd1``, lines 257-260."""
    var_x = (x * x).mean(dim=-1, keepdim=True, dtype=var_dtype)
    rstd1 = torch.rsqrt(var_x + 1e-6) * inv_kappa
    return rstd1.to(dtype=x.dtype), var_x


def authors_rstd2(var_x, c_scaler, lam, inv_kappa, var_dtype=torch.float32):
    """``LayerWiseVarApproxParrallel.compute_rstd2``, lines 262-285, the baseline method."""
    hidden_states_dtype = lam.dtype
    c_scaler = c_scaler.to(var_dtype)
    lam2_scaled = lam.square().to(var_dtype) * inv_kappa ** 2
    var_x_next = var_x + (c_scaler * lam2_scaled)
    rstd2 = torch.rsqrt(var_x_next + 1e-6) * inv_kappa
    return rstd2.to(dtype=hidden_states_dtype)


def authors_block(layer, hidden_states, self_attention, c_attn, inv_kappa, cross_attention=None):
    """The ``bhyt`` branch of ``LlamaDecoderLayer.forward`` (lines 1010-1095, the CPU path, eval):
    fairseq's self-attention and FFN as theirs. With ``cross_attention`` (a decoder layer, not in
    their model): the predicted norm feeds it and ``final_layer_norm`` is ``BHyT_Star``
    (lines 95-101) before the FFN, as the plugin documents."""
    residual = hidden_states
    rstd1, var_x = authors_rstd1(hidden_states, inv_kappa)
    hidden_states = authors_bhyt(layer.self_attn_layer_norm, hidden_states, rstd1)
    lam_detached = layer.self_attn_layer_norm.lam.detach()
    hidden_states = self_attention(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    rstd2 = authors_rstd2(var_x, c_attn, lam_detached, inv_kappa)
    if cross_attention is None:
        hidden_states = authors_bhyt(layer.final_layer_norm, hidden_states, rstd2)
    else:
        hidden_states = authors_bhyt(layer.encoder_attn_layer_norm, hidden_states, rstd2)
        hidden_states = residual + cross_attention(hidden_states)
        residual = hidden_states
        norm = layer.final_layer_norm  # BHyT_Star.forward, lines 96-101
        var = (hidden_states * hidden_states).mean(dim=-1, keepdim=True, dtype=torch.float32)
        alpha = norm.lam * torch.rsqrt(var + 1e-6) * inv_kappa
        hidden_states = norm.weight * torch.tanh(alpha * hidden_states)
    hidden_states = layer.fc2(torch.relu(layer.fc1(hidden_states)))  # the mlp
    return residual + hidden_states


def block_model(tiny_bin, *flags, seed=1):
    model, task, args = build(tiny_bin, TINY, *BLOCK, *flags, seed=seed)
    return randomized(model, seed=seed).eval(), task, args


# ---- against the authors ---------------------------------------------------------------------

@pytest.mark.parametrize("kappa", [10.0, 3.0])
def test_an_encoder_layer_is_the_authors_block(tiny_bin, kappa):
    model, _, _ = block_model(tiny_bin, "--bhyt-kappa", str(kappa), "--bhyt-seq-len", "5")
    layer = model.encoder.layers[1]
    x = torch.randn(7, 3, 64) * 4
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = layer(x_ours, None)

    def self_attention(h):
        return layer.self_attn(query=h, key=h, value=h, key_padding_mask=None, need_weights=False)[0]

    c_attn = authors_update_scaler(layer.self_attn, 5, 64)
    theirs = authors_block(layer, x_theirs, self_attention, c_attn, 1 / kappa)
    assert torch.allclose(layer.bhyt_c_attn, c_attn, rtol=1e-6) and c_attn > 0
    assert torch.allclose(ours, theirs, atol=1e-5)
    parameters = [layer.self_attn_layer_norm.lam, layer.final_layer_norm.lam, layer.final_layer_norm.weight,
                  layer.self_attn.v_proj.weight]
    grads_ours = torch.autograd.grad(ours.pow(2).sum(), [x_ours, *parameters])
    grads_theirs = torch.autograd.grad(theirs.pow(2).sum(), [x_theirs, *parameters])
    for mine, authors in zip(grads_ours, grads_theirs):
        assert torch.allclose(mine, authors, rtol=1e-4, atol=1e-5)


def test_a_decoder_layer_predicts_before_the_cross_attention_and_measures_before_the_ffn(tiny_bin):
    model, task, _ = block_model(tiny_bin)
    layer = model.decoder.layers[0]
    assert (type(layer.self_attn_layer_norm).__mro__[1], type(layer.encoder_attn_layer_norm).__mro__[1],
            type(layer.final_layer_norm)) == (MeasuringBHyT, PredictingBHyT, BHyT)
    src, lengths, _ = toy_batch(task)
    encoder_out = model.encoder(src, src_lengths=lengths)["encoder_out"][0]
    x = torch.randn(5, 3, 64) * 4
    mask = torch.triu(torch.full((5, 5), float("-inf")), 1)
    with torch.no_grad():
        ours = layer(x, encoder_out=encoder_out, self_attn_mask=mask)[0]

        def self_attention(h):
            return layer.self_attn(query=h, key=h, value=h, attn_mask=mask, need_weights=False)[0]

        def cross_attention(h):
            return layer.encoder_attn(query=h, key=encoder_out, value=encoder_out, static_kv=True,
                                      need_weights=False)[0]

        c_attn = authors_update_scaler(layer.self_attn, 1024, 64)  # default: --max-target-positions
        theirs = authors_block(layer, x, self_attention, c_attn, 0.1, cross_attention)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert model.encoder.layers[0].bhyt_seq_len == layer.bhyt_seq_len == 1024


def test_the_prediction_is_not_the_measurement(tiny_bin):
    """The predicting norm ignores its input's own scale: doubling the post-attention stream's
    variance by hand changes a measuring BHyT's output, not the block's prediction."""
    model, _, _ = block_model(tiny_bin)
    norm = model.encoder.layers[0].final_layer_norm
    block = model.encoder.layers[0].bhyt_block
    h = torch.randn(4, 2, 64)
    block.c_attn, block.measured = torch.tensor(0.5), torch.full((4, 2, 1), 3.0)
    block.lam, block.kappa = torch.tensor(2.0), 10.0
    predicted = norm(h)
    expected = norm.weight * torch.tanh(norm.lam * h / (10.0 * torch.sqrt(torch.tensor(3.0 + 0.5 * 0.04 + 1e-6))))
    assert torch.allclose(predicted, expected, atol=1e-6)
    block.clear()
    with pytest.raises(RuntimeError, match="before its block's measuring norm"):
        norm(h)


# ---- c_attn: value, schedule, dtype, checkpoint -----------------------------------------------

def test_c_attn_is_the_authors_and_updates_on_the_authors_schedule(tiny_bin):
    assert [default_scaler_interval(n) for n in (0, 600, 10, 100000)] == [500, 12, 1, 1000]
    model, _, args = block_model(tiny_bin, "--max-update", "600")
    layer = model.encoder.layers[0]
    assert isinstance(layer, BHyTBlockLayer) and layer.bhyt_scaler_interval == 12
    model.set_num_updates(0)
    first = layer.bhyt_c_attn.clone()
    assert torch.allclose(first, authors_update_scaler(layer.self_attn, 1024, 64), rtol=1e-6)
    with torch.no_grad():
        layer.self_attn.v_proj.weight.mul_(2)
    model.set_num_updates(11)
    assert torch.equal(layer.bhyt_c_attn, first)  # not due
    model.set_num_updates(12)
    assert torch.allclose(layer.bhyt_c_attn, 4 * first, rtol=1e-5)
    assert attention_variance_gain(layer.self_attn, 1024).requires_grad is False


def test_c_attn_stays_float32_and_is_saved_with_the_model(tiny_bin):
    """The checkpoint's c_attn is the one in use, not one recomputed from the loaded weights
    (between two recomputes the weights move on)."""
    model, task, args = block_model(tiny_bin, "--bhyt-scaler-interval", "3")
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        model(src, lengths, prev)  # computes c_attn
        for layer in (*model.encoder.layers, *model.decoder.layers):
            layer.self_attn.v_proj.weight.mul_(1.5)  # an update that is not due for a recompute
        expected = model(src, lengths, prev)[0]
    state = model.state_dict()
    assert "encoder.layers.0.bhyt_c_attn" in state and float(state["decoder.layers.1.bhyt_c_attn"]) > 0
    other, _, _ = build(tiny_bin, TINY, *BLOCK, "--bhyt-scaler-interval", "3", seed=5)
    other.load_state_dict(state)
    other.eval()
    with torch.no_grad():
        assert torch.equal(other(src, lengths, prev)[0], expected)
    assert model.to(torch.bfloat16).encoder.layers[0].bhyt_c_attn.dtype == torch.float32


# ---- the tiny preset ------------------------------------------------------------------------

def test_incremental_decoding_equals_the_full_forward(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, *BLOCK)
    assert_incremental_equals_full(model, task)


def test_every_parameter_trains_and_bf16_is_close(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, *BLOCK)
    assert_every_parameter_trains(model, task)
    model, task, _ = build(tiny_bin, TINY, *BLOCK)
    assert_bf16_close_to_float32(model, task)


def test_flag_off_leaves_the_model_unchanged(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, "--prenorm", "--norm-type", "bhyt")
    assert not any(isinstance(m, (BHyTBlockLayer, MeasuringBHyT, PredictingBHyT)) for m in plain.modules())
    assert not any("bhyt_c_attn" in name for name in plain.state_dict())


@pytest.mark.parametrize("flags,message", [
    (["--prenorm", "--norm-type", "dyt"], "--bhyt-block-statistics needs --norm-type bhyt, got --norm-type dyt"),
    (["--prenorm"], "--bhyt-block-statistics needs --norm-type bhyt, got --norm-type layernorm"),
    (["--norm-type", "bhyt"], "--bhyt-block-statistics cannot be combined with --norm-placement post: the "
                              "authors' block statistics are defined for PreNorm blocks: it has "
                              "normalizes_sublayer_input=False"),
    (["--norm-placement", "sandwich", "--norm-type", "bhyt"],
     "placements with normalizes_sublayer_input=True, normalizes_sublayer_output=False, residual_stream='raw', "
     "single_stream=True: pre"),
    (["--prenorm", "--norm-type", "bhyt", "--sigma-reparam"], "cannot be combined with --sigma-reparam"),
    (["--prenorm", "--norm-type", "bhyt", "--norm-types-per-layer", "enc.0=layernorm"],
     "cannot be combined with --norm-types-per-layer enc.0=layernorm"),
    (["--prenorm", "--norm-type", "bhyt", "--bhyt-seq-len", "0"], "--bhyt-seq-len must be >= 1, got 0"),
    (["--prenorm", "--norm-type", "bhyt", "--ddp-backend", "fully_sharded"],
     "cannot be combined with --ddp-backend fully_sharded"),
])
def test_bad_combinations_are_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *flags, "--bhyt-block-statistics")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_its_flags_need_it(tiny_bin):
    with pytest.raises(NormplugError, match="--bhyt-seq-len needs --bhyt-block-statistics"):
        build(tiny_bin, TINY, "--prenorm", "--norm-type", "bhyt", "--bhyt-seq-len", "64")


@pytest.mark.parametrize("flags", [["--normformer"], ["--layernorm-scaling"], ["--gpas"], ["--gated-attention"],
                                   ["--value-residual"], ["--denseformer"], ["--residual-scale", "layerscale"],
                                   ["--checkpoint-activations"], ["--zero-centered-gamma"]], ids=" ".join)
def test_it_composes_with_the_prenorm_modifiers(tiny_bin, flags):
    model, task, _ = build(tiny_bin, TINY, *BLOCK, *flags)
    assert all(isinstance(layer, BHyTBlockLayer) for layer in (*model.encoder.layers, *model.decoder.layers))
    assert_incremental_equals_full(model, task)
    grads = one_backward(model, task)
    missing = [name for name, grad in grads.items() if grad is None]
    assert not missing, missing


def test_fairseq_train_saves_c_attn_and_generates(tiny_bin, tmp_path):
    """fairseq-train (in this process, 10 updates, c_attn every 4: fairseq's set_num_updates
    reaches the layers) logs the norm statistics, saves c_attn, and fairseq-generate decodes."""
    import math
    from test_sigma_reparam import train_and_generate

    records, hypotheses, state = train_and_generate(tiny_bin, str(tmp_path),
                                                    [*BLOCK, "--bhyt-scaler-interval", "4"])
    assert len(records) == 2 and all(math.isfinite(float(r["loss"])) for r in records)
    assert "in_std:dec1.cross" in records[-1] and "bhyt_lam:enc0.ffn" in records[-1]
    assert len(hypotheses) == 100
    for stack in ("encoder", "decoder"):
        for index in (0, 1):
            c_attn = state[f"{stack}.layers.{index}.bhyt_c_attn"]
            assert c_attn.dtype == torch.float32 and math.isfinite(float(c_attn)) and c_attn > 0
