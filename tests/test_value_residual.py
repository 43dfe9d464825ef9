"""Issue 59's value residual (``--value-residual``, ResFormer, models/placements/value_residual.py):
built through fairseq's parser on the tiny preset, finite, incremental decoding equal to the full
forward, every parameter trained, the same gradients under --checkpoint-activations, the authors'
formula (a transcription of Zcchill/Value-Residual-Learning ``modeling_llama_resformer.py``) on the
same inputs, composition and refusals."""
import math
import os
import shutil
from argparse import Namespace

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements import PLACEMENTS
from fairseq_normplug.models.placements.value_residual import ValueResidualLayerMixin, mix_values
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from model_helpers import (assert_bf16_close_to_float32, assert_every_parameter_trains,
                           assert_incremental_equals_full, assert_training_steps_reach_every_parameter, build,
                           norm_type_flags, one_backward, randomized, toy_batch, toy_sample)
from test_placement_registry import test_the_2024_2026_designs_import_only_the_public_interface

TINY = "transformer_normplug_tiny"
THREE_LAYERS = ("--encoder-layers", "3", "--decoder-layers", "3")


def stacks(model):
    return (("enc", model.encoder), ("dec", model.decoder))


def test_every_self_attention_takes_part_and_cross_attention_does_not(tiny_bin):
    model, _, args = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS)
    assert args.value_residual and args.value_residual_lambdas == [0.5, 0.5]
    for _, stack in stacks(model):
        for index, layer in enumerate(stack.layers):
            assert isinstance(layer, ValueResidualLayerMixin)
            v_proj = layer.self_attn.v_proj
            assert mix_values in v_proj._forward_hooks.values() and layer.self_attn.skip_embed_dim_check
            assert v_proj.value_residual_first_layer == (index == 0)
            assert layer.value_residual_last_layer == (index == 2)
            if getattr(layer, "encoder_attn", None) is not None:
                assert not layer.encoder_attn.v_proj._forward_hooks
    # no parameter is added: the same names as the model without the flag
    plain, _, _ = build(tiny_bin, TINY, *THREE_LAYERS)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert not any(isinstance(layer, ValueResidualLayerMixin) for _, stack in stacks(plain) for layer in stack.layers)


def test_lambdas_zero_one_is_the_model_without_value_residual_and_the_default_is_not(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, *THREE_LAYERS, seed=5)
    own, _, _ = build(tiny_bin, TINY, "--value-residual", "--value-residual-lambdas", "0", "1", *THREE_LAYERS, seed=5)
    mixed, _, _ = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS, seed=5)
    src, lengths, prev = toy_batch(task)
    outputs = []
    for model in (plain, own, mixed):
        randomized(model).eval()
        with torch.no_grad():
            outputs.append(model(src, lengths, prev)[0])
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)  # fairseq's fast path vs its own: rounding only
    assert not torch.allclose(outputs[0], outputs[2], atol=1e-3)


def test_finite_incremental_equals_full_and_every_parameter_trains(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS)
    assert_incremental_equals_full(model, task)
    assert_every_parameter_trains(model, task)


def test_the_decoder_cache_holds_mixed_values(tiny_bin):
    """fairseq's prev_value of decoder layer n > 0 after a step is lambda_1 V_1 + lambda_2 V_n of the
    positions so far (the authors mix before the cache update, modeling_llama_resformer.py:381, :403)."""
    model, task, _ = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS)
    randomized(model, seed=2).eval()
    src, lengths, prev = toy_batch(task, batch=2, length=4)
    inputs = {}
    for index, layer in enumerate(model.decoder.layers):
        layer.self_attn.v_proj.register_forward_hook(
            lambda module, args, out, index=index: inputs.setdefault(index, []).append(args[0]))
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        state = {}
        for t in range(prev.size(1)):
            model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)
    layer = model.decoder.layers[2]
    cached = layer.self_attn._get_input_buffer(state)["prev_value"]  # (batch, heads, time, head_dim)
    first_v, own_v = model.decoder.layers[0].self_attn.v_proj, layer.self_attn.v_proj
    with torch.no_grad():
        v1 = torch.nn.functional.linear(torch.cat(inputs[0]), first_v.weight, first_v.bias)
        vn = torch.nn.functional.linear(torch.cat(inputs[2]), own_v.weight, own_v.bias)
    expected = (0.5 * v1 + 0.5 * vn).view(prev.size(1), 2 * layer.self_attn.num_heads, -1).transpose(0, 1)
    assert torch.allclose(cached.reshape(expected.shape), expected, atol=1e-6)


def test_training_beam_search_and_checkpoint_reload(tiny_bin, tmp_path):
    """Training steps lower the loss; beam search (incremental decoding, beams reordered) scores
    its hypotheses as a full forward does; a checkpoint records the flags (lambdas included) and
    reloads into a model with the same beam output."""
    model, task, args = build(tiny_bin, TINY, "--value-residual", "--value-residual-lambdas", "0.7", "0.4",
                              *THREE_LAYERS, "--checkpoint-activations")
    assert_training_steps_reach_every_parameter(model, task, args)
    model.eval()
    sample = toy_sample(task, seed=9)
    generator = task.build_generator([model], Namespace(beam=3, max_len_a=0, max_len_b=6, min_len=1))
    hypotheses = [hyps[0] for hyps in generator.generate([model], sample)]
    for i, hyp in enumerate(hypotheses):
        tokens = hyp["tokens"].unsqueeze(0)
        prev = torch.cat([tokens.new_full((1, 1), task.target_dictionary.eos()), tokens[:, :-1]], dim=1)
        with torch.no_grad():
            out = model(sample["net_input"]["src_tokens"][i:i + 1], sample["net_input"]["src_lengths"][i:i + 1], prev)
            lprobs = model.get_normalized_probs(out, log_probs=True)[0]
        expected = lprobs.gather(-1, tokens[0].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(hyp["positional_scores"], expected, atol=1e-4)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(tiny_bin):
        if name.startswith("dict"):
            shutil.copy(os.path.join(tiny_bin, name), bare / name)
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True),
                "model": model.state_dict(), "args": None, "extra_state": {},
                "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {}, "num_updates": 3}]}, path)
    (reloaded,), cfg, reloaded_task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": str(bare), "source_lang": "src", "target_lang": "tgt"})
    assert cfg.model.value_residual and list(cfg.model.value_residual_lambdas) == [0.7, 0.4]
    assert reloaded.decoder.layers[1].self_attn.v_proj.value_residual_lambdas == (0.7, 0.4)
    reloaded.eval()
    again = [hyps[0] for hyps in reloaded_task.build_generator(
        [reloaded], Namespace(beam=3, max_len_a=0, max_len_b=6, min_len=1)).generate([reloaded], sample)]
    for a, b in zip(hypotheses, again):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["positional_scores"], b["positional_scores"])


def authors_resformer_attentions(hidden_states_per_layer, attentions, causal):
    """Transcription of ``LlamaAttention.forward`` (Zcchill/Value-Residual-Learning
    ``src/modeling/modeling_llama_resformer.py`` lines 373-431) run through the layers as
    ``LlamaModel.forward`` runs them (``formal_layer_values = []``, line 876, passed to every
    layer): no RoPE (the position is fairseq's embedding), no GQA, no dropout, no cache; batch
    first. ``hidden_states_per_layer[n]`` is layer n's attention input; q/k/v/o are fairseq's
    projections (q_proj without fairseq's 1/sqrt(d_h), applied below as the authors do)."""
    formal_layer_values = []
    outputs = []
    for layer_idx, (hidden_states, attn) in enumerate(zip(hidden_states_per_layer, attentions)):
        num_heads = attn.num_heads
        head_dim = attn.head_dim
        bsz, q_len, _ = hidden_states.size()
        query_states = torch.nn.functional.linear(hidden_states, attn.q_proj.weight, attn.q_proj.bias)
        key_states = torch.nn.functional.linear(hidden_states, attn.k_proj.weight, attn.k_proj.bias)
        value_states = torch.nn.functional.linear(hidden_states, attn.v_proj.weight, attn.v_proj.bias)
        if layer_idx == 0:
            formal_layer_values.append(value_states)
        else:
            value_states = 0.5*formal_layer_values[0] + 0.5*value_states
        query_states = query_states.view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
        if causal:
            causal_mask = torch.full((q_len, q_len), float("-inf")).triu(1)
            attn_weights = attn_weights + causal_mask
        attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, -1)
        outputs.append(torch.nn.functional.linear(attn_output, attn.out_proj.weight, attn.out_proj.bias))
    return outputs


@pytest.mark.parametrize("side", ["enc", "dec"])
def test_value_residual_equals_the_authors_transcription(tiny_bin, side):
    model, task, _ = build(tiny_bin, TINY, "--value-residual", "--prenorm", *THREE_LAYERS)
    randomized(model).eval()
    stack = model.encoder if side == "enc" else model.decoder
    inputs, outputs = {}, {}

    def record(index):
        def hook(module, args, kwargs, out):
            inputs[index], outputs[index] = kwargs["query"], out[0]
        return hook

    for index, layer in enumerate(stack.layers):
        layer.self_attn.register_forward_hook(record(index), with_kwargs=True)
    src, lengths, prev = toy_batch(task, batch=2, length=5)
    with torch.no_grad():
        model(src, lengths, prev)
        theirs = authors_resformer_attentions([inputs[n].transpose(0, 1) for n in range(3)],
                                              [layer.self_attn for layer in stack.layers], causal=side == "dec")
    for n in range(3):
        assert torch.allclose(outputs[n].transpose(0, 1), theirs[n], atol=1e-5), n
    # the mix matters: layer 3 (index 2) without it differs
    with torch.no_grad():
        plain = authors_resformer_attentions([inputs[2].transpose(0, 1)], [stack.layers[2].self_attn],
                                             causal=side == "dec")
    assert not torch.allclose(plain[0], theirs[2], atol=1e-3)


def test_checkpoint_activations_give_the_same_gradients(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS, seed=7)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS, "--checkpoint-activations", seed=7)
    grads = one_backward(wrapped, task)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name
    # and the first layer's value projection gets the later layers' share (not only its own)
    own_only, _, _ = build(tiny_bin, TINY, "--value-residual", "--value-residual-lambdas", "0", "1", *THREE_LAYERS,
                           "--checkpoint-activations", seed=7)
    name = "encoder.layers.0.self_attn.v_proj.weight"
    assert not torch.allclose(one_backward(own_only, task)[name], grads[name], atol=1e-4)


@pytest.mark.parametrize("checkpoint", [[], ["--checkpoint-activations"]])
@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_the_first_layer_values_get_the_gradient_of_every_layer(tiny_bin, checkpoint, side):
    """The gradient of layer 0's v_proj weight along a random direction equals the central
    difference of the loss (float64, no dropout), also when activation checkpointing recomputes
    the layers: V_1's share through every later layer arrives. Within 1% (fairseq's softmax runs
    in float32 even in a float64 model); V_1 detached from the later layers is off by over 50%."""
    model, task, _ = build(tiny_bin, TINY, "--value-residual", "--value-residual-lambdas", "0.9", "0.1",
                           *THREE_LAYERS, *checkpoint)
    randomized(model, seed=4).double().eval()
    src, lengths, prev = toy_batch(task)
    weight = getattr(model, side).layers[0].self_attn.v_proj.weight

    def loss():
        return model(src, lengths, prev)[0].pow(2).mean()

    loss().backward()
    direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eps = 1e-4
    with torch.no_grad():
        weight.add_(eps * direction)
        up = loss().item()
        weight.sub_(2 * eps * direction)
        down = loss().item()
        weight.add_(eps * direction)
    numeric = (up - down) / (2 * eps)
    assert abs((weight.grad * direction).sum().item() - numeric) < 1e-2 * max(1.0, abs(numeric))


@pytest.mark.parametrize("placement", [name for name in PLACEMENTS])
def test_composes_with_every_placement(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, "--value-residual", "--norm-placement", placement, *THREE_LAYERS)
    assert_incremental_equals_full(model, task, torch.float64)
    model.float()
    assert_every_parameter_trains(model, task)


@pytest.mark.parametrize("flags,task", [
    (["--prenorm", "--normformer"], "translation"), (["--prenorm", "--layernorm-scaling"], "translation"),
    (["--prenorm", "--gpas"], "translation"), (["--residual-scale", "deepnorm", "--gpas"], "translation"),
    (["--prenorm", "--qknorm", "--qknorm-g0", "4"], "translation"),
    (["--prenorm", "--residual-scale", "layerscale"], "translation"),
    (["--prenorm", "--gated-attention"], "translation"), (["--ngpt"], "translation_normplug"),
    (["--prenorm", "--sigma-reparam"], "translation"), (["--prenorm", "--denseformer"], "translation"),
])
def test_composes_with_the_other_modifiers(tiny_bin, flags, task):
    model, task, _ = build(tiny_bin, TINY, "--value-residual", *flags, task=task)
    assert_incremental_equals_full(model, task, torch.float64)
    model.float()
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("norm_type", list(NORM_TYPES))
def test_composes_with_every_norm_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, "--value-residual", "--prenorm", *norm_type_flags(norm_type))
    assert_incremental_equals_full(model, task, torch.float64)
    model.float()
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags,task,message", [
    (["--value-residual", "--encoder-layerdrop", "0.1"], "translation",
     "--encoder-layerdrop 0.1 cannot be combined with --value-residual"),
    (["--value-residual", "--decoder-layerdrop", "0.2"], "translation",
     "--decoder-layerdrop 0.2 cannot be combined with --value-residual"),
    (["--value-residual", "--cross-self-attention"], "translation",
     "--cross-self-attention cannot be combined with --value-residual"),
    (["--value-residual", "--decoder-xformers-att-config", "{}"], "translation",
     "--decoder-xformers-att-config cannot be combined with --value-residual"),
    (["--value-residual-lambdas", "0.5", "0.5"], "translation", "--value-residual-lambdas needs --value-residual"),
])
def test_refusals_are_one_line(tiny_bin, flags, task, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *flags, task=task)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_lambda_that_is_not_a_finite_number_is_one_line(tiny_bin):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--value-residual", "--value-residual-lambdas", "0.5", "nan")
    assert "--value-residual-lambdas must be a finite number" in str(error.value) and "\n" not in str(error.value)


def test_the_design_file_imports_only_the_public_interface():
    test_the_2024_2026_designs_import_only_the_public_interface("models/placements/value_residual.py")


def test_bf16_model_is_finite_and_close_to_float32(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--value-residual", *THREE_LAYERS)
    assert_bf16_close_to_float32(model, task)
