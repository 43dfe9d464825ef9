"""Issue 58's DenseFormer (``--denseformer``, models/placements/denseformer.py): built through
fairseq's parser on the tiny preset, the plain model at init, finite, incremental decoding equal
to the full forward, every parameter trained, the authors' ``DWAModules`` (a transcription of
epfml/DenseFormer ``denseformer/denseformer.py``) on the same blocks and weights, composition and
refusals."""
import copy
import math

import pytest
import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.placements import PLACEMENTS
from fairseq_normplug.models.placements.denseformer import DepthWeightedAverages
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from model_helpers import (assert_training_steps_reach_every_parameter, build, incremental_and_full, norm_type_flags,
                           one_backward, randomized, toy_batch)
from test_placement_registry import test_the_2024_2026_designs_import_only_the_public_interface
from test_sigma_reparam import train_and_generate

TINY = "transformer_normplug_tiny"
#: the built-in placements whose layers carry several streams concatenated along the features
MULTI_STREAM_PLACEMENTS = ("resi-dual", "siamese", "hyper-connections", "attention-residuals")
COMPOSING = [name for name in PLACEMENTS if name not in MULTI_STREAM_PLACEMENTS]


def test_the_multi_stream_placements_are_those_declaring_several_streams():
    """DenseFormer reads the ``single_stream`` capability: the built-ins it refuses are these four."""
    assert [name for name, cls in PLACEMENTS.items() if not cls.single_stream] == list(MULTI_STREAM_PLACEMENTS)


def randomize_alphas(model, seed=3):
    """Non-identity DWA weights, so the averages really mix the blocks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            for alpha in stack.denseformer.alphas.values():
                alpha.add_(0.3 * torch.randn(alpha.shape, generator=g))
    return model


# ---- the authors' code, transcribed (epfml/DenseFormer c99a623, denseformer/denseformer.py) ----------

class InPlaceSetSlice(torch.autograd.Function):
    """``InPlaceSetSlice`` (denseformer.py:4-19), verbatim."""

    @staticmethod
    def forward(ctx, full_tensor, last_slice, x_idx, x_val):
        full_tensor[x_idx] = x_val
        ctx.x_idx = x_idx
        ret = torch.Tensor().to(full_tensor.device)
        ret.set_(full_tensor[:x_idx + 1])
        return ret

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.x_idx == 0:
            return None, None, None, grad_out[ctx.x_idx]
        else:
            return None, grad_out[:ctx.x_idx], None, grad_out[ctx.x_idx]


def apply_inplace_set(x_acc, x_idx, x_val):
    full_tensor, last_slice = x_acc
    new_slice = InPlaceSetSlice.apply(full_tensor, last_slice, x_idx, x_val)
    return full_tensor, new_slice


class DWAModules(torch.nn.Module):
    """``DWAModules`` (denseformer.py:28-64), verbatim."""

    def __init__(self, n_blocks, dilation=1, period=1):
        super().__init__()
        self.n_blocks = n_blocks
        self.dilation = dilation
        self.period = period
        self.alphas = torch.nn.ModuleList([torch.nn.Linear((i+1+dilation)//dilation, 1, bias=False)
                                           if (i+1) % period == 0 else None for i in range(n_blocks)])
        self.accumulators = None
        self._init_weights()

    def _init_weights(self):
        for module in self.alphas:
            if module is not None:
                module.weight.data.zero_()
                module.weight.data[0, -1] = 1.

    def init_accumulators(self, x):
        x_accs = []
        for i in range(self.dilation):
            current_group_size = (self.n_blocks + 1) // self.dilation
            if i < (self.n_blocks + 1) % self.dilation:
                current_group_size += 1
            x_accs.append((torch.zeros((current_group_size, *x.shape), device=x.device, dtype=x.dtype), None))
        x_accs[0] = apply_inplace_set(x_accs[0], 0, x)
        self.accumulators = x_accs

    def forward(self, x, block_idx):
        assert self.accumulators is not None, "`init_accumulators(x)` needs to be called first"
        self.accumulators[(block_idx+1) % self.dilation] = apply_inplace_set(
            self.accumulators[(block_idx+1) % self.dilation],
            (block_idx+1)//self.dilation,
            x
        )
        if (block_idx+1) % self.period == 0:
            x = torch.tensordot(self.alphas[block_idx].weight.view(-1),
                                self.accumulators[(block_idx+1) % self.dilation][1], dims=1)
        return x


def authors_encoder(encoder, dwa, src):
    """The encoder's forward with the authors' DWA loop (their ``DenseFormer.forward`` with
    ``DWAModules``): embedding output, blocks without our hooks (``layer.forward``), a DWA after
    each, then the stack's final norm. No padding in ``src``."""
    x, _ = encoder.forward_embedding(src)
    x = x.transpose(0, 1)
    dwa.init_accumulators(x)
    for index, layer in enumerate(encoder.layers):
        x = layer.forward(x, encoder_padding_mask=None)
        x = dwa(x, index)
    return encoder.layer_norm(x) if encoder.layer_norm is not None else x


@pytest.mark.parametrize("placement,layers,dilation,period", [("pre", 2, 1, 1), ("post", 2, 1, 1), ("pre", 5, 2, 1),
                                                             ("pre", 5, 1, 2), ("post", 6, 2, 3)])
def test_denseformer_equals_the_authors_dwa_modules(tiny_bin, placement, layers, dilation, period):
    model, task, _ = build(tiny_bin, TINY, "--denseformer", "--norm-placement", placement, "--encoder-layers",
                           str(layers), "--denseformer-dilation", str(dilation), "--denseformer-period", str(period))
    randomize_alphas(randomized(model, seed=1)).eval()
    encoder = model.encoder
    dwa = DWAModules(len(encoder.layers), dilation=dilation, period=period)
    ours_alphas = encoder.denseformer.alphas
    assert sorted(ours_alphas, key=int) == [str(i) for i, theirs in enumerate(dwa.alphas) if theirs is not None]
    with torch.no_grad():
        for index, ours in ours_alphas.items():
            dwa.alphas[int(index)].weight.copy_(ours.view(1, -1))
    src, lengths, _ = toy_batch(task)
    assert not src.eq(task.source_dictionary.pad()).any()
    ours = encoder(src, src_lengths=lengths)["encoder_out"][0]
    theirs = authors_encoder(encoder, dwa, src)
    assert torch.allclose(ours, theirs, atol=1e-5)
    # the same gradients of the averaging weights
    ours.pow(2).sum().backward()
    theirs.pow(2).sum().backward()
    for index, ours_alpha in ours_alphas.items():
        theirs_grad = dwa.alphas[int(index)].weight.grad.view(-1)
        scale = theirs_grad.abs().max().item()  # sums over every element: float32 noise
        assert torch.allclose(ours_alpha.grad, theirs_grad, atol=1e-4 * scale), index
    # and the averages matter: the plain blocks give another output
    with torch.no_grad():
        x, _ = encoder.forward_embedding(src)
        x = x.transpose(0, 1)
        for layer in encoder.layers:
            x = layer.forward(x, encoder_padding_mask=None)
        plain = encoder.layer_norm(x) if encoder.layer_norm is not None else x
    assert not torch.allclose(plain, ours, atol=1e-3)


def test_identity_init_gives_the_plain_model(tiny_bin):
    model, task, args = build(tiny_bin, TINY, "--denseformer")
    assert args.denseformer
    for stack in (model.encoder, model.decoder):
        assert isinstance(stack.denseformer, DepthWeightedAverages)
        assert [alpha.tolist() for alpha in stack.denseformer.alphas.values()] == [[0.0, 1.0], [0.0, 0.0, 1.0]]
    plain, _, _ = build(tiny_bin, TINY)
    names = [name for name, _ in model.named_parameters()]
    plain_names = [name for name, _ in plain.named_parameters()]
    assert set(plain_names) <= set(names)
    assert sorted(set(names) - set(plain_names)) == ["decoder.denseformer.alphas.0", "decoder.denseformer.alphas.1",
                                                       "encoder.denseformer.alphas.0", "encoder.denseformer.alphas.1"]
    src, lengths, prev = toy_batch(task)
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.allclose(model(src, lengths, prev)[0], plain(src, lengths, prev)[0], atol=1e-6)
    assert model.encoder.denseformer.history is None and model.decoder.denseformer.history is None


@pytest.mark.parametrize("variant", [[], ["--denseformer-dilation", "2", "--denseformer-period", "2"]])
def test_finite_incremental_equals_full_and_every_parameter_trains(tiny_bin, variant):
    model, task, args = build(tiny_bin, TINY, "--denseformer", "--encoder-layers", "4", "--decoder-layers", "4",
                              *variant)
    randomize_alphas(randomized(model, seed=1))
    steps, full = incremental_and_full(model, task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())

    def alphas_have_gradients(trained):
        for stack in (trained.encoder, trained.decoder):
            for alpha in stack.denseformer.alphas.values():
                assert (alpha.grad.abs() > 0).all()

    assert_training_steps_reach_every_parameter(model, task, args, after_first_backward=alphas_have_gradients)


def test_checkpoint_activations_give_the_same_gradients(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, "--denseformer", seed=7)
    randomize_alphas(plain)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, "--denseformer", "--checkpoint-activations", seed=7)
    randomize_alphas(wrapped)
    grads = one_backward(wrapped, task)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name


@pytest.mark.parametrize("placement", COMPOSING)
def test_composes_with_every_single_stream_placement(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, "--denseformer", "--norm-placement", placement)
    randomize_alphas(randomized(model, seed=1))
    steps, full = incremental_and_full(model, task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags", [["--prenorm", "--normformer"], ["--prenorm", "--layernorm-scaling"],
                                   ["--prenorm", "--gpas"], ["--residual-scale", "deepnorm"],
                                   ["--prenorm", "--gated-attention"], ["--prenorm", "--sigma-reparam"],
                                   ["--prenorm", "--qknorm", "--qknorm-g0", "4"],
                                   ["--prenorm", "--residual-scale", "rezero"], ["--layernorm-embedding"]])
def test_composes_with_the_other_modifiers(tiny_bin, flags):
    model, task, _ = build(tiny_bin, TINY, "--denseformer", *flags)
    randomize_alphas(randomized(model, seed=1))
    steps, full = incremental_and_full(model, task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("norm_type", list(NORM_TYPES))
def test_composes_with_every_norm_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, "--denseformer", "--prenorm", *norm_type_flags(norm_type))
    randomize_alphas(randomized(model, seed=1))
    steps, full = incremental_and_full(model, task)
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags,task,message", [
    *[(["--norm-placement", name], "translation",
       f"--denseformer cannot be combined with --norm-placement {name}") for name in MULTI_STREAM_PLACEMENTS],
    (["--ngpt"], "translation_normplug", "--denseformer cannot be combined with --ngpt"),
    (["--prenorm", "--encoder-layerdrop", "0.1"], "translation",
     "--encoder-layerdrop 0.1 cannot be combined with --denseformer"),
    (["--prenorm", "--decoder-layerdrop", "0.2"], "translation",
     "--decoder-layerdrop 0.2 cannot be combined with --denseformer"),
    (["--prenorm", "--encoder-layers-to-keep", "0"], "translation",
     "--encoder-layers-to-keep cannot be combined with --denseformer"),
])
def test_refusals_are_one_line(tiny_bin, flags, task, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--denseformer", *flags, task=task)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("flags,message", [
    (["--prenorm", "--denseformer-dilation", "2"], "--denseformer-dilation needs --denseformer"),
    (["--prenorm", "--denseformer-period", "3"], "--denseformer-period needs --denseformer"),
])
def test_variant_flags_need_the_design(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("flag", ["--denseformer-dilation", "--denseformer-period"])
@pytest.mark.parametrize("value", ["0", "1.5"])
def test_variant_flags_take_positive_integers(tiny_bin, flag, value):
    with pytest.raises((NormplugError, SystemExit)):
        build(tiny_bin, TINY, "--denseformer", flag, value)


def test_the_design_file_imports_only_the_public_interface():
    test_the_2024_2026_designs_import_only_the_public_interface("models/placements/denseformer.py")


def test_bf16_model_is_finite_and_close_to_float32(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--denseformer")
    randomize_alphas(randomized(model)).eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        full = model(src, lengths, prev)[0]
        half = model.to(torch.bfloat16)(src, lengths, prev)[0]
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    assert (half.float() - full).abs().max().item() < 0.05 * max(1.0, full.abs().max().item())
    model.train()
    model(src, lengths, prev)[0].float().pow(2).mean().backward()
    assert all(torch.isfinite(alpha.grad).all() for alpha in model.decoder.denseformer.alphas.values())


def test_fairseq_train_logs_norm_stats_saves_and_generates(tiny_bin, tmp_path):
    records, hypotheses, state = train_and_generate(tiny_bin, str(tmp_path), ["--prenorm", "--denseformer"])
    assert len(records) == 2 and all(math.isfinite(float(r["loss"])) for r in records)
    assert "in_std:enc1.ffn" in records[-1]
    assert len(hypotheses) == 100
    for stack in ("encoder", "decoder"):
        alpha = state[f"{stack}.denseformer.alphas.1"]
        assert alpha.shape == (3,) and not torch.equal(alpha, torch.tensor([0.0, 0.0, 1.0]))  # trained


def test_a_deep_copy_averages_with_its_own_weights(tiny_bin):
    """fairseq's EMA and checkpoint averaging copy the model: the copy's hooks use the copy's weights."""
    model, task, _ = build(tiny_bin, TINY, "--denseformer")
    randomize_alphas(randomized(model, seed=1)).eval()
    twin = copy.deepcopy(model)
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        before = model(src, lengths, prev)[0]
        assert torch.equal(twin(src, lengths, prev)[0], before)
        for alpha in twin.decoder.denseformer.alphas.values():
            alpha.mul_(-1.0)
        assert torch.equal(model(src, lengths, prev)[0], before)
        assert not torch.allclose(twin(src, lengths, prev)[0], before, atol=1e-3)
