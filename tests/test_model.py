"""transformer_normplug built in-process: structure of every flag combination, init
statistics, FixNorm, equivalence with stock fairseq, and bad input."""
import itertools
import logging
import math

import pytest
import torch
from fairseq.modules import LayerNorm

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms, output_norm
from fairseq_normplug.modules.derf import Derf
from fairseq_normplug.modules.dyisru import DyISRU
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.fixnorm_embedding import FixNormEmbedding
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm
from model_helpers import assert_same_model, build, parse_args, toy_batch

LAYERNORM_CLASS = type(LayerNorm(4))
NORM_CLASSES = {"layernorm": LAYERNORM_CLASS, "scalenorm": ScaleNorm, "rmsnorm": RMSNorm,
                "dyt": DynamicTanh, "derf": Derf, "dyisru": DyISRU, "identity": IdentityNorm}
TINY = "transformer_normplug_tiny"


def norm_flags(prenorm, norm_type, fixnorm, init):
    flags = ["--prenorm"] if prenorm else []
    flags += ["--norm-type", norm_type]
    flags += ["--fixnorm"] if fixnorm else []
    flags += ["--weight-init", init]
    return flags


@pytest.mark.parametrize("prenorm,norm_type,fixnorm,init", list(itertools.product(
    [False, True], ["layernorm", "scalenorm", "rmsnorm", "dyt", "identity"], [False, True],
    ["fairseq", "xavier", "smallinit"])) + list(itertools.product(
    [False, True], ["derf", "dyisru"], [True], ["smallinit"])))
def test_every_combination_builds_with_the_right_modules(tiny_bin, prenorm, norm_type, fixnorm, init):
    model, task, _ = build(tiny_bin, TINY, *norm_flags(prenorm, norm_type, fixnorm, init))
    norms = named_norms(model)
    expected = {f"enc{i}.{s}" for i in range(2) for s in ("attn", "ffn")}
    expected |= {f"dec{i}.{s}" for i in range(2) for s in ("attn", "cross", "ffn")}
    if prenorm:  # final stack norms exist only with PreNorm
        expected |= {"enc.final", "dec.final"}
    assert set(norms) == expected
    assert all(type(norm) is NORM_CLASSES[norm_type] for norm in norms.values())
    assert (model.encoder.layer_norm is not None) == prenorm
    assert (model.decoder.layer_norm is not None) == prenorm
    assert model.encoder.layers[0].normalize_before == prenorm
    assert model.decoder.layers[1].normalize_before == prenorm
    assert isinstance(model.encoder.embed_tokens, FixNormEmbedding) == fixnorm
    assert isinstance(model.decoder.embed_tokens, FixNormEmbedding) == fixnorm
    src, lengths, prev = toy_batch(task)
    logits, _ = model(src, lengths, prev)
    assert logits.shape == (3, 7, len(task.target_dictionary))
    assert torch.isfinite(logits).all()


def test_fixed_g_freezes_all_but_the_output_norm(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--scalenorm", "--scalenorm-fixed-g", "--fixnorm")
    learnable = [name for name, norm in named_norms(model).items() if norm.g.requires_grad]
    assert learnable == ["dec.final"] and output_norm(model) is model.decoder.layer_norm
    for norm in named_norms(model).values():
        assert norm.g.item() == pytest.approx(math.sqrt(64))


def test_dyt_alpha_inits_by_block(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--dyt", "--prenorm", "--dyt-alpha-init", "0.2",
                        "--dyt-attn-alpha-init", "0.8", "--dyt-squash", "hardtanh", "--dyt-freeze-alpha")
    for name, norm in named_norms(model).items():
        attention_block = name.endswith(("attn", "cross"))
        assert norm.alpha.item() == pytest.approx(0.8 if attention_block else 0.2), name
        assert norm.squash == "hardtanh" and not norm.alpha.requires_grad


def test_dyt_no_alpha_is_the_papers_ablation(tiny_bin):
    """DyT paper, section 6, "removing alpha": squash(x), alpha fixed at 1 everywhere."""
    model, _, _ = build(tiny_bin, TINY, "--dyt", "--dyt-no-alpha")
    for norm in named_norms(model).values():
        assert norm.alpha.item() == 1.0 and not norm.alpha.requires_grad
    x = torch.randn(3, 64)
    torch.testing.assert_close(norm(x), torch.tanh(x))


def first_training_forward(model, task):
    """Run one training forward; return {norm name: its input} as the norms saw it."""
    seen, handles = {}, []
    for name, norm in named_norms(model).items():
        handles.append(norm.register_forward_pre_hook(
            lambda module, inputs, name=name: seen.__setitem__(name, inputs[0].detach().clone())))
    model.train()
    model(*toy_batch(task, batch=4, length=9))
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("flags,param,expected", [
    (["--dyt", "--dyt-alpha-init", "auto", "--dyt-attn-alpha-init", "0.8"], "alpha",
     lambda x: 1 / x.double().std(unbiased=False)),
    (["--norm-type", "derf", "--derf-alpha-init", "auto"], "alpha",
     lambda x: 1 / x.double().std(unbiased=False)),
    (["--norm-type", "dyisru", "--dyisru-beta-init", "auto"], "beta",
     lambda x: 63 * x.double().pow(2).mean()),
], ids=["dyt", "derf", "dyisru"])
def test_auto_init_from_the_first_training_batch(tiny_bin, flags, param, expected, caplog):
    model, task, _ = build(tiny_bin, TINY, "--prenorm", *flags)
    model.eval()  # evaluation forwards never initialise
    model(*toy_batch(task))
    assert model.auto_scale_init.waiting
    with caplog.at_level("INFO"):
        inputs = first_training_forward(model, task)
    assert not model.auto_scale_init.waiting
    for name, norm in named_norms(model).items():
        if name.endswith(("attn", "cross")) and "--dyt-attn-alpha-init" in flags:
            assert norm.alpha.item() == pytest.approx(0.8), name  # the fixed override
        else:  # each norm's own input, produced by the already initialised norms before it
            assert getattr(norm, param).item() == pytest.approx(expected(inputs[name]).item(), rel=1e-5), name
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto init of")]
    assert len(logged) == 1 and f"enc0.ffn={getattr(named_norms(model)['enc0.ffn'], param).item():.4g}" in logged[0]
    before = {name: getattr(norm, param).item() for name, norm in named_norms(model).items()}
    first_training_forward(model, task)  # once only
    assert before == {name: getattr(norm, param).item() for name, norm in named_norms(model).items()}


def norm_inputs(model, *batch):
    """{norm name: its input} of one training forward of ``model`` on ``batch``."""
    seen, handles = {}, []
    for name, norm in named_norms(model).items():
        handles.append(norm.register_forward_pre_hook(
            lambda module, inputs, name=name: seen.__setitem__(name, inputs[0].detach().clone())))
    model.train()
    model(*batch)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("flags,param,expected", [
    (["--dyt", "--dyt-alpha-init", "auto"], "alpha", lambda rows: 1 / rows.double().std(unbiased=False)),
    (["--norm-type", "dyisru", "--dyisru-beta-init", "auto"], "beta",
     lambda rows: 63 * rows.double().pow(2).mean()),
], ids=["dyt", "dyisru"])
def test_auto_init_ignores_padding(tiny_bin, flags, param, expected):
    """A padded batch (left-padded source, right-padded decoder input) gives every norm the
    value its sentences give unpadded: each sentence alone through the initialised model
    (dropout off) reproduces the real-token inputs the norms saw, and the values are the
    moments of exactly those rows."""
    model, task, _ = build(tiny_bin, TINY, "--prenorm", *flags, "--dropout", "0")
    pad = task.target_dictionary.pad()
    src, _, prev = toy_batch(task, batch=3, length=10)
    src_lengths, prev_lengths = [10, 3, 6], [10, 2, 5]
    for i, (n_src, n_prev) in enumerate(zip(src_lengths, prev_lengths)):
        src[i, :10 - n_src] = pad  # fairseq's left-padded source
        prev[i, n_prev:] = pad  # right-padded decoder input
    norm_inputs(model, src, torch.tensor(src_lengths), prev)  # the auto init happens here
    assert not model.auto_scale_init.waiting
    rows = {}
    for i, (n_src, n_prev) in enumerate(zip(src_lengths, prev_lengths)):
        alone = norm_inputs(model, src[i:i + 1, 10 - n_src:], torch.tensor([n_src]), prev[i:i + 1, :n_prev])
        for name, x in alone.items():
            rows.setdefault(name, []).append(x.reshape(-1, x.size(-1)))
    for name, norm in named_norms(model).items():
        value = expected(torch.cat(rows[name])).item()
        assert getattr(norm, param).item() == pytest.approx(value, rel=1e-4), name


def test_frozen_alpha_stays_at_the_auto_value(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--dyt", "--dyt-alpha-init", "auto", "--dyt-freeze-alpha")
    inputs = first_training_forward(model, task)
    for name, norm in named_norms(model).items():
        assert not norm.alpha.requires_grad
        assert norm.alpha.item() == pytest.approx(1 / inputs[name].double().std(unbiased=False).item(), rel=1e-5)


def test_auto_init_skipped_after_loading_a_state_dict(tiny_bin):
    trained, task, _ = build(tiny_bin, TINY, "--dyt", "--dyt-alpha-init", "auto", seed=1)
    with torch.no_grad():
        for norm in named_norms(trained).values():
            norm.alpha.fill_(0.123)
    model, _, _ = build(tiny_bin, TINY, "--dyt", "--dyt-alpha-init", "auto", seed=2)
    model.load_state_dict(trained.state_dict())
    first_training_forward(model, task)
    assert all(norm.alpha.item() == pytest.approx(0.123) for norm in named_norms(model).values())


def weights(model, names):
    return [p for n, p in model.named_parameters() if n.split(".")[-2] in names and n.endswith("weight")]


@pytest.mark.parametrize("init,attn_std,ffn_std", [
    ("smallinit", math.sqrt(2 / (5 * 256)), math.sqrt(2 / (256 + 1024))),
    ("xavier", math.sqrt(1 / 256), math.sqrt(2 / (256 + 1024))),
    # fairseq's own: q/k/v Xavier-uniform gain 1/sqrt(2); fc1 kaiming-uniform(a=sqrt(5))
    ("fairseq", math.sqrt(1 / 256) / math.sqrt(2), 1 / math.sqrt(3 * 256)),
])
def test_init_statistics(tiny_bin, init, attn_std, ffn_std):
    model, _, _ = build(tiny_bin, "transformer_normplug_cpu", "--weight-init", init)
    for p in weights(model, ("q_proj", "k_proj", "v_proj")):
        assert p.std().item() == pytest.approx(attn_std, rel=0.03)
        assert p.mean().abs().item() < 0.1 * attn_std
    assert model.encoder.layers[0].fc1.weight.std().item() == pytest.approx(ffn_std, rel=0.03)
    biases = [model.encoder.layers[0].self_attn.q_proj.bias, model.decoder.layers[2].fc2.bias]
    assert all(b.abs().max() == 0 for b in biases) == (init != "fairseq")
    if init != "fairseq":
        for p in weights(model, ("out_proj",)):
            assert p.std().item() == pytest.approx(attn_std, rel=0.03)


@pytest.mark.parametrize("fixnorm", [False, True])
def test_embedding_init(tiny_bin, fixnorm):
    model, _, _ = build(tiny_bin, "transformer_normplug_cpu", *(["--fixnorm"] if fixnorm else []))
    w = model.encoder.embed_tokens.weight.detach()[4:]
    if fixnorm:  # U(-0.01, 0.01)
        assert w.abs().max() <= 0.01 and w.std().item() == pytest.approx(0.01 / math.sqrt(3), rel=0.05)
    else:  # N(0, d^-0.5)
        assert w.std().item() == pytest.approx(256 ** -0.5, rel=0.05)


def fixnorm_model(tiny_bin):
    return build(tiny_bin, TINY, "--prenorm", "--scalenorm", "--fixnorm", "--smallinit")


def test_fixnorm_rows_have_unit_norm_and_pad_is_zero(tiny_bin):
    model, task, _ = fixnorm_model(tiny_bin)
    rows = model.decoder.embed_tokens.normalized_weight()
    pad = task.target_dictionary.pad()
    norms = rows.norm(dim=1)
    assert norms[pad].item() == 0
    torch.testing.assert_close(torch.cat([norms[:pad], norms[pad + 1:]]), torch.ones(len(rows) - 1))
    # the tied output layer uses the same normalised rows: logits are scaled cosines
    features = torch.randn(5, 64)
    expected = features @ rows.t()
    logits = model.decoder.output_layer(features)
    non_pad = [i for i in range(len(rows)) if i != pad]
    torch.testing.assert_close(logits[:, non_pad], expected[:, non_pad])


def test_fixnorm_gradient_is_finite_with_pad_present(tiny_bin):
    model, task, _ = fixnorm_model(tiny_bin)
    pad = task.target_dictionary.pad()
    src, lengths, prev = toy_batch(task)
    src[0, :3], prev[1, -2:] = pad, pad  # padding inside the batch
    logits, _ = model(src, lengths, prev)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), src.view(-1), ignore_index=pad)
    loss.backward()
    grad = model.encoder.embed_tokens.weight.grad
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert grad[pad].abs().max() == 0
    assert torch.isfinite(total) and total < 100, total


def test_the_pad_row_has_no_gradient_where_naive_fixnorm_blows_up():
    """Why the pad row is masked: on the same weights (a zero pad row), plain w/max(||w||, eps)
    gives the pad row a gradient of ~1/eps; FixNormEmbedding's has none, and its other rows
    get exactly the plain formula's gradient."""
    embedding = FixNormEmbedding(3, 8, padding_idx=0)
    with torch.no_grad():
        embedding.weight.zero_()
        embedding.weight[1:] = torch.rand(2, 8) * 0.01
    upstream = torch.randn(3, 8)  # a gradient reaching every row, pad included
    (embedding.normalized_weight() * upstream).sum().backward()
    w = embedding.weight.detach().clone().requires_grad_(True)
    naive = w / w.norm(dim=1, keepdim=True).clamp(min=embedding.eps)
    (naive * upstream).sum().backward()
    assert w.grad[0].abs().max() > 1e5  # 1/eps = 1e6 times the upstream gradient
    assert embedding.weight.grad[0].abs().max() == 0
    torch.testing.assert_close(embedding.weight.grad[1:], w.grad[1:])


def test_pad_is_never_predicted(tiny_bin):
    model, task, _ = fixnorm_model(tiny_bin)
    model.eval()
    pad = task.target_dictionary.pad()
    src, lengths, prev = toy_batch(task, batch=8, length=9)
    logits, _ = model(src, lengths, prev)
    lprobs = model.get_normalized_probs((logits, None), log_probs=True)
    assert (logits.argmax(-1) != pad).all()
    others = torch.cat([logits[..., :pad], logits[..., pad + 1:]], dim=-1)
    assert (logits[..., pad] < others.amin(-1) - 29).all()
    assert (lprobs[..., pad] < -25).all() and torch.isfinite(lprobs).all()


@pytest.mark.parametrize("arch,stock_arch,extra", [
    ("transformer_normplug", "transformer",
     ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48", "--encoder-layers", "2",
      "--decoder-layers", "2", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]),
    ("transformer_normplug", "transformer",
     ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48", "--encoder-layers", "1",
      "--decoder-layers", "1", "--encoder-normalize-before", "--decoder-normalize-before",
      "--share-all-embeddings"]),
])
def test_flags_off_equals_stock_transformer(tiny_bin, arch, stock_arch, extra):
    ours, task, _ = build(tiny_bin, arch, *extra, seed=3)
    stock, _, _ = build(tiny_bin, stock_arch, *extra, seed=3)
    assert type(ours).__mro__[1] is type(stock)
    assert_same_model(ours, stock, task)


def test_stock_state_dict_loads_strictly(tiny_bin):
    stock, task, _ = build(tiny_bin, "transformer_tiny", seed=5)
    ours, _, _ = build(tiny_bin, "transformer_normplug", "--encoder-embed-dim", "64",
                       "--encoder-ffn-embed-dim", "64", "--encoder-layers", "2", "--decoder-layers", "2",
                       "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", seed=6)
    ours.load_state_dict(stock.state_dict(), strict=True)
    ours.eval(), stock.eval()
    src, lengths, prev = toy_batch(task)
    assert torch.equal(ours(src, lengths, prev)[0], stock(src, lengths, prev)[0])


BAD_INPUT = [
    (["--scalenorm", "--dyt"], "--scalenorm and --dyt"),
    (["--norm-type", "rmsnorm", "--scalenorm"], "--norm-type rmsnorm and --scalenorm"),
    (["--prenorm", "--postnorm"], "--prenorm contradicts --postnorm"),
    (["--postnorm", "--encoder-normalize-before"], "--postnorm contradicts --encoder-normalize-before"),
    (["--scalenorm", "--norm-eps", "0"], "--norm-eps must be > 0, got 0.0"),
    (["--dyt", "--dyt-alpha-init", "-0.5"], "--dyt-alpha-init must be > 0, got -0.5"),
    (["--dyt", "--dyt-attn-alpha-init", "0"], "--dyt-attn-alpha-init must be > 0, got 0.0"),
    (["--dyt-alpha-init", "0.5"], "--dyt-alpha-init needs --norm-type dyt"),
    (["--dyt-alpha-init", "auto"], "--dyt-alpha-init needs --norm-type dyt (or --dyt), got --norm-type layernorm"),
    (["--norm-type", "derf", "--dyt-alpha-init", "auto"], "--dyt-alpha-init needs --norm-type dyt"),
    (["--dyt", "--derf-alpha-init", "auto"], "--derf-alpha-init needs --norm-type derf, got --norm-type dyt"),
    (["--rmsnorm", "--dyisru-beta-init", "9"], "--dyisru-beta-init needs --norm-type dyisru"),
    (["--norm-type", "derf", "--derf-alpha-init", "0"], "--derf-alpha-init must be > 0, got 0.0"),
    (["--norm-type", "dyisru", "--dyisru-beta-init", "-1"], "--dyisru-beta-init must be > 0, got -1.0"),
    (["--dyt", "--dyt-no-alpha", "--dyt-alpha-init", "auto"], "--dyt-no-alpha fixes alpha at 1; it contradicts --dyt-alpha-init auto"),
    (["--dyt-no-alpha"], "--dyt-no-alpha needs --norm-type dyt"),
    (["--dyt", "--dyt-attn-alpha-init", "auto", "--fp16"],
     "--dyt-attn-alpha-init auto cannot be combined with --fp16 (its fp32 master weights"),
    (["--scalenorm-fixed-g"], "--scalenorm-fixed-g needs --norm-type scalenorm (or --scalenorm), got --norm-type layernorm"),
    (["--smallinit", "--weight-init", "xavier"], "--smallinit contradicts --weight-init xavier"),
    (["--norm-stats-interval", "-1"], "--norm-stats-interval must be >= 0, got -1"),
]


@pytest.mark.parametrize("flags,message", BAD_INPUT, ids=[" ".join(f) for f, _ in BAD_INPUT])
def test_bad_input_is_rejected_at_argument_time(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


SMALL_BASE = ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "32", "--encoder-layers", "1",
              "--decoder-layers", "1", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


def test_fixnorm_alone_ties_the_output_layer_and_says_so_once(tiny_bin, caplog):
    """transformer_normplug leaves the output layer untied; --fixnorm ties it (one log line)."""
    untied, _, _ = build(tiny_bin, "transformer_normplug", *SMALL_BASE)
    assert untied.decoder.output_projection.weight is not untied.decoder.embed_tokens.weight
    with caplog.at_level(logging.INFO, logger="fairseq_normplug"):
        model, _, args = build(tiny_bin, "transformer_normplug", *SMALL_BASE, "--fixnorm")
    assert args.share_decoder_input_output_embed is True
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert isinstance(model.decoder.embed_tokens, FixNormEmbedding)
    said = [r.getMessage() for r in caplog.records if "--fixnorm: tying the output layer" in r.getMessage()]
    assert len(said) == 1, said


def test_fixnorm_with_a_tie_already_asked_for_says_nothing(tiny_bin, caplog):
    with caplog.at_level(logging.INFO, logger="fairseq_normplug"):
        args = parse_args(tiny_bin, "transformer_normplug_wmt_en_de", "--fixnorm")
    assert args.share_all_embeddings and not args.share_decoder_input_output_embed
    assert not [r for r in caplog.records if "--fixnorm" in r.getMessage()]


def sharing_options():
    """fairseq's options about sharing embeddings, as the plugin's model declares them."""
    import argparse

    from fairseq_normplug.models import TransformerNormplugModel

    parser = argparse.ArgumentParser()
    TransformerNormplugModel.add_args(parser)
    return [action for action in parser._actions if "share" in action.dest]


@pytest.mark.parametrize("sharing", [[], ["--share-decoder-input-output-embed"], ["--share-all-embeddings"]])
def test_fixnorm_ties_the_output_layer_whatever_sharing_is_asked(tiny_bin, sharing):
    """--fixnorm never refuses a sharing request, because fairseq has none that unties: each of
    its sharing options is a plain on-switch (if fairseq gains an untie option, --fixnorm must
    refuse it instead of tying). Under each, the output layer is the FixNorm target embedding."""
    options = sharing_options()
    assert {"share_decoder_input_output_embed", "share_all_embeddings"} <= {a.dest for a in options}
    for action in options:
        assert action.nargs == 0 and action.const is True and action.default in (None, False), action
        assert not [o for o in action.option_strings if o.startswith("--no-")], action
    model, _, _ = build(tiny_bin, "transformer_normplug", *SMALL_BASE, "--fixnorm", *sharing)
    decoder = model.decoder
    assert isinstance(decoder.embed_tokens, FixNormEmbedding)
    assert decoder.output_projection.weight is decoder.embed_tokens.weight
    features = torch.randn(2, 32)
    torch.testing.assert_close(decoder.output_layer(features)[:, 4:],
                               (features @ decoder.embed_tokens.normalized_weight().t())[:, 4:])
    shared_source = model.encoder.embed_tokens.weight is decoder.embed_tokens.weight
    assert shared_source == (sharing == ["--share-all-embeddings"])


@pytest.mark.parametrize("flags", [["--norm-type", "batchnorm"], ["--weight-init", "he"],
                                   ["--dyt", "--dyt-squash", "relu"]])
def test_unknown_choices_are_argparse_errors(tiny_bin, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(tiny_bin, TINY, *flags)
    assert exit_info.value.code == 2
    assert f"invalid choice: '{flags[-1]}'" in capsys.readouterr().err


@pytest.mark.parametrize("precision", [["--amp"], ["--fp16", "--memory-efficient-fp16"]])
def test_auto_init_with_precisions_that_keep_no_master_copy(tiny_bin, precision):
    """Accepted (no fp32 master copy to go stale), and the init happens in that precision:
    each alpha (a float32 scalar) is 1/std of its norm's input on the first training batch."""
    model, task, args = build(tiny_bin, TINY, "--prenorm", "--norm-type", "derf", "--derf-alpha-init", "auto",
                              *precision)
    assert args.derf_alpha_init == "auto" and model.auto_scale_init.waiting
    if args.memory_efficient_fp16:
        model = model.half()  # what fairseq's trainer does before the first batch
    inputs = first_training_forward(model, task)
    assert not model.auto_scale_init.waiting
    for name, norm in named_norms(model).items():
        assert norm.alpha.dtype == torch.float32
        if args.memory_efficient_fp16:
            assert inputs[name].dtype == torch.float16
        expected = 1 / inputs[name].double().std(unbiased=False).item()
        assert norm.alpha.item() == pytest.approx(expected, rel=1e-5) and norm.alpha.item() != 0.5, name


def test_scale_init_is_a_number_or_auto(tiny_bin, capsys):
    with pytest.raises(SystemExit):
        parse_args(tiny_bin, TINY, "--dyt", "--dyt-alpha-init", "automatic")
    assert "expected a number or 'auto', got 'automatic'" in capsys.readouterr().err


def test_share_all_embeddings_needs_a_joined_dictionary(tiny_raw, tmp_path):
    from inprocess import run_fairseq

    dest = str(tmp_path / "separate")
    run_fairseq(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
                 "--trainpref", f"{tiny_raw}/train", "--validpref", f"{tiny_raw}/valid",
                 "--destdir", dest, "--workers", "1"])
    with pytest.raises(NormplugError, match="--share-all-embeddings needs a joined dictionary.*"
                                            "--share-decoder-input-output-embed"):
        build(dest, "transformer_normplug_wmt_en_de", "--fixnorm")
