"""The ``layernorm-fixed-std`` norm and the folding of ``convert_norms.sh --to none``
(diagnostics/remove_norms.py) on untrained tiny models; the conversion of a trained checkpoint
is tested in test_diagnostics.py, on its trained fixture."""
import pytest
import torch
from torch import nn

from model_helpers import assert_incremental_matches_full, build, parse_args, randomized, toy_batch
from fairseq_normplug.diagnostics import remove_norms
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.modules.fixed_std_layer_norm import FixedStdLayerNorm
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.norm_registry import NormSlot, build_norm, norm_args

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers


def random_layer_norm(dim=16, seed=0):
    layer_norm = nn.LayerNorm(dim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer_norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
        layer_norm.bias.copy_(torch.randn(dim, generator=g))
    return layer_norm


def test_fixed_std_norm_is_layer_norm_until_its_update_then_uses_c():
    layer_norm = random_layer_norm()
    x = 3 * torch.randn(5, 16, generator=torch.Generator().manual_seed(1)) + 2
    norm = FixedStdLayerNorm.from_layer_norm(layer_norm, layer_norm.weight, fixed_std=2.5, removal_update=3)
    assert torch.equal(norm(x), layer_norm(x))
    norm.set_num_updates(2)
    assert torch.equal(norm(x), layer_norm(x)) and not bool(norm.removed)
    norm.set_num_updates(3)
    expected = (x - x.mean(-1, keepdim=True)) / 2.5 * layer_norm.weight + layer_norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=0, atol=1e-6)
    reloaded = FixedStdLayerNorm(16)
    reloaded.load_state_dict(norm.state_dict())  # decodes with c without a trainer
    torch.testing.assert_close(reloaded(x), expected, rtol=0, atol=1e-6)
    assert reloaded.half().fixed_std.dtype == torch.float32


def test_fixed_std_norm_equals_layer_norm_when_c_is_the_rows_std():
    layer_norm = random_layer_norm()
    row = 4 * torch.randn(1, 16, generator=torch.Generator().manual_seed(2)) - 1
    c = float((row.var(-1, unbiased=False) + layer_norm.eps).sqrt())
    norm = FixedStdLayerNorm.from_layer_norm(layer_norm, layer_norm.weight, fixed_std=c)
    torch.testing.assert_close(norm(row), layer_norm(row), rtol=0, atol=1e-5)
    assert not torch.allclose(norm(2 * row), layer_norm(2 * row), atol=1e-2)  # c is fixed, the std is not


def test_default_buffers_make_it_layer_norm_and_folded_sites_identity(tiny_bin):
    args = norm_args("layernorm-fixed-std")
    assert not build_norm(args, 8, NormSlot(name="enc0.attn")).uses_fixed_std
    args = norm_args("layernorm-fixed-std", fixed_std_folded=True, norm_placement="pre")
    for name, kind in (("enc0.attn", IdentityNorm), ("dec1.cross", IdentityNorm), ("enc.final", IdentityNorm),
                       ("dec.final", FixedStdLayerNorm), ("enc.embed", FixedStdLayerNorm)):
        assert type(build_norm(args, 8, NormSlot(name=name))) is kind, name
    # refused where the placement is resolved (its capabilities): fairseq's mixed model too
    for placement in (["--postnorm"], ["--encoder-normalize-before"]):
        with pytest.raises(NormplugError, match="^--fixed-std-folded needs PreNorm .*got --"):
            parse_args(tiny_bin, TINY, "--norm-type", "layernorm-fixed-std", "--fixed-std-folded", *placement)
    parse_args(tiny_bin, TINY, "--norm-type", "layernorm-fixed-std", "--fixed-std-folded", "--prenorm")


def test_removal_order_is_ffn_norms_then_attention_norms_then_stack_norms():
    forward = ["enc0.attn", "enc0.ffn", "enc1.attn", "enc1.ffn", "enc.final", "dec0.attn", "dec0.cross",
               "dec0.ffn", "dec.final"]
    order = remove_norms.removal_order(forward)
    assert order == ["enc0.ffn", "enc1.ffn", "dec0.ffn", "enc0.attn", "enc1.attn", "dec0.attn", "dec0.cross",
                     "enc.final", "dec.final"]
    assert list(remove_norms.removal_schedule(order, 5, 3).values()) == [5, 8, 11, 14, 17, 20, 23, 26, 29]


def test_folded_prenorm_model_equals_the_fixed_std_model(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--prenorm")
    randomized(model)
    stds = {name: 0.5 + 0.3 * index for index, name in enumerate(named_norms(model))}
    fixed = remove_norms.fixed_std_model(model, stds).double().eval()  # float64: the fold is exact
    assert remove_norms.foldable(fixed) is None
    folded = remove_norms.fold(fixed)
    kinds = {name: type(norm).__name__ for name, norm in named_norms(folded).items()}
    assert kinds.pop("dec.final") == "FixedStdLayerNorm" and set(kinds.values()) == {"IdentityNorm"}
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():  # (float32 rounding alone gives ~1e-4 on these logits of magnitude ~30)
        expected = fixed(src, lengths, prev)[0]
        torch.testing.assert_close(folded(src, lengths, prev)[0], expected, rtol=0, atol=1e-5)
    assert remove_norms.relative_output_difference(fixed, folded, [{"net_input": {
        "src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}}]) < 1e-12
    # the stored configuration rebuilds the folded model: same keys, same outputs, incremental = full
    rebuilt, _, _ = build(tiny_bin, TINY, "--prenorm", "--norm-type", "layernorm-fixed-std", "--fixed-std-folded")
    rebuilt.double().load_state_dict(folded.state_dict(), strict=True)
    rebuilt.eval()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(src, lengths, prev)[0], expected, rtol=0, atol=1e-5)
    assert_incremental_matches_full(rebuilt, task)


def test_postnorm_is_not_folded(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--postnorm")
    fixed = remove_norms.fixed_std_model(model, {name: 1.0 for name in named_norms(model)})
    assert remove_norms.foldable(fixed) == "not PreNorm: each norm's output is the residual stream"


def test_a_model_with_norm_statistics_copies_after_its_norms_are_replaced(tiny_bin):
    """A trained model logs norm statistics (--norm-stats-interval > 0, as every recipe does):
    replacing its norms (the fold of --to none) and copying the result again must work."""
    import copy
    from fairseq_normplug.diagnostics import convert

    model, _, _ = build(tiny_bin, "transformer_normplug_tiny", "--prenorm", "--norm-stats-interval", "5")
    replaced = convert.replace_norms(model, lambda name, norm: IdentityNorm(norm.weight.shape[0]))
    again = copy.deepcopy(replaced)
    assert all(isinstance(norm, IdentityNorm) for norm in named_norms(again).values())
