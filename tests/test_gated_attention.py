"""Issue 59's gated attention (``--gated-attention``, models/placements/gated_attention.py):
built through fairseq's parser on the tiny preset, finite, incremental decoding equal to the
full forward, every parameter trained, the authors' formula (a transcription of
qiuzh20/gated_attention ``modeling_qwen3.py``) on the same inputs, composition and refusals."""
import math

import pytest
import torch
from fairseq.modules import MultiheadAttention

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements import PLACEMENTS
from fairseq_normplug.models.placements.gated_attention import gate_out_proj_input
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from model_helpers import (assert_bf16_close_to_float32, build, incremental_and_full, norm_type_flags, one_backward,
                           randomized)
from test_placement_registry import test_the_2024_2026_designs_import_only_the_public_interface

TINY = "transformer_normplug_tiny"


def attentions(model):
    """(name, MultiheadAttention) of encoder self-, decoder self- and cross-attention."""
    return [(f"{side}{i}.{name}", getattr(layer, name))
            for side, stack in (("enc", model.encoder), ("dec", model.decoder))
            for i, layer in enumerate(stack.layers) for name in ("self_attn", "encoder_attn")
            if getattr(layer, name, None) is not None]


def test_every_attention_gets_a_gate_and_the_flag_off_gets_none(tiny_bin):
    model, _, args = build(tiny_bin, TINY, "--gated-attention")
    assert args.gated_attention
    found = attentions(model)
    assert [name for name, _ in found] == ["enc0.self_attn", "enc1.self_attn", "dec0.self_attn",
                                           "dec0.encoder_attn", "dec1.self_attn", "dec1.encoder_attn"]
    for _, attn in found:
        assert tuple(attn.gate_proj.weight.shape) == (64, 64) and attn.gate_proj.bias is not None
        assert gate_out_proj_input in attn.out_proj._forward_pre_hooks.values() and attn.skip_embed_dim_check
    plain, _, _ = build(tiny_bin, TINY)
    for _, attn in attentions(plain):
        assert type(attn) is MultiheadAttention and not hasattr(attn, "gate_proj")
    # the gate adds only gate_proj's parameters; every stock name is kept
    names = {name for name, _ in model.named_parameters()}
    plain_names = {name for name, _ in plain.named_parameters()}
    assert plain_names <= names and all(".gate_proj." in name for name in names - plain_names)


def test_finite_incremental_equals_full_and_every_parameter_trains(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--gated-attention")
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5
    grads = one_backward(model, task)
    missing = [name for name, grad in grads.items() if grad is None or not grad.abs().sum() > 0]
    assert not missing
    assert all(torch.isfinite(grad).all() for grad in grads.values())


def authors_elementwise_gated_attention(hidden_states, memory, q_proj, k_proj, v_proj, o_proj, num_heads):
    """Transcription of ``Qwen3Attention.forward`` (qiuzh20/gated_attention ``modeling_qwen3.py``
    lines 302-360) with ``elementwise_attn_output_gate``: one widened ``q_proj`` (query and gate rows
    per head, lines 273-274), no GQA (num_key_value_heads = num_heads), no RoPE (the position
    is fairseq's embedding), no mask, no dropout; batch first. k and v read ``memory`` (=
    ``hidden_states`` for self-attention)."""
    bsz, q_len, _ = hidden_states.size()
    head_dim = k_proj.weight.shape[0] // num_heads
    query_states = q_proj(hidden_states)
    key_states = k_proj(memory)
    value_states = v_proj(memory)
    query_states = query_states.view(bsz, q_len, num_heads, -1)
    query_states, gate_score = torch.split(query_states, [head_dim, head_dim], dim=-1)
    gate_score = gate_score.reshape(bsz, q_len, -1, head_dim)
    query_states = query_states.reshape(bsz, q_len, -1, head_dim).transpose(1, 2)
    key_states = key_states.view(bsz, memory.size(1), -1, head_dim).transpose(1, 2)
    value_states = value_states.view(bsz, memory.size(1), -1, head_dim).transpose(1, 2)
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    attn_output = attn_output * torch.sigmoid(gate_score)
    attn_output = attn_output.reshape(bsz, q_len, -1)
    return o_proj(attn_output)


def authors_q_proj(attn):
    """The authors' widened q_proj holding our q_proj and gate_proj rows, per head [query | gate]."""
    heads, dim = attn.num_heads, attn.embed_dim
    head_dim = dim // heads
    widened = torch.nn.Linear(dim, 2 * dim)
    with torch.no_grad():
        for name in ("weight", "bias"):
            q = getattr(attn.q_proj, name).view(heads, head_dim, -1)
            g = getattr(attn.gate_proj, name).view(heads, head_dim, -1)
            getattr(widened, name).copy_(torch.cat([q, g], dim=1).reshape(getattr(widened, name).shape))
    return widened


def plain_linear(linear):
    """The authors' o_proj: x W^T + b with our out_proj's parameters, no gate."""
    return lambda x: torch.nn.functional.linear(x, linear.weight, linear.bias)


@pytest.mark.parametrize("which", ["encoder_self", "decoder_cross"])
def test_gated_attention_equals_the_authors_transcription(tiny_bin, which):
    model, _, _ = build(tiny_bin, TINY, "--gated-attention")
    randomized(model)
    model.eval()
    layer = model.encoder.layers[1] if which == "encoder_self" else model.decoder.layers[0]
    attn = layer.self_attn if which == "encoder_self" else layer.encoder_attn
    torch.manual_seed(3)
    query = torch.randn(5, 3, 64)
    memory = query if which == "encoder_self" else torch.randn(7, 3, 64)
    ours, _ = attn(query, memory, memory, static_kv=which == "decoder_cross")
    theirs = authors_elementwise_gated_attention(query.transpose(0, 1), memory.transpose(0, 1), authors_q_proj(attn),
                                                 attn.k_proj, attn.v_proj, plain_linear(attn.out_proj), attn.num_heads)
    assert torch.allclose(ours, theirs.transpose(0, 1), atol=1e-5)
    # and the gate matters: without it the output differs
    with torch.no_grad():
        attn.gate_proj.weight.zero_()
        attn.gate_proj.bias.fill_(20.0)  # sigmoid = 1: plain fairseq attention
    ungated, _ = attn(query, memory, memory, static_kv=which == "decoder_cross")
    assert not torch.allclose(ungated, ours, atol=1e-3)


def test_checkpoint_activations_give_the_same_gradients(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, "--gated-attention", seed=7)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, "--gated-attention", "--checkpoint-activations", seed=7)
    grads = one_backward(wrapped, task)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name


@pytest.mark.parametrize("placement", [name for name in PLACEMENTS])
def test_composes_with_every_placement(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, "--gated-attention", "--norm-placement", placement)
    assert all(hasattr(attn, "gate_proj") for _, attn in attentions(model))
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())


@pytest.mark.parametrize("flags", [["--prenorm", "--normformer"], ["--prenorm", "--layernorm-scaling"],
                                   ["--prenorm", "--gpas"], ["--residual-scale", "deepnorm", "--gpas"],
                                   ["--prenorm", "--qknorm", "--qknorm-g0", "4"],
                                   ["--prenorm", "--residual-scale", "layerscale"]])
def test_composes_with_the_other_modifiers(tiny_bin, flags):
    model, task, _ = build(tiny_bin, TINY, "--gated-attention", *flags)
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("norm_type", list(NORM_TYPES))
def test_composes_with_every_norm_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, "--gated-attention", "--prenorm", *norm_type_flags(norm_type))
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags,task,message", [
    (["--ngpt"], "translation_normplug", "--gated-attention cannot be combined with --ngpt"),
    (["--decoder-xformers-att-config", "{}"], "translation",
     "--decoder-xformers-att-config cannot be combined with --gated-attention"),
])
def test_refusals_are_one_line(tiny_bin, flags, task, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--gated-attention", *flags, task=task)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_design_file_imports_only_the_public_interface():
    test_the_2024_2026_designs_import_only_the_public_interface("models/placements/gated_attention.py")


def test_bf16_model_is_finite_and_close_to_float32(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--gated-attention")
    assert_bf16_close_to_float32(model, task)
