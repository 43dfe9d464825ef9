"""Issue 58's Attention Residuals (``--norm-placement attention-residuals [--attn-res-blocks N]``,
models/placements/attention_residuals.py): built through fairseq's parser on the tiny preset,
the encoder equal to a transcription of the authors' code (the README pseudocode of
MoonshotAI/Attention-Residuals: ``block_attn_res`` and the layer's ``forward``) on the same
modules and inputs, the decoder (with cross-attention, which the authors do not define) equal to
the equation written out, finite, incremental decoding equal to the full forward, every parameter
trained, the same gradients under --checkpoint-activations, bf16, composition and refusals."""
import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn import Linear, RMSNorm

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placements.attention_residuals import KEY_NORM_EPS, DepthAttention
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from model_helpers import (assert_bf16_close_to_float32, assert_incremental_equals_full,
                           assert_training_steps_reach_every_parameter, build, norm_type_flags, one_backward,
                           randomized, toy_batch)
from test_placement_registry import test_the_2024_2026_designs_import_only_the_public_interface
from test_sigma_reparam import train_and_generate

TINY = "transformer_normplug_tiny"  # d=64, 2+2 layers
ATTNRES = ("--norm-placement", "attention-residuals")
FOUR_LAYERS = ("--encoder-layers", "4", "--decoder-layers", "4")
VARIANTS = {"full": (), "block2": ("--attn-res-blocks", "2"), "block1": ("--attn-res-blocks", "1"),
            "block4": ("--attn-res-blocks", "4")}


# ---- the authors' code, transcribed (MoonshotAI/Attention-Residuals 85e2231, README.md:52-91, the ----
# ---- "PyTorch-style pseudocode" block: block_attn_res README.md:53-65, the layer forward README.md:67-90) ----

def block_attn_res(blocks: list[Tensor], partial_block: Tensor, proj: Linear, norm: RMSNorm) -> Tensor:
    """
    Inter-block attention: attend over block reps + partial sum.
    blocks:
        N tensors of shape [B, T, D]: completed block representations for each previous block
    partial_block:
        [B, T, D]:    intra-block partial sum (b_n^i)
    """
    V = torch.stack(blocks + [partial_block])  # [N+1, B, T, D]
    K = norm(V)
    logits = torch.einsum('d, n b t d -> n b t', proj.weight.squeeze(), K)
    h = torch.einsum('n b t, n b t d -> b t d', logits.softmax(0), V)
    return h


class AuthorsLayer(nn.Module):
    """The README's layer ``forward`` (README.md:67-90), verbatim, around one of our encoder layers (its attention,
    FFN and PreNorm norms: ``attn``, ``mlp``, ``attn_norm``, ``mlp_norm``) with the pseudocode's
    ``attn_res_proj`` / ``mlp_res_proj`` (Linear(D, 1)) and ``attn_res_norm`` / ``mlp_res_norm``
    (RMSNorm) holding our pseudo-queries and key norm gains."""

    def __init__(self, layer, layer_number, block_size):
        super().__init__()
        self.layer_number, self.block_size = layer_number, block_size
        self.attn = lambda h: layer.self_attn(query=h, key=h, value=h, key_padding_mask=None, need_weights=False)[0]
        self.mlp = layer.feed_forward
        self.attn_norm, self.mlp_norm = layer.self_attn_layer_norm, layer.final_layer_norm
        ours = layer.attention_residuals
        self.attn_res_proj, self.attn_res_norm = authors_modules(ours["attn"] if "attn" in ours else None)
        self.mlp_res_proj, self.mlp_res_norm = authors_modules(ours["ffn"])

    def forward(self, blocks: list[Tensor], hidden_states: Tensor) -> tuple[list[Tensor], Tensor]:
        partial_block = hidden_states
        # apply block attnres before attn
        # blocks already include token embedding
        h = block_attn_res(blocks, partial_block, self.attn_res_proj, self.attn_res_norm)

        # if reaches block boundary, start new block
        # block_size counts ATTN + MLP; each transformer layer has 2
        if self.layer_number % (self.block_size // 2) == 0:
            blocks.append(partial_block)
            partial_block = None

        # self-attention layer
        attn_out = self.attn(self.attn_norm(h))
        partial_block = partial_block + attn_out if partial_block is not None else attn_out

        # apply block attnres before MLP
        h = block_attn_res(blocks, partial_block, self.mlp_res_proj, self.mlp_res_norm)

        # MLP layer
        mlp_out = self.mlp(self.mlp_norm(h))
        partial_block = partial_block + mlp_out

        return blocks, partial_block


#: (our DepthAttention, (proj, norm)) of every copy made since the last ``COPIES.clear()``
COPIES = []


def authors_modules(ours):
    """The pseudocode's ``proj`` (Linear(D, 1, bias=False)) and ``norm`` (RMSNorm) with the values
    of our :class:`DepthAttention` (None: the first self-attention, which has one source)."""
    dim = 64
    proj, norm = nn.Linear(dim, 1, bias=False), nn.RMSNorm(dim, eps=KEY_NORM_EPS)
    with torch.no_grad():
        proj.weight.zero_()
        if ours is not None:
            proj.weight.copy_(ours.query.view(1, -1))
            norm.weight.copy_(ours.key_norm_weight)
            COPIES.append((ours, (proj, norm)))
    return proj, norm


def authors_block_encoder(encoder, src, blocks_per_stack):
    """The encoder with the authors' layers: ``blocks = []``, the embedding output as the first
    ``hidden_states``, ``layer_number`` from 0, block_size = 2 L/N sublayers; the stack's output
    aggregation (``block_attn_res`` with the last layer's final pseudo-query), then the final norm."""
    x, _ = encoder.forward_embedding(src)
    x = x.transpose(0, 1)
    layers = encoder.layers
    block_size = 2 * len(layers) // blocks_per_stack
    blocks, partial = [], x
    for index, layer in enumerate(layers):
        blocks, partial = AuthorsLayer(layer, index, block_size)(blocks, partial)
    proj, norm = authors_modules(layers[-1].attention_residuals["final"])
    return encoder.layer_norm(block_attn_res(blocks, partial, proj, norm))


def authors_full_encoder(encoder, src):
    """Full AttnRes, the README's h_l = sum_{i<l} alpha_{i->l} v_i: ``block_attn_res`` with every
    sublayer output its own block (v_0 the embedding output)."""
    x, _ = encoder.forward_embedding(src)
    sources = [x.transpose(0, 1)]
    for layer in encoder.layers:
        authors = AuthorsLayer(layer, 0, 2)
        for proj, norm, sublayer_norm, sublayer in (
                (authors.attn_res_proj, authors.attn_res_norm, authors.attn_norm, authors.attn),
                (authors.mlp_res_proj, authors.mlp_res_norm, authors.mlp_norm, authors.mlp)):
            h = block_attn_res(sources[:-1], sources[-1], proj, norm)
            sources.append(sublayer(sublayer_norm(h)))
    proj, norm = authors_modules(encoder.layers[-1].attention_residuals["final"])
    return encoder.layer_norm(block_attn_res(sources[:-1], sources[-1], proj, norm))


@pytest.mark.parametrize("variant,layers", [("full", 2), ("full", 4), ("block2", 4), ("block1", 4), ("block4", 4),
                                            ("block2", 6)])
def test_the_encoder_equals_the_authors_pseudocode(tiny_bin, variant, layers):
    model, task, _ = build(tiny_bin, TINY, *ATTNRES, *VARIANTS[variant], "--encoder-layers", str(layers),
                           "--decoder-layers", str(layers))
    randomized(model, seed=1).eval()  # non-zero pseudo-queries: the weights differ by source and position
    encoder = model.encoder
    src, lengths, _ = toy_batch(task)
    assert not src.eq(task.source_dictionary.pad()).any()
    COPIES.clear()
    ours = encoder(src, src_lengths=lengths)["encoder_out"][0]
    if variant == "full":
        theirs = authors_full_encoder(encoder, src)
    else:
        theirs = authors_block_encoder(encoder, src, int(VARIANTS[variant][1]))
    assert torch.allclose(ours, theirs, atol=1e-5)
    # the same gradients of every pseudo-query and key gain, ours and the pseudocode's copies
    ours.pow(2).sum().backward()
    theirs.pow(2).sum().backward()
    assert len(COPIES) == len([m for m in encoder.modules() if isinstance(m, DepthAttention)])
    for our, (proj, norm) in COPIES:
        scale = max(1e-3, our.query.grad.abs().max().item())
        assert torch.allclose(our.query.grad, proj.weight.grad.view(-1), atol=1e-4 * scale)
        scale = max(1e-3, our.key_norm_weight.grad.abs().max().item())
        assert torch.allclose(our.key_norm_weight.grad, norm.weight.grad, atol=1e-4 * scale)


@pytest.mark.parametrize("variant", ["full", "block2"])
def test_at_init_it_is_prenorm_up_to_the_norms_eps_and_the_queries_change_that(tiny_bin, variant):
    """Zero queries: uniform weights, h_l = (1/S) sum of the sources, PreNorm's residual sum
    scaled by 1/S, which PreNorm's (scale-invariant) LayerNorms undo up to their eps: the model
    starts as PreNorm. Non-zero queries make it another model."""
    ours, task, _ = build(tiny_bin, TINY, *ATTNRES, *VARIANTS[variant], *FOUR_LAYERS, seed=4)
    pre, _, _ = build(tiny_bin, TINY, "--prenorm", *FOUR_LAYERS, seed=4)
    ours.eval(), pre.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        plain = pre(src, lengths, prev)[0]
        scale = plain.abs().max().item()
        assert (ours(src, lengths, prev)[0] - plain).abs().max().item() < 1e-3 * scale
        for name, p in ours.named_parameters():
            if name.endswith(".query"):
                p.normal_()
        assert (ours(src, lengths, prev)[0] - plain).abs().max().item() > 0.1 * scale


# ---- the equation written out, decoder with cross-attention -----------------------------------

def aggregate(aggregation, sources):
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i, written out."""
    if len(sources) == 1:
        return sources[0]
    v = torch.stack(sources)
    keys = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + KEY_NORM_EPS) * aggregation.key_norm_weight
    alpha = torch.softmax((keys * aggregation.query).sum(-1), dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0)


def equation_decoder(decoder, prev, enc, blocks_per_stack=None):
    """The decoder's output by the equation: each sublayer (self-attention, cross-attention, FFN)
    reads the aggregation of the sources (Full: every earlier output; Block: the completed block
    sums and the partial sum), then the output aggregation and the final norm. No dropout (eval)."""
    x = decoder.embed_scale * decoder.embed_tokens(prev) + decoder.embed_positions(prev)
    x = x.transpose(0, 1)
    length = x.size(0)
    mask = torch.triu(torch.full((length, length), float("-inf")), 1)
    layers = decoder.layers
    per_block = len(layers) // blocks_per_stack if blocks_per_stack else None
    completed, partial = [x], None
    for index, layer in enumerate(layers):
        if per_block and index > 0 and index % per_block == 0:
            completed, partial = [*completed, partial], None
        for kind, norm, sublayer in (
                ("attn", layer.self_attn_layer_norm,
                 lambda h: layer.self_attn(h, h, h, attn_mask=mask, need_weights=False)[0]),
                ("cross", layer.encoder_attn_layer_norm,
                 lambda h: layer.encoder_attn(h, enc, enc, static_kv=True, need_weights=False)[0]),
                ("ffn", layer.final_layer_norm, layer.feed_forward)):
            sources = completed + ([partial] if partial is not None else [])
            out = sublayer(norm(aggregate(layer.attention_residuals[kind] if len(sources) > 1 else None, sources)))
            if per_block:
                partial = out if partial is None else partial + out
            else:
                completed = [*completed, out]
    sources = completed + ([partial] if partial is not None else [])
    return decoder.layer_norm(aggregate(layers[-1].attention_residuals["final"], sources))


@pytest.mark.parametrize("variant", ["full", "block2", "block1"])
def test_the_decoder_with_cross_attention_is_the_equation(tiny_bin, variant):
    model, task, _ = build(tiny_bin, TINY, *ATTNRES, *VARIANTS[variant], *FOUR_LAYERS)
    randomized(model, seed=1).eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        ours, _ = model.decoder.extract_features(prev, encoder_out=encoder_out)
        blocks = int(VARIANTS[variant][1]) if VARIANTS[variant] else None
        theirs = equation_decoder(model.decoder, prev, encoder_out["encoder_out"][0], blocks)
    assert torch.allclose(ours, theirs.transpose(0, 1), atol=1e-5)


def test_weights_are_per_token_softmax_over_depth_and_uniform_at_init():
    torch.manual_seed(0)
    aggregation = DepthAttention(8)
    sources = [torch.randn(5, 3, 8) for _ in range(4)]
    uniform = aggregation.weights(sources)
    assert torch.allclose(uniform, torch.full_like(uniform, 0.25))
    assert torch.allclose(aggregation(sources), torch.stack(sources).mean(0), atol=1e-6)
    with torch.no_grad():
        aggregation.query.normal_()
    weights = aggregation.weights(sources)
    assert weights.shape == (4, 5, 3) and torch.allclose(weights.sum(0), torch.ones(5, 3))
    assert (weights.std(dim=(1, 2)) > 1e-3).all()  # the weights differ from position to position
    # a source scaled up does not dominate: the keys are RMS-normalised
    assert torch.allclose(weights, aggregation.weights([s * 10 for s in sources]), atol=1e-4)


# ---- structure ---------------------------------------------------------------------------------

def test_parameters_norms_and_stream_widths(tiny_bin):
    model, task, args = build(tiny_bin, TINY, *ATTNRES)
    assert args.attn_res_blocks is None
    names = {name for name, _ in model.named_parameters() if "attention_residuals" in name}
    expected = {"encoder.layers.0.attention_residuals.ffn", "encoder.layers.1.attention_residuals.attn",
                "encoder.layers.1.attention_residuals.ffn", "encoder.layers.1.attention_residuals.final"}
    expected |= {f"decoder.layers.0.attention_residuals.{k}" for k in ("cross", "ffn")}
    expected |= {f"decoder.layers.1.attention_residuals.{k}" for k in ("attn", "cross", "ffn", "final")}
    assert names == {f"{module}.{p}" for module in expected for p in ("query", "key_norm_weight")}
    # queries zero (uniform weights), key gains one
    assert all(p.eq(0).all() for name, p in model.named_parameters() if name.endswith(".query"))
    # the norms: PreNorm's, with a final norm per stack
    assert set(named_norms(model)) == ({f"enc{i}.{s}" for i in range(2) for s in ("attn", "ffn")}
                                       | {f"dec{i}.{s}" for i in range(2) for s in ("attn", "cross", "ffn")}
                                       | {"enc.final", "dec.final"})
    # the sources travel concatenated: encoder layer 0 returns [v_0; v_1; v_2], the last one d wide
    model.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        states = model.encoder(src, src_lengths=lengths, return_all_hiddens=True)["encoder_states"]
    assert [s.size(-1) for s in states] == [64, 3 * 64, 64]
    block, _, _ = build(tiny_bin, TINY, *ATTNRES, "--attn-res-blocks", "2", *FOUR_LAYERS)
    block.eval()
    with torch.no_grad():
        states = block.encoder(src, src_lengths=lengths, return_all_hiddens=True)["encoder_states"]
    # the embedding output, then [b_0; partial], [b_0; partial], [b_0; b_1; partial], the output
    assert [s.size(-1) for s in states] == [64, 128, 128, 192, 64]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_finite_incremental_equals_full_and_every_parameter_trains(tiny_bin, variant):
    flags = (*ATTNRES, *VARIANTS[variant], *FOUR_LAYERS)
    model, task, args = build(tiny_bin, TINY, *flags)
    assert_incremental_equals_full(model, task)
    fresh, task, args = build(tiny_bin, TINY, *flags)
    assert_training_steps_reach_every_parameter(fresh, task, args)


def test_every_parameter_gets_a_gradient_after_one_update(tiny_bin):
    """From init (zero queries: the key gains' gradient is w * ..., zero), one Adam update, then
    every parameter has a non-zero gradient."""
    model, task, _ = build(tiny_bin, TINY, *ATTNRES, "--dropout", "0")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    one_backward(model, task)
    optimizer.step()
    optimizer.zero_grad()
    grads = one_backward(model, task)
    missing = [name for name, grad in grads.items() if grad is None or not grad.abs().sum() > 0]
    assert not missing, missing


@pytest.mark.parametrize("variant", ["full", "block2"])
def test_checkpoint_activations_give_the_same_gradients(tiny_bin, variant):
    plain, task, _ = build(tiny_bin, TINY, *ATTNRES, *VARIANTS[variant], *FOUR_LAYERS, seed=7)
    randomized(plain, seed=2)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, *ATTNRES, *VARIANTS[variant], *FOUR_LAYERS, "--checkpoint-activations",
                          seed=7)
    randomized(wrapped, seed=2)
    grads = one_backward(wrapped, task)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name


@pytest.mark.parametrize("variant", ["full", "block2"])
def test_bf16_model_is_finite_and_close_to_float32(tiny_bin, variant):
    model, task, _ = build(tiny_bin, TINY, *ATTNRES, *VARIANTS[variant], *FOUR_LAYERS)
    assert_bf16_close_to_float32(model, task)


@pytest.mark.parametrize("norm_type", list(NORM_TYPES))
def test_composes_with_every_norm_type(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, *ATTNRES, "--attn-res-blocks", "1", *norm_type_flags(norm_type))
    assert_incremental_equals_full(model, task)
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize("flags", [["--value-residual"], ["--gated-attention"], ["--sigma-reparam"],
                                   ["--qknorm", "--qknorm-g0", "4"], ["--cross-self-attention"],
                                   ["--attn-res-blocks", "2", "--value-residual"]])
def test_composes_with_the_other_designs(tiny_bin, flags):
    model, task, _ = build(tiny_bin, TINY, *ATTNRES, *flags)
    assert_incremental_equals_full(model, task)
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


PLACEMENT = "--norm-placement attention-residuals"


@pytest.mark.parametrize("flags,message", [
    (["--residual-scale", "rezero"], f"--residual-scale rezero cannot be combined with {PLACEMENT}"),
    (["--residual-scale", "deepnorm"], f"--residual-scale deepnorm cannot be combined with {PLACEMENT}"),
    (["--weight-init", "tfixup", "--norm-type", "identity"],
     f"--weight-init tfixup cannot be combined with {PLACEMENT}"),
    (["--encoder-layerdrop", "0.1"], f"--encoder-layerdrop 0.1 cannot be combined with {PLACEMENT}"),
    (["--decoder-layers-to-keep", "0"], f"--decoder-layers-to-keep cannot be combined with {PLACEMENT}"),
    (["--attn-res-blocks", "3"], "--attn-res-blocks 3 does not divide the encoder's 2 layers; choose one of 1, 2"),
    (["--attn-res-blocks", "2", "--decoder-layers", "3"],
     "--attn-res-blocks 2 does not divide the decoder's 3 layers; choose one of 1, 3"),
    (["--no-decoder-final-norm"], f"--no-decoder-final-norm cannot be combined with {PLACEMENT}"),
    (["--denseformer"], f"--denseformer cannot be combined with {PLACEMENT}"),
    (["--normformer"], "--normformer needs the PreNorm placement"),
    (["--layernorm-scaling"], f"--layernorm-scaling cannot be combined with {PLACEMENT}"),
    (["--gpas"], "--gpas is defined on"),
    (["--ngpt"], f"--ngpt cannot be combined with {PLACEMENT}"),
])
def test_refusals_are_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *ATTNRES, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_blocks_need_the_placement(tiny_bin):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--prenorm", "--attn-res-blocks", "2")
    assert "--attn-res-blocks needs --norm-placement attention-residuals" in str(error.value)


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "nan"])
def test_blocks_must_be_a_positive_integer(tiny_bin, value):
    with pytest.raises((NormplugError, SystemExit)):
        build(tiny_bin, TINY, *ATTNRES, "--attn-res-blocks", value)


def test_the_design_file_imports_only_the_public_interface():
    test_the_2024_2026_designs_import_only_the_public_interface("models/placements/attention_residuals.py")


def test_fairseq_train_logs_norm_stats_saves_and_generates(tiny_bin, tmp_path):
    records, hypotheses, state = train_and_generate(tiny_bin, str(tmp_path), [*ATTNRES, "--attn-res-blocks", "2"])
    assert len(records) == 2 and all(math.isfinite(float(r["loss"])) for r in records)
    assert "in_std:dec1.cross" in records[-1]
    assert len(hypotheses) == 100
    assert "decoder.layers.1.attention_residuals.final.query" in state
    assert state["decoder.layers.1.attention_residuals.cross.query"].abs().sum() > 0  # trained off zero
