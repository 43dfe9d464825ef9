"""Issue 58's σReparam (``--sigma-reparam``, models/placements/sigma_reparam.py): built through
fairseq's parser on the tiny preset, W_hat = W at init, finite, incremental decoding equal to the
full forward, every parameter trained, the authors' ``SNLinear`` (a transcription of
apple/ml-sigma-reparam ``vision/layers.py``) on the same inputs and weights, the power iteration
once per training forward, composition and refusals."""
import math
import os

import pytest
import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements import PLACEMENTS
from fairseq_normplug.models.placements.sigma_reparam import (SpectralScale, install_sigma_reparam,
                                                             update_spectral_estimates)
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from model_helpers import (assert_bf16_close_to_float32, assert_training_steps_reach_every_parameter, build,
                           incremental_and_full, norm_type_flags, one_backward, randomized, toy_batch)
from test_placement_registry import test_the_2024_2026_designs_import_only_the_public_interface

TINY = "transformer_normplug_tiny"


def train_and_generate(data_bin, save_dir, flags, updates=10):
    """fairseq-train (in this process) for ``updates`` updates of 600 tokens (half TRAIN_COMMON's
    batches: the callers check that it trains, logs, saves and decodes, not how well) with
    ``flags`` and the norm statistics every 5, then fairseq-generate (in this process) on the
    valid set from its last checkpoint: (the train_inner log records, the hypotheses, the
    checkpoint's model state)."""
    from inprocess import run_fairseq
    from test_cli import HALF_BATCHES, NO_LOADER_WORKERS, TRAIN_COMMON, USER_DIR, log_records

    train = run_fairseq(["fairseq-train", data_bin, "--arch", TINY, *TRAIN_COMMON, "--save-dir", save_dir,
                         "--max-update", updates, *HALF_BATCHES, "--log-interval", "5",
                         "--norm-stats-interval", "5", *flags])
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    generate = run_fairseq(["fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                            "--beam", "2", "--cpu", "--max-tokens", "4000", "--gen-subset", "valid",
                            "--required-batch-size-multiple", "1", "--max-len-a", "0", "--max-len-b", "6",
                            *NO_LOADER_WORKERS])
    hypotheses = [line for line in generate.stdout.splitlines() if line.startswith("H-")]
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return log_records(train, "train_inner"), hypotheses, state


def reparameterized(model):
    """{name: linear} of the linears that carry a SpectralScale."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and isinstance(getattr(module, "sigma_reparam", None), SpectralScale)}


# ---- the authors' code, transcribed (apple/ml-sigma-reparam fea4e35, vision/layers.py) ------------

class AuthorsSpectralNormedWeight(nn.Module):
    """``SpectralNormedWeight`` (vision/layers.py:19-51), verbatim but for the weight it is given."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        with torch.no_grad():
            _, s, vh = torch.linalg.svd(self.weight, full_matrices=False)
        self.register_buffer("u", vh[0])
        self.register_buffer("spectral_norm", s[0] * torch.ones(1))

    def get_sigma(self, u, weight):
        with torch.no_grad():
            v = weight.mv(u)
            v = nn.functional.normalize(v, dim=0)
            u = weight.T.mv(v)
            u = nn.functional.normalize(u, dim=0)
            if self.training:
                self.u.data.copy_(u)
        return torch.einsum("c,cd,d->", v, weight, u)

    def forward(self):
        sigma = self.get_sigma(u=self.u, weight=self.weight)
        if self.training:
            self.spectral_norm.data.copy_(sigma)
        return self.weight / sigma


class AuthorsSNLinear(nn.Linear):
    """``SNLinear`` (vision/layers.py:90-149) with ``stats_only=False``; the weight is a copy of
    ``like``'s instead of the authors' trunc_normal(0.02) draw (line 112)."""

    def __init__(self, like: nn.Linear):
        super().__init__(like.in_features, like.out_features, bias=like.bias is not None)
        with torch.no_grad():
            self.weight.copy_(like.weight)
            self.bias.copy_(like.bias)
        self.spectral_normed_weight = AuthorsSpectralNormedWeight(self.weight)
        sn_init = self.spectral_normed_weight.spectral_norm
        self.sigma = nn.Parameter(torch.zeros_like(sn_init).copy_(sn_init), requires_grad=True)

    def forward(self, inputs):
        weight = self.spectral_normed_weight() * self.sigma
        return nn.functional.linear(inputs, weight, self.bias)


def test_sigma_reparam_equals_the_authors_snlinear_through_training_steps_and_eval():
    torch.manual_seed(0)
    ours = nn.Linear(24, 40)
    theirs = AuthorsSNLinear(ours)
    install_sigma_reparam(ours)
    assert torch.allclose(ours.sigma_reparam.gamma, theirs.sigma.squeeze(), atol=1e-6)
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.01) for module in (ours, theirs)]
    for step in range(4):
        x = torch.randn(5, 3, 24)
        ours.train(), theirs.train()
        update_spectral_estimates(ours, (x,))  # what the stack's pre-hook does once per forward
        outputs = [module(x) for module in (ours, theirs)]
        assert torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5), step
        assert torch.allclose(ours.sigma_reparam.u, theirs.spectral_normed_weight.u, atol=1e-6)
        for module, output, optimizer in zip((ours, theirs), outputs, optimizers):
            optimizer.zero_grad()
            output.pow(2).sum().backward()
        assert torch.allclose(ours.weight.grad, theirs.weight.grad, atol=1e-4, rtol=1e-4)
        assert torch.allclose(ours.bias.grad, theirs.bias.grad, atol=1e-4, rtol=1e-4)
        assert torch.allclose(ours.sigma_reparam.gamma.grad, theirs.sigma.grad.squeeze(), atol=1e-4, rtol=1e-4)
        for optimizer in optimizers:
            optimizer.step()
        ours.eval(), theirs.eval()
        with torch.no_grad():
            u_before = ours.sigma_reparam.u.clone()
            assert torch.allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5), step
            assert torch.equal(ours.sigma_reparam.u, u_before)  # eval stores nothing
    # and the reparameterisation matters: the plain linear with the same weight differs
    with torch.no_grad():
        plain = nn.functional.linear(x, ours.weight, ours.bias)
        assert not torch.allclose(plain, ours(x), atol=1e-3)


def test_every_linear_is_reparameterised_and_the_model_starts_as_the_plain_one(tiny_bin):
    model, task, args = build(tiny_bin, TINY, "--sigma-reparam")
    assert args.sigma_reparam
    found = reparameterized(model)
    per_attention = ["q_proj", "k_proj", "v_proj", "out_proj"]
    expected = [f"encoder.layers.{i}.{name}" for i in range(2)
                for name in [f"self_attn.{p}" for p in per_attention] + ["fc1", "fc2"]]
    expected += [f"decoder.layers.{i}.{name}" for i in range(2)
                 for name in [f"self_attn.{p}" for p in per_attention] + [f"encoder_attn.{p}" for p in per_attention]
                 + ["fc1", "fc2"]]
    assert sorted(found) == sorted(expected)  # the tied output projection is the embedding: plain
    for linear in found.values():
        scale = linear.sigma_reparam
        assert torch.allclose(scale.gamma, torch.linalg.matrix_norm(linear.weight.detach(), ord=2), rtol=1e-5)
    plain, _, _ = build(tiny_bin, TINY)
    assert not reparameterized(plain)
    names = {name for name, _ in model.named_parameters()}
    plain_names = {name for name, _ in plain.named_parameters()}
    assert plain_names <= names and all(name.endswith(".sigma_reparam.gamma") for name in names - plain_names)
    src, lengths, prev = toy_batch(task)
    for mode in ("train", "eval"):  # W_hat = W at init; the same dropout masks in training mode
        outputs = []
        for built in (model, plain):
            getattr(built, mode)()
            torch.manual_seed(5)
            with torch.no_grad():
                outputs.append(built(src, lengths, prev)[0])
        assert torch.allclose(*outputs, atol=1e-5), mode


def test_an_untied_output_projection_is_reparameterised(tiny_bin):
    small = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
             "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
             "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    model, task, args = build(tiny_bin, "transformer_normplug", "--sigma-reparam", *small)
    assert not args.share_decoder_input_output_embed
    projection = model.decoder.output_projection
    assert reparameterized(model)["decoder.output_projection"] is projection
    assert projection.weight is not model.decoder.embed_tokens.weight
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())


def test_decoding_computes_each_reparameterised_weight_once_until_the_weights_change(tiny_bin, monkeypatch):
    """Eval without gradients (every decoding step calls every linear): sigma is computed once per
    linear and W_hat kept; an in-place change of W (an optimizer step, load_state_dict) or gamma is
    seen at once, and the outputs equal those computed afresh."""
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam")
    randomized(model, seed=2).eval()
    src, lengths, prev = toy_batch(task)
    calls = []
    original = SpectralScale.forward
    monkeypatch.setattr(SpectralScale, "forward", lambda self, weight: calls.append(self) or original(self, weight))
    with torch.no_grad():
        first = model(src, lengths, prev)[0]
        assert len(calls) == len(reparameterized(model))
        steps, full = incremental_and_full(model, task)  # eval, no gradients: all cached
        assert len(calls) == len(reparameterized(model)) and (steps - full).abs().max() < 1e-5
        fc1 = model.decoder.layers[1].fc1
        fc1.weight.mul_(1.5)
        fc1.sigma_reparam.gamma.mul_(0.5)
        changed = model(src, lengths, prev)[0]
    assert len(calls) == len(reparameterized(model)) + 1
    with torch.enable_grad():  # computed afresh, no cache
        fresh = model(src, lengths, prev)[0]
    assert torch.allclose(changed, fresh, atol=1e-6) and not torch.allclose(changed, first, atol=1e-4)


def test_power_iteration_runs_once_per_training_forward_and_never_in_eval(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam")
    randomized(model, seed=2)
    linear = model.decoder.layers[1].fc1
    src, lengths, prev = toy_batch(task)
    calls = []
    original = SpectralScale.power_iteration

    def counting(self, weight):
        calls.append(self)
        return original(self, weight)

    SpectralScale.power_iteration = counting
    try:
        model.train()
        model(src, lengths, prev)
        assert len(calls) == len(reparameterized(model)) and len(set(map(id, calls))) == len(calls)
        model.eval()
        u = linear.sigma_reparam.u.clone()
        with torch.no_grad():
            model(src, lengths, prev)
        assert len(calls) == len(reparameterized(model)) and torch.equal(linear.sigma_reparam.u, u)
    finally:
        SpectralScale.power_iteration = original
    # repeated training forwards converge to the spectral norm of the (randomised) weight
    true_sigma = torch.linalg.matrix_norm(linear.weight.detach(), ord=2).item()
    model.train()
    error_before = abs(linear.sigma_reparam.sigma(linear.weight).item() - true_sigma)
    with torch.no_grad():
        for _ in range(100):
            model(src, lengths, prev)
    error_after = abs(linear.sigma_reparam.sigma(linear.weight).item() - true_sigma)
    assert error_after < min(error_before, 1e-3 * true_sigma)


def test_finite_incremental_equals_full_and_every_parameter_trains(tiny_bin):
    model, task, args = build(tiny_bin, TINY, "--sigma-reparam")
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())

    def gammas_have_gradients(trained):
        for name, linear in reparameterized(trained).items():
            assert linear.sigma_reparam.gamma.grad.abs() > 0, name

    assert_training_steps_reach_every_parameter(model, task, args, after_first_backward=gammas_have_gradients)


def test_checkpoint_activations_give_the_same_gradients_and_vectors(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, "--sigma-reparam", seed=7)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, "--sigma-reparam", "--checkpoint-activations", seed=7)
    grads = one_backward(wrapped, task)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name
    for (name, ours), theirs in zip(reparameterized(wrapped).items(), reparameterized(plain).values()):
        assert torch.equal(ours.sigma_reparam.u, theirs.sigma_reparam.u), name  # one step each, not two


@pytest.mark.parametrize("placement", [name for name in PLACEMENTS])
def test_composes_with_every_placement(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam", "--norm-placement", placement)
    assert reparameterized(model)
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags", [["--prenorm", "--normformer"], ["--prenorm", "--layernorm-scaling"],
                                   ["--prenorm", "--gpas"], ["--residual-scale", "deepnorm"],
                                   ["--prenorm", "--gated-attention"], ["--residual-scale", "admin"],
                                   ["--prenorm", "--residual-scale", "layerscale"], ["--weight-init", "tfixup",
                                                                                     "--norm-type", "identity"]])
def test_composes_with_the_other_modifiers_and_inits(tiny_bin, flags):
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam", *flags)
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


def test_head_scaled_and_gated_projections_see_the_reparameterised_weight(tiny_bin):
    """NormFormer's out_proj (head scales) and gated attention's gate_proj/out_proj: the hook makes
    their output that of W_hat = gamma / sigma(W) W."""
    model, _, _ = build(tiny_bin, TINY, "--sigma-reparam", "--prenorm", "--normformer", "--gated-attention")
    randomized(model, seed=4).eval()
    attn = model.encoder.layers[0].self_attn
    with torch.no_grad():
        for linear in (attn.out_proj, attn.gate_proj):
            linear.sigma_reparam.gamma.mul_(3.0)
        x = torch.randn(4, 2, 64)
        scale = attn.out_proj.sigma_reparam(attn.out_proj.weight)
        expected = nn.functional.linear(x * attn.out_proj.head_scale.repeat_interleave(32), scale * attn.out_proj.weight,
                                        attn.out_proj.bias)
        attn.out_proj.gate_logits = torch.full((4, 2, 64), 30.0)  # sigmoid = 1
        try:
            assert torch.allclose(attn.out_proj(x), expected, atol=1e-5)
        finally:
            attn.out_proj.gate_logits = None
        scale = attn.gate_proj.sigma_reparam(attn.gate_proj.weight)
        assert torch.allclose(attn.gate_proj(x), nn.functional.linear(x, scale * attn.gate_proj.weight,
                                                                      attn.gate_proj.bias), atol=1e-5)


@pytest.mark.parametrize("norm_type", list(NORM_TYPES))
def test_composes_with_every_norm_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam", "--prenorm", *norm_type_flags(norm_type))
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags,task,message", [
    (["--ngpt"], "translation_normplug", "--sigma-reparam cannot be combined with --ngpt"),
    (["--qknorm", "--qknorm-g0", "4"], "translation", "--sigma-reparam cannot be combined with --qknorm"),
    (["--encoder-xformers-att-config", "{}"], "translation",
     "--encoder-xformers-att-config cannot be combined with --sigma-reparam"),
])
def test_refusals_are_one_line(tiny_bin, flags, task, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--sigma-reparam", *flags, task=task)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_design_file_imports_only_the_public_interface():
    test_the_2024_2026_designs_import_only_the_public_interface("models/placements/sigma_reparam.py")


def test_bf16_model_keeps_float32_scales_and_is_close_to_float32(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam")
    assert_bf16_close_to_float32(model, task)
    for linear in reparameterized(model).values():
        scale = linear.sigma_reparam
        assert linear.weight.dtype == torch.bfloat16
        assert scale.gamma.dtype == scale.u.dtype == scale.v.dtype == torch.float32
    one_backward(model, task)  # a bf16 training step runs
    assert all(torch.isfinite(linear.sigma_reparam.gamma.grad) for linear in reparameterized(model).values())


def test_fairseq_train_logs_norm_stats_saves_and_generates(tiny_bin, tmp_path):
    records, hypotheses, state = train_and_generate(tiny_bin, str(tmp_path), ["--prenorm", "--sigma-reparam"])
    assert len(records) == 2 and all(math.isfinite(float(r["loss"])) for r in records)
    assert "in_std:dec1.ffn" in records[-1]
    assert len(hypotheses) == 100
    for name in ("encoder.layers.0.fc1", "decoder.layers.1.encoder_attn.k_proj"):
        gamma, u, v = (state[f"{name}.sigma_reparam.{key}"] for key in ("gamma", "u", "v"))
        assert gamma.dim() == 0 and torch.isfinite(gamma) and gamma.dtype == torch.float32
        weight = state[f"{name}.weight"].float()
        assert abs(v @ weight @ u - torch.linalg.matrix_norm(weight, ord=2)) < 0.05 * gamma.abs()


def saved_tensor_bytes(model, task):
    """Bytes of the distinct storages autograd saves for the backward of one training forward."""
    model.train()
    src, lengths, prev = toy_batch(task, batch=32, length=40)
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(src, lengths, prev)
    return sum(storages.values())


def test_activation_memory_is_the_plain_models_plus_weight_sized_tensors(tiny_bin):
    """W_hat replaces W inside the linear (as the authors' F.linear(x, W_hat, b)): the saved
    activations are the plain model's; only weight-sized tensors (W in float32, W_hat) are added."""
    model, task, _ = build(tiny_bin, TINY, "--sigma-reparam")
    plain, _, _ = build(tiny_bin, TINY)
    weights = sum(linear.weight.numel() * 4 for linear in reparameterized(model).values())
    extra = saved_tensor_bytes(model, task) - saved_tensor_bytes(plain, task)
    assert 0 < extra <= 4 * weights


def test_the_parameter_is_back_after_a_forward_and_after_a_failing_one():
    linear = nn.Linear(8, 6)
    install_sigma_reparam(linear)
    weight = linear.weight
    assert isinstance(weight, nn.Parameter)
    linear(torch.randn(2, 8)).sum().backward()
    assert linear.weight is weight and weight.grad is not None
    with pytest.raises(RuntimeError):
        linear(torch.randn(2, 5))  # wrong width: the linear's own forward raises
    assert linear.weight is weight and [name for name, _ in linear.named_parameters()] == [
        "weight", "bias", "sigma_reparam.gamma"]
