"""Issue 12's model parts: QKNorm, --residual-scale (ReZero, LayerScale, DeepNorm), T-Fixup,
--embed-scale learnable: constants, init statistics, formulas against plain computations,
incremental decoding, training/generate/reload through the CLI, and refused combinations."""
import math
import os
import shutil
from argparse import Namespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.models.placements import training_task
from fairseq_normplug.modules.qknorm import (HeadNormProjection, length_percentile, qknorm_g0,
                                             training_target_lengths)
from fairseq_normplug.modules.residual_scale import deepnorm_constants, layerscale_init
from fairseq_normplug.modules.weight_init import tfixup_scales
from model_helpers import build, incremental_and_full, parse_args, randomized, toy_batch
from test_cli import NO_LOADER_WORKERS, USER_DIR, train

TINY = "transformer_normplug_tiny"
CPU = "transformer_normplug_cpu"  # d=256, FFN 1024, 3+3 layers: enough weights for statistics


# ---- constants ---------------------------------------------------------------------------

def test_deepnorm_constants_match_the_paper_table():
    c = deepnorm_constants(6, 6)  # (N^4 M)^(1/16) = 6^(5/16) = 1.75054
    assert c["encoder_alpha"] == pytest.approx(0.81 * 1.750541, rel=1e-5)
    assert c["encoder_beta"] == pytest.approx(0.87 / 1.750541, rel=1e-5)
    assert c["decoder_alpha"] == pytest.approx(18 ** 0.25, rel=1e-9)  # 2.0598
    assert c["decoder_beta"] == pytest.approx(72 ** -0.25, rel=1e-9)  # 0.3433
    c = deepnorm_constants(18, 2)
    assert c["encoder_alpha"] == pytest.approx(0.81 * (18 ** 4 * 2) ** (1 / 16))
    assert c["decoder_alpha"] == pytest.approx(6 ** 0.25)


def test_tfixup_and_layerscale_constants():
    enc, dec = tfixup_scales(6, 6)
    assert enc == pytest.approx(0.67 * 6 ** -0.25) and enc == pytest.approx(0.42811, rel=1e-4)
    assert dec == pytest.approx(54 ** -0.25) and dec == pytest.approx(0.36889, rel=1e-4)
    assert [layerscale_init(d) for d in (6, 18, 19, 24, 36)] == [0.1, 0.1, 1e-5, 1e-5, 1e-6]


def test_qknorm_g0_from_a_known_length_list():
    lengths = list(range(1, 101))  # numpy linear percentile: 1 + 0.975 * 99
    assert length_percentile(lengths) == pytest.approx(97.525)
    assert qknorm_g0(97.525) == pytest.approx(math.log2(97.525 ** 2 - 97.525))
    assert qknorm_g0(20) == pytest.approx(math.log2(380))
    with pytest.raises(NormplugError, match="L > 2"):
        qknorm_g0(2)


# ---- built models -----------------------------------------------------------------------

def test_qknorm_g0_computed_from_the_data_and_stored_in_args(tiny_bin):
    model, _, args = build(tiny_bin, TINY, "--qknorm")
    sizes = training_target_lengths(tiny_bin, "src", "tgt")
    assert len(sizes) == 2000 and sizes.min() >= 2  # every sentence plus </s>
    expected = math.log2(np.percentile(sizes, 97.5) ** 2 - np.percentile(sizes, 97.5))
    assert args.qknorm_g0 == pytest.approx(expected)
    gains = [m.g.item() for m in model.modules() if isinstance(m, HeadNormProjection) and m.g is not None]
    assert len(gains) == 2 * 1 + 2 * 2  # encoder self, decoder self + cross, 2 layers each
    assert gains == pytest.approx([expected] * 6)
    model, _, args = build(tiny_bin, TINY, "--qknorm", "--qknorm-g0", "3.5")
    assert model.encoder.layers[0].self_attn.q_proj.g.item() == 3.5


def plain_attention(attn, query, key, g):
    """softmax(g * q_hat k_hat^T) V per head, from the projections' weights (eval mode)."""
    h = attn.num_heads

    def heads(x, proj):
        y = F.linear(x, proj.weight, proj.bias)  # T x B x C
        return y.view(y.size(0), y.size(1), h, -1).permute(1, 2, 0, 3)  # B x H x T x d

    q, k, v = heads(query, attn.q_proj), heads(key, attn.k_proj), heads(key, attn.v_proj)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    out = torch.softmax(g * q @ k.transpose(-1, -2), dim=-1) @ v  # B x H x T x d
    out = out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)
    return attn.out_proj(out)


@pytest.mark.parametrize("which", ["encoder_self", "decoder_cross"])
def test_qknorm_attention_equals_the_plain_formula(tiny_bin, which):
    model, _, _ = build(tiny_bin, TINY, "--qknorm", "--qknorm-g0", "4.0")
    randomized(model)
    model.eval()
    layer = model.encoder.layers[1] if which == "encoder_self" else model.decoder.layers[0]
    attn = layer.self_attn if which == "encoder_self" else layer.encoder_attn
    g = attn.q_proj.g
    query = torch.randn(5, 3, 64)
    key = query if which == "encoder_self" else torch.randn(7, 3, 64)
    ours, _ = attn(query, key, key, static_kv=which == "decoder_cross")
    assert torch.allclose(ours, plain_attention(attn, query, key, g), atol=1e-5)
    # gradients reach g and both projections
    ours.pow(2).sum().backward()
    assert g.grad is not None and g.grad.abs() > 0 and attn.k_proj.weight.grad.abs().sum() > 0


def test_rezero_makes_every_layer_the_identity_at_init(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--norm-type", "identity", "--residual-scale", "rezero")
    model.eval()
    x = torch.randn(6, 2, 64)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    for layer in model.encoder.layers:
        assert torch.equal(layer(x, mask), x)
    for layer in model.decoder.layers:
        assert torch.equal(layer(x, encoder_out=torch.randn(4, 2, 64))[0], x)
    gains = [layer.residual_scale.gains for layer in [*model.encoder.layers, *model.decoder.layers]]
    assert [tuple(g.shape) for g in gains] == [(2,)] * 2 + [(3,)] * 2 and all((g == 0).all() for g in gains)


def test_layerscale_and_deepnorm_residuals(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--residual-scale", "layerscale")
    layer = model.decoder.layers[0]
    assert tuple(layer.residual_scale.gains.shape) == (3, 64) and (layer.residual_scale.gains == 0.1).all()
    x, residual = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    with torch.no_grad():
        layer.residual_scale.gains.copy_(torch.rand(3, 64))
    layer.residual_scale.calls = 0
    outs = [layer.residual_connection(x, residual) for _ in range(4)]
    gains = layer.residual_scale.gains
    for i, out in enumerate(outs):  # self-attn, cross-attn, FFN, then the next forward's first
        assert torch.allclose(out, residual + gains[i % 3] * x)

    model, _, _ = build(tiny_bin, TINY, "--residual-scale", "deepnorm")
    c = deepnorm_constants(2, 2)
    for stack, alpha in ((model.encoder, c["encoder_alpha"]), (model.decoder, c["decoder_alpha"])):
        for layer in stack.layers:
            assert torch.allclose(layer.residual_connection(x, residual), alpha * residual + x)


def test_deepnorm_init_statistics(tiny_bin):
    model, _, _ = build(tiny_bin, CPU, "--residual-scale", "deepnorm")
    d, ffn = 256, 1024
    c = deepnorm_constants(3, 3)
    for stack, beta in ((model.encoder, c["encoder_beta"]), (model.decoder, c["decoder_beta"])):
        attns = [a for layer in stack.layers for a in (layer.self_attn, getattr(layer, "encoder_attn", None)) if a]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w = torch.cat([getattr(a, proj).weight.flatten() for a in attns])
            gain = 1.0 if proj in ("q_proj", "k_proj") else beta
            assert w.std().item() == pytest.approx(gain / math.sqrt(d), rel=0.03), proj
        w = torch.cat([layer.fc1.weight.flatten() for layer in stack.layers])
        assert w.std().item() == pytest.approx(beta * math.sqrt(2 / (d + ffn)), rel=0.03)


def test_tfixup_init_statistics(tiny_bin):
    model, _, _ = build(tiny_bin, CPU, "--norm-type", "identity", "--weight-init", "tfixup")
    d, ffn = 256, 1024
    enc, dec = tfixup_scales(3, 3)
    for stack, scale in ((model.encoder, enc), (model.decoder, dec)):
        v = torch.cat([layer.self_attn.v_proj.weight.flatten() for layer in stack.layers])
        assert v.std().item() == pytest.approx(scale / math.sqrt(d), rel=0.03)
        fc2 = torch.cat([layer.fc2.weight.flatten() for layer in stack.layers])
        assert fc2.std().item() == pytest.approx(scale * math.sqrt(2 / (d + ffn)), rel=0.03)
        q = torch.cat([layer.self_attn.q_proj.weight.flatten() for layer in stack.layers])
        assert q.std().item() == pytest.approx(1 / math.sqrt(2 * d), rel=0.03)  # fairseq's, kept
    emb = model.encoder.embed_tokens.weight.detach()[4:]
    assert emb.std().item() == pytest.approx(d ** -0.5 * dec, rel=0.06)
    assert model.encoder.embed_scale == math.sqrt(d)


def test_learnable_embed_scale(tiny_bin):
    model, task, _ = build(tiny_bin, TINY, "--embed-scale", "learnable")
    for stack in (model.encoder, model.decoder):
        assert isinstance(stack.embed_scale, torch.nn.Parameter) and stack.embed_scale.item() == 8.0
    src, lengths, prev = toy_batch(task)
    model(src, lengths, prev)[0].sum().backward()
    assert model.encoder.embed_scale.grad.abs() > 0 and model.decoder.embed_scale.grad.abs() > 0
    fixed, _, _ = build(tiny_bin, TINY, "--no-scale-embedding", "--embed-scale", "learnable")
    assert fixed.decoder.embed_scale.item() == 1.0
    stock, _, _ = build(tiny_bin, TINY)
    assert stock.encoder.embed_scale == 8.0 and "encoder.embed_scale" not in stock.state_dict()


INCREMENTAL = {
    "qknorm-layerscale-learnable": ["--prenorm", "--qknorm", "--residual-scale", "layerscale",
                                    "--embed-scale", "learnable"],
    "qknorm-deepnorm": ["--qknorm", "--residual-scale", "deepnorm"],
    "identity-rezero": ["--norm-type", "identity", "--residual-scale", "rezero"],
    "tfixup": ["--norm-type", "identity", "--weight-init", "tfixup"],
}


@pytest.mark.parametrize("name", list(INCREMENTAL))
def test_incremental_decoding_equals_the_full_forward(tiny_bin, name):
    model, task, _ = build(tiny_bin, TINY, *INCREMENTAL[name])
    steps, full = incremental_and_full(randomized(model, seed=1), task)  # ReZero's a = 0 would hide the sublayers
    assert torch.allclose(steps, full, atol=1e-4)


def toy_sample(task, seed=0):
    src, lengths, prev = toy_batch(task, batch=4, length=7, seed=seed)
    target = torch.cat([prev[:, 1:], torch.full((4, 1), task.target_dictionary.eos())], dim=1)
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
            "target": target, "ntokens": target.numel(), "nsentences": 4}


def beam_search(task, model, sample):
    generator = task.build_generator([model], Namespace(beam=3, max_len_a=0, max_len_b=6, min_len=1))
    return [hyps[0] for hyps in generator.generate([model], sample)]


@pytest.mark.parametrize("name", list(INCREMENTAL))
def test_train_steps_beam_search_and_checkpoint_reload(tiny_bin, tmp_path, name):
    """A few training steps move every new parameter; beam search (incremental decoding)
    scores its hypotheses exactly as a full forward pass does; a saved checkpoint reloads,
    from a data dir without training data, into a model with identical beam output."""
    model, task, args = build(tiny_bin, TINY, *INCREMENTAL[name])
    new = {n: p.detach().clone() for n, p in model.named_parameters()
           if n.endswith(("q_proj.g", "residual_scale.gains", "embed_scale"))}
    criterion = task.build_criterion(Namespace(**{**vars(args), "label_smoothing": 0.1}))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for step in range(3):
        loss = criterion(model, toy_sample(task, seed=step))[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
    for n, before in new.items():
        assert not torch.equal(before, model.state_dict()[n]), n
    model.eval()
    sample = toy_sample(task, seed=9)
    hypotheses = beam_search(task, model, sample)
    for i, hyp in enumerate(hypotheses):  # non-incremental forward of the chosen tokens
        tokens = hyp["tokens"].unsqueeze(0)
        prev = torch.cat([tokens.new_full((1, 1), task.target_dictionary.eos()), tokens[:, :-1]], dim=1)
        with torch.no_grad():
            out = model(sample["net_input"]["src_tokens"][i:i + 1], sample["net_input"]["src_lengths"][i:i + 1], prev)
            lprobs = model.get_normalized_probs(out, log_probs=True)[0]
        expected = lprobs.gather(-1, tokens[0].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(hyp["positional_scores"], expected, atol=1e-4)

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(tiny_bin):
        if f.startswith("dict"):
            shutil.copy(os.path.join(tiny_bin, f), bare / f)
    cfg = convert_namespace_to_omegaconf(args)
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                "model": model.state_dict(), "args": None, "extra_state": {},
                "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                                       "optimizer_name": "Adam", "lr_scheduler_state": {},
                                       "num_updates": 3}]}, path)
    (reloaded,), _, reloaded_task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": str(bare), "source_lang": "src", "target_lang": "tgt"})
    reloaded.eval()
    again = beam_search(reloaded_task, reloaded, sample)
    for a, b in zip(hypotheses, again):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["positional_scores"], b["positional_scores"])


# ---- the real command-line tools ----------------------------------------------------------

def test_cli_train_and_generate(tiny_bin, tmp_path):
    """fairseq-train and fairseq-generate (beam search) with the new flags; the checkpoint
    carries QKNorm's g0, computed from the training data."""
    save_dir = tmp_path / "ckpt"
    proc = train(tiny_bin, save_dir, INCREMENTAL["qknorm-layerscale-learnable"], 6)
    assert "QKNorm: 97.5th percentile of 2000 training target lengths" in proc.stdout + proc.stderr
    checkpoint = str(save_dir / "checkpoint_last.pt")
    gen = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                       "--beam", "3", "--cpu", "--max-tokens", "4000", "--gen-subset", "test",
                       "--required-batch-size-multiple", "1", "--max-len-a", "0", "--max-len-b", "6",
                       *NO_LOADER_WORKERS])
    assert len([line for line in gen.stdout.splitlines() if line.startswith("H-")]) == 100
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    stored = state["cfg"]["model"].qknorm_g0
    sizes = training_target_lengths(tiny_bin, "src", "tgt")
    assert stored == pytest.approx(qknorm_g0(length_percentile(sizes)))
    g = state["model"]["encoder.layers.0.self_attn.q_proj.g"].item()
    assert g != stored and abs(g - stored) < 0.1  # trained, from g0


# ---- refused combinations -----------------------------------------------------------------

BAD = [
    (["--prenorm", "--residual-scale", "deepnorm"], "--residual-scale deepnorm is defined for PostNorm only"),
    (["--encoder-normalize-before", "--decoder-normalize-before", "--residual-scale", "deepnorm"],
     "defined for PostNorm only"),
    (["--norm-type", "identity", "--residual-scale", "deepnorm"], "choose a --norm-type other than identity"),
    (["--smallinit", "--residual-scale", "deepnorm"], "drop --weight-init smallinit"),
    (["--weight-init", "tfixup"], "add --norm-type identity, got --norm-type layernorm"),
    (["--norm-type", "identity", "--weight-init", "tfixup", "--residual-scale", "rezero"],
     "--weight-init tfixup cannot be combined with --residual-scale rezero"),
    (["--qknorm", "--decoder-xformers-att-config", "{}"],
     "--qknorm cannot be combined with --decoder-xformers-att-config"),
    (["--qknorm", "--quant-noise-pq", "0.1"], "--qknorm cannot be combined with --quant-noise-pq 0.1"),
    (["--qknorm-g0", "3"], "--qknorm-g0 needs --qknorm"),
    (["--qknorm", "--qknorm-g0", "0"], "--qknorm-g0 must be > 0, got 0.0"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_combinations_are_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- the beyond table -----------------------------------------------------------------------

def test_beyond_table_loads_without_the_qknorm_paper_number_beside_its_scalenorm_row():
    from fairseq_normplug.experiments.tables import config_string, load_paper_results, paper_bleu

    table = load_table("beyond")
    assert table.pairs == ["gl-en", "sk-en", "en-vi", "en-he", "ar-en"] and len(table.rows) == 11 + 13 + 11 + 9
    final = table.row("PreNorm + FixNorm + ScaleNorm + NoWarmup")
    assert final.model == ["--prenorm", "--fixnorm", "--scalenorm", "--smallinit"]
    authors = [row for row in table.rows if row.schedule == "val_decay"]  # QKNorm's authors' configuration
    assert [row.name for row in authors] == ["PreNorm + FixNorm + LayerNorm + ValDecay (stop lr 1e-5)",
                                             "PreNorm + FixNorm + LayerNorm + ValDecay (stop lr 1e-5) + QKNorm"]
    assert all(row.schedule == "val_decay" and row.train == ["--stop-lr", "1e-5"] for row in authors)
    assert authors[1].model == authors[0].model + ["--qknorm"] and authors[1].baseline == authors[0].name
    # QKNorm's published 33.24 is FixNorm + LayerNorm + ValDecay, multi-bleu-detok (configs/paper_results.json):
    # never a cell beside the ScaleNorm row, and not beside its own configuration's row either (other metric)
    qknorm = table.row(final.name + " + QKNorm")
    assert paper_bleu(load_paper_results(), "beyond", config_string(qknorm.model, qknorm.schedule), "en-vi") is None
    own = authors[1]
    assert paper_bleu(load_paper_results(), "beyond", config_string(own.model + own.train, own.schedule),
                      "en-vi") is None
    assert not any("--encoder-layers" in row.model for row in table.rows)  # depth: configs/experiments/depth.json
    # issue 21's rows: with warmup, each against PostNorm or PreNorm + LayerNorm with warmup
    warmup = [row for row in table.rows if row.schedule == "inv_sqrt_decay"]
    assert len(warmup) == 13 + 6 + 9 and warmup[0].model == [] and warmup[1].model == ["--prenorm"]
    placements = {row.model[1] for row in warmup if row.model[:1] == ["--norm-placement"]}
    assert placements == {"sandwich", "resi-dual", "b2t", "mix", "hybrid", "siamese", "output-norm",
                          "hyper-connections", "keel", "attention-residuals"}
    # issue 36's rows: each against the baseline of its schedule (warmup: PreNorm + LayerNorm; DyT ablations: DyT)
    issue36 = table.rows[-20:-9]
    assert [row.baseline for row in issue36] == (["PreNorm + DyT (alpha0 0.5)"] * 2 + [final.name, "PreNorm + RMSNorm", final.name]
                                                 + [warmup[1].name] * 6)
    assert table.row("nGPT").train == ["--lr", "6.8e-3"] and table.row("mHC (n 4) + warmup").model[-1] == "--hc-manifold"
    assert table.row("PostNorm + Admin + warmup").baseline == warmup[0].name
    # issues 58 and 59's rows: each against PreNorm + LayerNorm with warmup, Keel (a PostNorm) against PostNorm
    newer = table.rows[-9:]
    assert [row.baseline for row in newer] == [warmup[1].name] * 7 + [warmup[0].name, warmup[1].name]
    assert table.row("PreNorm + BHyT (block statistics) + warmup").model == ["--prenorm", "--norm-type", "bhyt",
                                                                             "--bhyt-block-statistics"]
    assert table.row("Keel + warmup").model == ["--norm-placement", "keel"]
    decayed = [row for row in warmup if row.train == ["--weight-decay", "0.1"]]
    assert [row.model for row in decayed] == [["--prenorm"], ["--prenorm", "--zero-centered-gamma"],
                                               ["--prenorm", "--norm-weight-decay", "0"]]
    assert decayed[1].baseline == decayed[2].baseline == decayed[0].name


@pytest.mark.parametrize("row", [r.name for r in load_table("beyond").rows])
def test_every_beyond_row_builds_a_tiny_model(tiny_bin, row):
    flags = load_table("beyond").row(row).model
    model, _, _ = build(tiny_bin, TINY, *flags, task=training_task(flags) or "translation")
    assert len(model.encoder.layers) == len(model.decoder.layers) == 2


# ---- speed and memory of the rows (scripts/bench_train.sh --variants beyond) -----------------

def test_the_speed_benchmark_covers_every_beyond_row():
    """Each row of the beyond table has a
    variant of bench_train with its model flags (Mix-LN with one PostNorm layer at 3 layers)."""
    from fairseq_normplug.bench.bench_train import BEYOND, PLUGIN, VARIANTS

    benched = [VARIANTS[name][len(PLUGIN):] for name in BEYOND.split(",") if VARIANTS[name][:2] == PLUGIN[:2]]
    assert len(benched) == len(set(map(tuple, benched))) == 44 - 3 + 2  # 44 rows, 3 of them off or prenorm
    for row in load_table("beyond").rows:
        flags = list(row.model)
        if row.model == ["--norm-placement", "mix"]:
            flags += ["--mix-ln-ratio", "0.34"]
        if "--ngpt" in row.model:
            flags += ["--task", "translation_normplug"]  # nGPT's training_task
        assert flags in benched, row.name
    assert VARIANTS["b2t-warmup"] == PLUGIN + ["--norm-placement", "b2t"]


#: the benchmark's widths (d=256) cut to 32: what is checked is that each variant's flags build,
#: at its 3 layers (the 45 builds: 6.1 CPU s at d=256, 2.7 at d=32)
NARROW = ["--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
          "--decoder-ffn-embed-dim", "64"]


@pytest.mark.parametrize("variant", __import__("fairseq_normplug.bench.bench_train", fromlist=["BEYOND"]).BEYOND.split(","))
def test_every_beyond_speed_variant_builds(tiny_bin, variant):
    from fairseq_normplug.bench.bench_train import PLUGIN, VARIANTS

    flags = VARIANTS[variant]
    arch = flags[flags.index("--arch") + 1]
    model, _, _ = build(tiny_bin, arch, *[f for f in flags[2:] if f not in PLUGIN], *NARROW)
    assert len(model.encoder.layers) == len(model.decoder.layers) == 3
