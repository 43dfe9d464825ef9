"""Issue 58's Keel (``--norm-placement keel``, models/placements/keel.py): built through fairseq's
parser on the tiny preset, each layer from the second on equal to the paper's equation
LN_1(alpha x + F(LN_2(x))) written out, alpha = L by default and ``--keel-alpha``, the first layer
the PreNorm layer x + F(LN_2(x)) of the paper's section 3.1 (``--keel-first-layer keel``: the Keel
block too), both stacks under ``--keel-first-layer keel`` equal to a transcription of
x-transformers' ``pre_and_post_norm`` block (lucidrains/x-transformers, which credits the Keel
paper) on the same modules, finite, incremental decoding equal to the full forward, every
parameter trained, norm slots, composition and refusals."""
import math

import pytest
import torch
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placements.base import SUBLAYER_NORMS
from fairseq_normplug.models.placements.keel import INPUT_NORMS, Keel
from fairseq_normplug.modules.norm_registry import NORM_TYPES, norm_type_of
from model_helpers import (assert_bf16_close_to_float32, assert_training_steps_reach_every_parameter, build,
                           incremental_and_full, norm_type_flags, one_backward, randomized, toy_batch)
from test_placement_registry import test_the_2024_2026_designs_import_only_the_public_interface
from test_sigma_reparam import train_and_generate

TINY = "transformer_normplug_tiny"
KEEL = ("--norm-placement", "keel")
KEEL_FIRST_LAYER = ("--norm-placement", "keel", "--keel-first-layer", "keel")
FIRST_LAYER_OPTIONS = [KEEL, ("--norm-placement", "keel", "--keel-first-layer", "pre"), KEEL_FIRST_LAYER]


def paper_block(x, alpha, sublayers):
    """The paper's x <- LN_1(alpha x + F(LN_2(x))) for each (LN_1, F, LN_2), no dropout (eval)."""
    for post_norm, sublayer, input_norm in sublayers:
        x = post_norm(alpha * x + sublayer(input_norm(x)))
    return x


def prenorm_block(x, sublayers):
    """Section 3.1's first layer: x <- x + F(LN_2(x)) for each (F, LN_2), no dropout (eval)."""
    for sublayer, input_norm in sublayers:
        x = x + sublayer(input_norm(x))
    return x


def encoder_sublayers(layer):
    """[(LN_1, F, LN_2)] of an encoder layer: self-attention, FFN."""
    def self_attention(h):
        return layer.self_attn(h, h, h, need_weights=False)[0]
    return [(layer.self_attn_layer_norm, self_attention, layer.keel_attn_input_norm),
            (layer.final_layer_norm, layer.feed_forward, layer.keel_ffn_input_norm)]


def decoder_sublayers(layer, mask, enc):
    """[(LN_1, F, LN_2)] of a decoder layer: causal self-attention, cross-attention, FFN."""
    def causal_attention(h):
        return layer.self_attn(h, h, h, attn_mask=mask, need_weights=False)[0]

    def cross_attention(h):
        return layer.encoder_attn(h, enc, enc, static_kv=True, need_weights=False)[0]
    return [(layer.self_attn_layer_norm, causal_attention, layer.keel_attn_input_norm),
            (layer.encoder_attn_layer_norm, cross_attention, layer.keel_cross_input_norm),
            (layer.final_layer_norm, layer.feed_forward, layer.keel_ffn_input_norm)]


@pytest.mark.parametrize("alpha_flags,encoder_alpha,decoder_alpha", [
    ((), 4.0, 6.0),  # L = the stack's sublayers: 2 layers x (attn, ffn) / 2 layers x (attn, cross, ffn)
    (("--keel-alpha", "2.5"), 2.5, 2.5),
])
@pytest.mark.parametrize("first_layer", [(), ("--keel-first-layer", "keel")])
def test_each_layer_is_the_papers_equation(tiny_bin, alpha_flags, encoder_alpha, decoder_alpha, first_layer):
    """Layer 1 of both stacks is LN_1(alpha x + F(LN_2(x))) (alpha = L counts the first layer's
    sublayers too); so is layer 0 with ``--keel-first-layer keel``, else layer 0 is section 3.1's
    PreNorm layer x + F(LN_2(x)), without LN_1 modules."""
    model, task, _ = build(tiny_bin, TINY, *KEEL, *alpha_flags, *first_layer)
    randomized(model, seed=1).eval()
    torch.manual_seed(2)
    x = torch.randn(5, 3, 64)
    enc = torch.randn(7, 3, 64)
    mask = torch.triu(torch.full((5, 5), float("-inf")), 1)
    first_is_keel = bool(first_layer)

    def expected_output(layer, sublayers, alpha, index):
        """The layer's output by the paper's block, or plain PreNorm for the first layer under
        the first-layer rule (no alpha, no post-norms)."""
        if index == 0 and not first_is_keel:
            assert layer.keel_alpha is None
            assert all(post_norm is None for post_norm, _, _ in sublayers)
            return prenorm_block(x, [(sublayer, input_norm) for _, sublayer, input_norm in sublayers])
        assert layer.keel_alpha == alpha
        return paper_block(x, alpha, sublayers)

    with torch.no_grad():
        for index in (0, 1):
            layer = model.encoder.layers[index]
            expected = expected_output(layer, encoder_sublayers(layer), encoder_alpha, index)
            assert torch.allclose(layer(x, None), expected, atol=1e-5), index

            layer = model.decoder.layers[index]
            expected = expected_output(layer, decoder_sublayers(layer, mask, enc), decoder_alpha, index)
            assert torch.allclose(layer(x, enc, None, self_attn_mask=mask)[0], expected, atol=1e-5), index
    # the stacks end with LN_1 of their last sublayer: no extra final norm
    assert model.encoder.layer_norm is None and model.decoder.layer_norm is None


# ---- x-transformers' pre_and_post_norm block, transcribed (lucidrains/x-transformers 9252ed7, ----------
# ---- x_transformers/x_transformers.py; "pre + post norm - keel paper", x_transformers.py:2820) ---------

def exists(val):
    """``exists`` (x_transformers.py:76-77), verbatim."""
    return val is not None


class Residual(nn.Module):
    """``Residual`` (x_transformers.py:1144-1160), verbatim (their ``Module`` is ``nn.Module``):
    ``x`` is the branch's output, ``residual`` the skip, scaled by ``scale_residual_constant``
    (Keel's alpha)."""

    def __init__(self, dim, scale_residual = False, scale_residual_constant = 1., **kwargs):
        super().__init__()
        self.residual_scale = nn.Parameter(torch.ones(dim)) if scale_residual else None
        self.scale_residual_constant = scale_residual_constant

    def prepare(self, residual):
        return residual, residual, dict()

    def forward(self, x, residual, **kwargs):
        if exists(self.residual_scale):
            residual = residual * self.residual_scale

        if self.scale_residual_constant != 1:
            residual = residual * self.scale_residual_constant

        return x + residual


def x_transformers_layers(x, layers):
    """The lines of ``AttentionLayers.forward``'s layer loop (x_transformers.py:3478-3547) that run
    with ``pre_and_post_norm = True`` and nothing else switched on, verbatim but for the two
    reductions below: every sublayer has
    ``norm = (pre_branch_norm, None, post_main_norm)`` (x_transformers.py:3135-3143: no sandwich
    norm, a post-main norm because of pre_and_post_norm), a ``block`` and a ``Residual``; the
    block's call is reduced to ``block(x)`` (masks and caches go into our ``block`` closures) and
    the kwargs that only the other residual kinds read are left out. No final norm follows:
    pre_and_post_norm sets ``pre_norm_has_final_norm = False`` (x_transformers.py:2824-2826, 2998)."""
    for norm, block, residual_fn in layers:
        x, inner_residual, residual_kwargs = residual_fn.prepare(x)

        pre_norm, post_branch_norm, post_main_norm = norm

        if exists(pre_norm):
            x = pre_norm(x)

        out = block(x)

        if exists(post_branch_norm):
            out = post_branch_norm(out)

        x = residual_fn(out, inner_residual, **residual_kwargs)

        if exists(post_main_norm):
            x = post_main_norm(x)
    return x


def x_transformers_stack(layers, alpha, x, self_attn_mask=None, enc=None):
    """Our layers as x-transformers' ('a', 'f') / ('a', 'c', 'f') sublayers (x_transformers.py:
    2878-2883): pre_branch_norm = our LN_2, post_main_norm = our LN_1, ``Residual`` with
    ``scale_residual_constant = alpha``."""
    sublayers = []
    for layer in layers:
        kinds = [("attn", layer.self_attn_layer_norm,
                  lambda h, layer=layer: layer.self_attn(h, h, h, attn_mask=self_attn_mask, need_weights=False)[0])]
        if enc is not None:
            kinds.append(("cross", layer.encoder_attn_layer_norm, lambda h, layer=layer: layer.encoder_attn(
                h, enc, enc, static_kv=True, need_weights=False)[0]))
        kinds.append(("ffn", layer.final_layer_norm, layer.feed_forward))
        for kind, post_main_norm, block in kinds:
            norm = (getattr(layer, INPUT_NORMS[kind]), None, post_main_norm)
            sublayers.append((norm, block, Residual(64, scale_residual_constant=alpha)))
    return x_transformers_layers(x, sublayers)


@pytest.mark.parametrize("alpha_flags,encoder_alpha,decoder_alpha", [
    ((), 4.0, 6.0),
    (("--keel-alpha", "2.5"), 2.5, 2.5),
])
def test_both_stacks_equal_x_transformers_pre_and_post_norm_with_the_residual_scaled_by_alpha(
        tiny_bin, alpha_flags, encoder_alpha, decoder_alpha):
    """x-transformers' block with ``scale_residual_constant = alpha`` is Keel's
    LN_1(alpha x + F(LN_2(x))) for every sublayer: under ``--keel-first-layer keel`` (x-transformers
    has no first-layer rule) the whole encoder and decoder (embedding output in, stack output out,
    no final norm) give the same numbers as ours."""
    model, task, _ = build(tiny_bin, TINY, *KEEL_FIRST_LAYER, *alpha_flags)
    randomized(model, seed=1).eval()
    src, lengths, prev = toy_batch(task)
    assert not src.eq(task.source_dictionary.pad()).any()
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        ours = encoder_out["encoder_out"][0]
        x, _ = model.encoder.forward_embedding(src)
        theirs = x_transformers_stack(model.encoder.layers, encoder_alpha, x.transpose(0, 1))
        assert torch.allclose(ours, theirs, atol=1e-5)

        ours, _ = model.decoder.extract_features(prev, encoder_out=encoder_out)
        decoder = model.decoder
        x = decoder.embed_scale * decoder.embed_tokens(prev) + decoder.embed_positions(prev)
        length = prev.size(1)
        mask = torch.triu(torch.full((length, length), float("-inf")), 1)
        theirs = x_transformers_stack(decoder.layers, decoder_alpha, x.transpose(0, 1), mask,
                                      encoder_out["encoder_out"][0])
        assert torch.allclose(ours, theirs.transpose(0, 1), atol=1e-5)


@pytest.mark.parametrize("flags,first_layer_post_norms", [(KEEL, False), (KEEL_FIRST_LAYER, True)])
def test_norm_slots_get_the_chosen_norm_type_and_are_logged(tiny_bin, flags, first_layer_post_norms):
    """Every norm that exists gets ``--norm-type``; a PreNorm first layer has no LN_1 at all."""
    model, _, _ = build(tiny_bin, TINY, *flags, "--norm-type", "rmsnorm")
    norms = named_norms(model)
    first = range(2) if first_layer_post_norms else range(1, 2)
    expected = {f"enc{i}.{short}" for i in range(2) for short in ("keel_attn_in", "keel_ffn_in")}
    expected |= {f"enc{i}.{short}" for i in first for short in ("attn", "ffn")}
    expected |= {f"dec{i}.{short}" for i in range(2) for short in ("keel_attn_in", "keel_cross_in", "keel_ffn_in")}
    expected |= {f"dec{i}.{short}" for i in first for short in ("attn", "cross", "ffn")}
    assert set(norms) == expected
    names = {name for name, _ in model.named_parameters()}
    for stack in ("encoder", "decoder"):
        assert any(name.startswith(f"{stack}.layers.1.self_attn_layer_norm.") for name in names)
        assert any(name.startswith(f"{stack}.layers.0.self_attn_layer_norm.") for name in names) == \
            first_layer_post_norms
        assert any(name.startswith(f"{stack}.layers.0.final_layer_norm.") for name in names) == first_layer_post_norms
    assert any(name.startswith("decoder.layers.0.encoder_attn_layer_norm.") for name in names) == \
        first_layer_post_norms
    assert {norm_type_of(norm) for norm in norms.values()} == {"rmsnorm"}
    assert not hasattr(model.encoder.layers[0], INPUT_NORMS["cross"])


@pytest.mark.parametrize("flags", FIRST_LAYER_OPTIONS)
def test_finite_incremental_equals_full_and_every_parameter_trains(tiny_bin, flags):
    model, task, args = build(tiny_bin, TINY, *flags)
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    assert_training_steps_reach_every_parameter(model, task, args)


def test_checkpoint_activations_give_the_same_gradients(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, *KEEL, seed=7)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, *KEEL, "--checkpoint-activations", seed=7)
    grads = one_backward(wrapped, task)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name


@pytest.mark.parametrize("norm_type", list(NORM_TYPES))
def test_composes_with_every_norm_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, *KEEL, *norm_type_flags(norm_type))
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags", [["--gated-attention"], ["--sigma-reparam"], ["--denseformer"],
                                   ["--qknorm", "--qknorm-g0", "4"], ["--no-decoder-final-norm"],
                                   ["--encoder-layerdrop", "0.5"]])
def test_composes_with_the_other_designs(tiny_bin, flags):
    model, task, _ = build(tiny_bin, TINY, *KEEL, *flags)
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    assert all(grad is None or torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags,message", [
    (["--norm-placement", "keel", "--residual-scale", "rezero"],
     "--residual-scale rezero cannot be combined with --norm-placement keel"),
    (["--norm-placement", "keel", "--residual-scale", "deepnorm"], "--residual-scale deepnorm"),
    (["--norm-placement", "keel", "--weight-init", "tfixup", "--norm-type", "identity"],
     "--weight-init tfixup cannot be combined with --norm-placement keel"),
    (["--norm-placement", "keel", "--normformer"], "--normformer needs the PreNorm placement"),
    (["--prenorm", "--keel-alpha", "2"], "--keel-alpha needs --norm-placement keel"),
    (["--prenorm", "--keel-first-layer", "pre"], "--keel-first-layer needs --norm-placement keel, got --norm-placement pre"),
    (["--norm-placement", "post", "--keel-first-layer", "keel"], "--keel-first-layer needs --norm-placement keel"),
])
def test_refusals_are_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_keel_first_layer_keel_reproduces_every_layer_as_the_keel_block(tiny_bin):
    """``--keel-first-layer keel`` is the model with the Keel block in every layer: the same
    parameters (names, shapes, init) and the same outputs as the placement without the rule,
    written out here by giving the default model's first layers their LN_1 and alpha back."""
    keel, task, _ = build(tiny_bin, TINY, *KEEL_FIRST_LAYER, seed=3)
    default, _, _ = build(tiny_bin, TINY, *KEEL, seed=3)
    kept = dict(keel.named_parameters())
    assert all(torch.equal(p, kept[name]) for name, p in default.named_parameters())
    randomized(keel, seed=1).eval()
    removed = {name for name, _ in keel.named_parameters()} - {name for name, _ in default.named_parameters()}
    assert removed == {f"{stack}.layers.0.{norm}.{p}" for stack, norms in (
        ("encoder", ("self_attn_layer_norm", "final_layer_norm")),
        ("decoder", ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")))
        for norm in norms for p in ("weight", "bias")}
    for stack in (default.encoder, default.decoder):
        first = stack.layers[0]
        for kind in ("attn", "cross", "ffn"):
            if getattr(first, INPUT_NORMS[kind], None) is not None:
                setattr(first, SUBLAYER_NORMS[kind], nn.LayerNorm(64))
        first.keel_alpha = stack.layers[1].keel_alpha
    default.load_state_dict(keel.state_dict())
    default.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        assert torch.equal(default(src, lengths, prev)[0], keel(src, lengths, prev)[0])


def test_the_first_layer_rule_changes_the_model(tiny_bin):
    """The default (section 3.1's PreNorm first layer) and ``--keel-first-layer keel`` are different
    functions of the same shared parameters."""
    keel, task, _ = build(tiny_bin, TINY, *KEEL_FIRST_LAYER, seed=3)
    default, _, _ = build(tiny_bin, TINY, *KEEL, seed=3)
    randomized(keel, seed=1).eval()
    default.load_state_dict(keel.state_dict(), strict=False)
    default.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        assert not torch.allclose(default(src, lengths, prev)[0], keel(src, lengths, prev)[0], atol=1e-3)


def test_bad_keel_first_layer_values_are_refused(tiny_bin, capsys):
    """On the command line argparse names the choices; in saved or hand-made args, one line."""
    with pytest.raises(SystemExit) as exit_info:
        build(tiny_bin, TINY, *KEEL, "--keel-first-layer", "post")
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "argument --keel-first-layer: invalid choice: 'post' (choose from " in message
    assert "pre" in message.split("choose from ")[1] and "keel" in message.split("choose from ")[1]
    _, _, args = build(tiny_bin, TINY, *KEEL)
    args.keel_first_layer = "post"
    with pytest.raises(NormplugError) as error:
        Keel(args)
    assert str(error.value) == "unknown --keel-first-layer 'post'; choose from pre, keel"


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_keel_alpha_must_be_positive_and_finite(tiny_bin, value):
    with pytest.raises((NormplugError, SystemExit)):
        build(tiny_bin, TINY, *KEEL, "--keel-alpha", value)


def test_the_design_file_imports_only_the_public_interface():
    test_the_2024_2026_designs_import_only_the_public_interface("models/placements/keel.py")


def test_bf16_model_is_finite_and_close_to_float32(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, *KEEL)
    assert_bf16_close_to_float32(model, task)


def test_fairseq_train_logs_norm_stats_saves_and_generates(tiny_bin, tmp_path):
    records, hypotheses, state = train_and_generate(tiny_bin, str(tmp_path), [*KEEL, "--norm-type", "rmsnorm"])
    assert len(records) == 2 and all(math.isfinite(float(r["loss"])) for r in records)
    assert "in_std:enc0.keel_attn_in" in records[-1] and "in_std:dec1.keel_cross_in" in records[-1]
    assert len(hypotheses) == 100
    assert "decoder.layers.1.keel_cross_input_norm.weight" in state


def bottom_to_top_gradient_ratio(tiny_bin, *flags, layers=12):
    """|grad fc1| of the decoder's first layer over its last one's, at init (no dropout), for a
    loss on the decoder's output."""
    model, task, _ = build(tiny_bin, TINY, "--encoder-layers", str(layers), "--decoder-layers", str(layers),
                           "--dropout", "0", *flags)
    model.train()
    src, lengths, prev = toy_batch(task, batch=8, length=12)
    model(src, lengths, prev)[0].logsumexp(-1).mean().backward()
    layers = model.decoder.layers
    return (layers[0].fc1.weight.grad.norm() / layers[-1].fc1.weight.grad.norm()).item()


def test_the_scaled_residual_keeps_the_gradient_from_vanishing_down_a_deep_postnorm_stack(tiny_bin):
    """The paper's point: PostNorm's gradient vanishes from the top layers to the bottom (here
    below 0.2 of the top's at 12 decoder layers); Keel's alpha = L residual keeps it (above 0.5)."""
    assert bottom_to_top_gradient_ratio(tiny_bin) < 0.2
    assert bottom_to_top_gradient_ratio(tiny_bin, *KEEL) > 0.5
