"""--ngpt (nGPT, Loshchilov et al. 2025): unit hidden states after every layer, unit weight rows
after the build and after optimizer steps (the fp32 masters of --fp16/--bf16 too), one
decoder layer against a direct implementation of the authors' formulas, incremental decoding,
24 updates of fairseq-train in-process: normalised checkpoints, a bit-identical resume, decoding;
refusals."""
import math
import os
import shutil
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils
from fairseq.logging import metrics
from fairseq.optim.fp16_optimizer import FP16Optimizer

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placements.ngpt import normalize_matrices
from model_helpers import assert_incremental_matches_full, build, parse_args, randomized, toy_batch
from test_placements import one_backward
from test_resume import train_in_process

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers
TASK = "translation_normplug"
#: every matrix normalised, and the dimension (of size d) its vectors run along (train.py:394-408)
LAYER_MATRICES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "out_proj": 0, "fc1": 1, "fc2": 0}


def ngpt(tiny_bin, *flags, seed=1):
    model, task, _ = build(tiny_bin, TINY, "--ngpt", *flags, seed=seed, task=TASK)
    return model, task


def matrices(state):
    """{name: (weight, dim)} of every matrix nGPT keeps on the unit sphere, from a state dict."""
    found = {}
    for name, weight in state.items():
        leaf = name.split(".")[-2] if name.endswith(".weight") else None
        if leaf in LAYER_MATRICES:
            found[name] = (weight, LAYER_MATRICES[leaf])
        elif leaf in ("embed_tokens", "output_projection"):
            found[name] = (weight[4:], 1)  # fairseq's 4 special symbols first: the padding row is zero
    return found


def assert_unit_matrices(state, atol=1e-5):
    found = matrices(state)
    assert len(found) == 2 * 6 + 2 * 10 + 3  # enc layers, dec layers (cross too), 2 embeddings, output (tied)
    for name, (weight, dim) in found.items():
        norms = weight.float().norm(dim=dim)
        assert torch.allclose(norms, torch.ones_like(norms), atol=atol), name


def test_build_unit_rows_no_norms_no_biases(tiny_bin):
    model, _ = ngpt(tiny_bin)
    assert_unit_matrices(model.state_dict())
    assert named_norms(model) == {}
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert not [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    layer = model.decoder.layers[0]
    assert (layer.alpha_attn * math.sqrt(64)).tolist() == pytest.approx([1.0] * 64)  # stored 1/sqrt(d)
    assert layer.self_attn.q_proj.sqk is layer.self_attn.k_proj.sqk  # one sqk per attention
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight  # tied, as fairseq's


def test_hidden_states_have_unit_norm_after_every_layer(tiny_bin):
    model, task = ngpt(tiny_bin)
    outputs = []
    for layer in (*model.encoder.layers, *model.decoder.layers):
        layer.register_forward_hook(lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    src, lengths, prev = toy_batch(task)
    model.train()  # dropout on: the update still ends on the sphere
    logits = model(src, lengths, prev)[0]
    assert len(outputs) == 4 and torch.isfinite(logits).all()
    for out in outputs:
        assert torch.allclose(out.norm(dim=-1), torch.ones(out.shape[:-1]), atol=1e-5)


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def direct_attention(attn, query, key, mask=None):
    """model.py:115-140: sqk Norm(q) . sqk Norm(k) per head, softmax scale sqrt(d_k), no biases."""
    heads, d = attn.num_heads, query.size(-1)
    sqk = (attn.q_proj.sqk * math.sqrt(d)).view(heads, -1)  # stored 1/sqrt(d): effective sqk * sqrt(d)
    q = unit((query @ attn.q_proj.weight.T).unflatten(-1, (heads, -1))) * sqk
    k = unit((key @ attn.k_proj.weight.T).unflatten(-1, (heads, -1))) * sqk
    v = (key @ attn.v_proj.weight.T).unflatten(-1, (heads, -1))
    scores = torch.einsum("tbhd,sbhd->bhts", q, k) * math.sqrt(d // heads)
    if mask is not None:
        scores = scores + mask
    out = torch.einsum("bhts,sbhd->tbhd", torch.softmax(scores, dim=-1), v).flatten(-2)
    return out @ attn.out_proj.weight.T


def test_decoder_layer_against_the_authors_formulas(tiny_bin):
    """h <- Norm(A + |alpha| (Norm(F(A)) - A)), A = Norm(h) (model.py:145-153), for self-attention,
    cross-attention and the FFN with fc1's output times suv sqrt(d) (model.py:160)."""
    model, _ = ngpt(tiny_bin)
    randomized(model, seed=3)  # alphas, sqk, suv away from their inits; rows off the sphere
    model.eval()
    layer = model.decoder.layers[1]
    x, enc = torch.randn(5, 3, 64), unit(torch.randn(7, 3, 64))
    mask = torch.triu(torch.full((5, 5), float("-inf")), 1)

    def update(h, alpha, f):
        a = unit(h)
        return unit(a + (alpha * 0.05 * math.sqrt(64)).abs() * (unit(f(a)) - a))

    def ffn(h):
        return F.relu((h @ layer.fc1.weight.T) * layer.fc1.suv * math.sqrt(64)) @ layer.fc2.weight.T

    with torch.no_grad():
        h = update(x, layer.alpha_attn, lambda a: direct_attention(layer.self_attn, a, a, mask))
        h = update(h, layer.alpha_cross, lambda a: direct_attention(layer.encoder_attn, a, enc))
        expected = update(h, layer.alpha_ffn, ffn)
        ours = layer(x, enc, None, self_attn_mask=mask)[0]
    assert torch.allclose(ours, expected, atol=1e-5)
    # the logits: sz times the output projection (model.py:284)
    sz = model.decoder.output_projection.sz * math.sqrt(64)
    with torch.no_grad():
        assert torch.allclose(model.decoder.output_layer(expected),
                              (expected @ model.decoder.embed_tokens.weight.T) * sz, atol=1e-5)


def test_incremental_decoding_equals_the_full_forward(tiny_bin):
    model, task = ngpt(tiny_bin)
    assert_incremental_matches_full(model, task)


def test_every_parameter_trains_and_checkpoint_activations_agree(tiny_bin):
    """alphas, sqk, suv, sz and every matrix get finite gradients; fairseq's
    --checkpoint-activations wraps nGPT's layers with the same gradients."""
    model, task = ngpt(tiny_bin, seed=7)
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())
    assert {"decoder.layers.0.alpha_cross", "decoder.layers.0.encoder_attn.k_proj.sqk", "encoder.layers.1.fc1.suv",
            "decoder.output_projection.sz"} <= set(grads)
    wrapped, _ = ngpt(tiny_bin, "--checkpoint-activations", seed=7)
    assert all(hasattr(layer, "precheckpoint_forward") for layer in wrapped.encoder.layers)
    for name, grad in one_backward(wrapped, task).items():
        assert torch.allclose(grad, grads[name], atol=1e-6), name


def test_norm_stats_interval_logs_the_eigen_learning_rates_and_scales(tiny_bin):
    """--norm-stats-interval N: every N training updates, the effective alphas, sqk, suv and sz
    (their inits 0.05, 1, 1, 1); nothing on other updates or in eval mode."""
    model, task = ngpt(tiny_bin, "--norm-stats-interval", "5")
    src, lengths, prev = toy_batch(task)
    model.train()
    logged = {}
    for update, training in ((10, True), (11, True), (10, False)):
        model.set_num_updates(update)
        model.train(training)
        with metrics.aggregate(new_root=True) as agg:
            model(src, lengths, prev)
        logged[update, training] = agg.get_smoothed_values()
    assert not logged[11, True] and not logged[10, False]
    values = logged[10, True]
    assert len(values) == 2 * 4 + 2 * 6 + 1  # encoder layer: alpha, sqk (attn), alpha, suv (ffn); decoder: + cross; sz
    assert values["ngpt_alpha:dec1.cross"] == values["ngpt_alpha:enc0.ffn"] == pytest.approx(0.05)
    assert values["sqk:enc1.attn"] == values["suv:dec0.ffn"] == values["sz:dec"] == pytest.approx(1.0)


def test_bf16_forward_is_finite_and_near_fp32(tiny_bin):
    model, task = ngpt(tiny_bin)
    model.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        full = model(src, lengths, prev)[0]
        half = model.bfloat16()(src, lengths, prev)[0].float()
    assert torch.isfinite(half).all() and (half - full).abs().max() < 0.1


@pytest.mark.parametrize("flatten", [True, False])
def test_renormalising_reaches_the_fp32_masters(tiny_bin, monkeypatch, flatten):
    """fairseq's FP16Optimizer (--fp16/--bf16) steps float32 masters and copies them into the
    model: the masters are normalised, at the offsets fairseq's own copy uses."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # a CPU tensor's device index
    model, _ = ngpt(tiny_bin)
    model.bfloat16()
    params = list(model.parameters())
    optimizer = FP16Optimizer.__new__(FP16Optimizer)  # just the two parameter lists that map them
    optimizer.fp16_params = params
    optimizer.fp32_params = FP16Optimizer.build_fp32_params(Namespace(), params, flatten=flatten)
    masters = list(optimizer.fp32_params.values()) if flatten else optimizer.fp32_params
    with torch.no_grad():
        for master in masters:
            master.mul_(1.5)  # an optimizer step moved every weight off the sphere
    normalize_matrices(model, optimizer)
    assert_unit_matrices(model.state_dict(), atol=1e-2)  # bfloat16 rounding
    optimizer._sync_fp32_params_to_fp16()  # fairseq's own copy after its next step
    assert_unit_matrices(model.state_dict(), atol=1e-2)
    sqk = model.encoder.layers[0].self_attn.q_proj.sqk.float()
    assert torch.allclose(sqk, torch.full_like(sqk, 1.5 / 8), atol=1e-3)  # scalars are not normalised


#: the TED recipe's output layer and criterion, without warmup (6 updates an epoch)
RECIPE = ["--ngpt", "--lr-scheduler", "fixed", "--output-bias", "--target-vocab-mask",
          "--criterion", "masked_label_smoothed_cross_entropy", "--norm-stats-interval", "5"]


@pytest.mark.slow  # trains for more than about 10 s
def test_24_updates_normalised_checkpoint_bit_identical_resume_and_decoding(tiny_bin, tmp_path):
    """fairseq-train in-process (dropout 0.3, word dropout, --update-freq 2): finite losses; the
    checkpoint saved right after a step holds unit rows; resuming from the epoch-2 checkpoint
    reproduces updates 13-24 bit for bit (losses and parameters); the checkpoint decodes."""
    save_dir = str(tmp_path / "run")
    records = train_in_process(tiny_bin, save_dir, *RECIPE, "--max-epoch", "4")
    assert [r[0] for r in records] == list(range(1, 25))
    assert all(math.isfinite(loss) for r in records for loss in r[1])
    for name in ("checkpoint2.pt", "checkpoint_last.pt"):
        assert_unit_matrices(torch.load(os.path.join(save_dir, name), map_location="cpu", weights_only=False)["model"])
    os.makedirs(tmp_path / "resumed")
    shutil.copyfile(os.path.join(save_dir, "checkpoint2.pt"), tmp_path / "resumed" / "checkpoint_last.pt")
    resumed = train_in_process(tiny_bin, str(tmp_path / "resumed"), *RECIPE, "--max-epoch", "4",
                               "--no-epoch-checkpoints")
    assert resumed == records[12:]
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint])
    assert model.decoder.layers[0].alpha_ffn.abs().sum() != 64 / math.sqrt(64)  # trained
    assert model.decoder.output_projection.bias.abs().sum() > 0
    model.eval()
    task.load_dataset("test")
    dataset = task.dataset("test")
    sample = dataset.collater([dataset[i] for i in range(4)])
    generator = task.build_generator([model], Namespace(beam=2, max_len_a=1, max_len_b=5))
    hypotheses = task.inference_step(generator, [model], sample)
    assert len(hypotheses) == 4 and all(len(h[0]["tokens"]) > 0 and math.isfinite(h[0]["score"]) for h in hypotheses)


@pytest.mark.parametrize("flags,message", [
    (["--prenorm"], "--ngpt cannot be combined with --norm-placement pre"),
    (["--norm-placement", "sandwich"], "--ngpt cannot be combined with --norm-placement sandwich"),
    (["--rmsnorm"], "--ngpt cannot be combined with --norm-type rmsnorm"),
    (["--fixnorm"], "--ngpt cannot be combined with --fixnorm"),
    (["--qknorm"], "--ngpt cannot be combined with --qknorm"),
    (["--residual-scale", "rezero"], "--ngpt cannot be combined with --residual-scale rezero"),
    (["--weight-init", "tfixup"], "--ngpt cannot be combined with --weight-init tfixup"),
    (["--layernorm-embedding"], "--ngpt cannot be combined with --layernorm-embedding"),
    (["--quant-noise-pq", "0.1"], "--ngpt cannot be combined with --quant-noise-pq"),
    (["--ddp-backend", "fully_sharded"], "--ngpt cannot be combined with --ddp-backend fully_sharded"),
    (["--optimizer", "adam", "--weight-decay", "0.1"], "--ngpt trains without weight decay"),
])
def test_contradictions_are_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, "--ngpt", *flags, task=TASK)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_task_without_the_renormalising_step_is_refused(tiny_bin):
    with pytest.raises(NormplugError, match="--ngpt needs --task translation_normplug"):
        parse_args(tiny_bin, TINY, "--ngpt", task="translation")


@pytest.mark.parametrize("task", ["translation", "translation_normplug"])
def test_the_hydra_door_checks_the_task_too(task):
    """fairseq-normplug-hydra-train checks cfg.model with cfg.task._name as fairseq-train's --task:
    a stock translation task (no renormalising step) is refused there too."""
    from omegaconf import OmegaConf
    from fairseq_normplug.models.normplug_config import check_hydra_model_config
    cfg = OmegaConf.create({"task": {"_name": task}, "model": {"_name": "transformer_normplug", "ngpt": True}})
    if task == TASK:
        check_hydra_model_config(cfg)
    else:
        with pytest.raises(NormplugError, match="--ngpt needs --task translation_normplug .*got --task translation$"):
            check_hydra_model_config(cfg)
