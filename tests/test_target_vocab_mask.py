"""--target-vocab-mask (the authors' mask_logit), --output-bias (their out_bias) and
--criterion masked_label_smoothed_cross_entropy. The synthetic corpus has disjoint source and
target words, so in its joined dictionary every lowercase word is a source-only type."""
import argparse
import os
import shutil

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug.criterions.masked_label_smoothed_cross_entropy import masked_label_smoothed_nll_loss
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.target_vocab_mask import MASKED_LOGIT, TargetVocabMask, masked_logit_value
from model_helpers import build, parse_args, toy_batch
from test_cli import NO_LOADER_WORKERS, USER_DIR, log_records

TINY = "transformer_normplug_tiny"
MASKED = ["--target-vocab-mask", "--share-all-embeddings", "--output-bias"]
HALF = {"fp32": torch.float32, "fp16": torch.float16}


def target_side_types(tiny_raw, dictionary):
    """The dictionary ids of the words of the raw training targets, plus </s> and <unk>."""
    with open(os.path.join(tiny_raw, "train.tgt"), encoding="utf-8") as f:
        words = {w for line in f for w in line.split()}
    return {dictionary.index(w) for w in words} | {dictionary.eos(), dictionary.unk()}


def masked_model(tiny_bin, fixnorm, *extra):
    model, task, args = build(tiny_bin, TINY, *MASKED, *(["--fixnorm", "--prenorm"] if fixnorm else []), *extra,
                              task="translation_normplug")
    return model, task, args


def decode(task, model, batch, beam=3):
    src, lengths, _ = batch
    generator = task.build_generator([model], argparse.Namespace(beam=beam, max_len_a=0, max_len_b=12))
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    return [hypo["tokens"] for hypos in generator.generate([model], sample) for hypo in hypos]


@pytest.mark.parametrize("dtype_name", list(HALF))
@pytest.mark.parametrize("fixnorm", [False, True], ids=["plain", "fixnorm"])
def test_source_only_types_get_probability_zero_and_are_never_decoded(tiny_bin, tiny_raw, fixnorm, dtype_name):
    model, task, _ = masked_model(tiny_bin, fixnorm, "--gnmt-alpha", "0.6")
    dictionary = task.target_dictionary
    allowed = set(torch.nonzero(model.decoder.target_vocab_mask.allowed).flatten().tolist())
    assert allowed == target_side_types(tiny_raw, dictionary)
    source_only = sorted(set(range(4, len(dictionary))) - allowed)
    assert len(source_only) >= 60 and dictionary[source_only[0]].islower()
    with torch.no_grad():  # without the mask, the source-only types would win every step
        model.decoder.output_projection.bias[source_only] = 100.0
    model = model.to(HALF[dtype_name]).eval()
    batch = toy_batch(task, batch=4, length=8)
    with torch.no_grad():
        logits, extra = model(*batch)
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
    assert torch.isfinite(logits).all() and torch.isfinite(lprobs).all()
    assert (logits[..., source_only] == masked_logit_value(logits.dtype)).all()
    assert (lprobs[..., source_only].exp() == 0).all()  # probability exactly 0
    assert torch.allclose(lprobs.exp().sum(-1), torch.ones(()), atol=1e-3)
    hypotheses = decode(task, model, batch)
    assert len(hypotheses) == 12 and all(set(h.tolist()) <= allowed for h in hypotheses)


def test_masked_logit_fits_every_precision():
    assert masked_logit_value(torch.float32) == masked_logit_value(torch.bfloat16) == MASKED_LOGIT == -1e9
    assert masked_logit_value(torch.float16) == -65504.0
    logits = torch.zeros(2, 5, dtype=torch.float16)
    mask = TargetVocabMask(5, torch.tensor([True, False, True, True, False]))
    out = mask(logits)
    assert torch.isfinite(out).all() and out[0, 1] == -65504.0
    assert (torch.log_softmax(out.float(), -1)[:, [1, 4]].exp() == 0).all()


def test_masked_smoothing_is_fairseqs_over_the_allowed_types(tiny_bin):
    torch.manual_seed(0)
    lprobs = torch.log_softmax(torch.randn(6, 10), -1)
    target = torch.tensor([3, 4, 1, 5, 9, 2])  # 1 = pad
    everything = torch.ones(10, dtype=torch.bool)
    ours = masked_label_smoothed_nll_loss(lprobs, target, 0.1, everything, ignore_index=1)
    stock = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=1)
    assert torch.equal(ours[0], stock[0]) and torch.equal(ours[1], stock[1])  # A = V: fairseq's loss

    allowed = everything.clone()
    allowed[[0, 1, 6, 7]] = False
    masked = lprobs.masked_fill(~allowed, MASKED_LOGIT).requires_grad_(True)
    loss, nll = masked_label_smoothed_nll_loss(masked, target, 0.1, allowed, ignore_index=1)
    real = target != 1
    eps_i = 0.1 / (6 - 1)
    smooth = -lprobs[real][:, allowed].sum()
    expected = (1 - 0.1 - eps_i) * nll + eps_i * smooth
    assert nll.item() == pytest.approx(-lprobs[real, target[real]].sum().item())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert (masked.grad[:, ~allowed] == 0).all() and torch.isfinite(masked.grad).all()
    # fairseq's own criterion on the same masked log-probabilities: the masked types dominate
    assert label_smoothed_nll_loss(masked, target, 0.1, ignore_index=1)[0].item() > 1e8


def test_a_forbidden_dev_target_adds_nothing_to_the_loss():
    """A dev token outside the training targets (so masked) counts 0 in nll, as in the
    authors' model.py, instead of the 1e9 its masked logit would give; the other tokens'
    loss is what it is without it."""
    torch.manual_seed(0)
    allowed = torch.ones(10, dtype=torch.bool)
    allowed[[0, 1, 6, 7]] = False
    lprobs = torch.log_softmax(torch.randn(5, 10).masked_fill(~allowed, MASKED_LOGIT), -1)
    target = torch.tensor([3, 6, 5, 1, 9])  # 6: forbidden; 1: pad
    loss, nll = masked_label_smoothed_nll_loss(lprobs, target, 0.1, allowed, ignore_index=1)
    kept = torch.tensor([0, 2, 4])
    loss_kept, nll_kept = masked_label_smoothed_nll_loss(lprobs[kept], target[kept], 0.1, allowed, ignore_index=1)
    eps_i = 0.1 / (6 - 1)
    smooth_of_forbidden = -lprobs[1][allowed].sum()
    assert nll.item() == pytest.approx(nll_kept.item(), rel=1e-6) and nll.item() < 100
    assert loss.item() == pytest.approx(loss_kept.item() + eps_i * smooth_of_forbidden.item(), rel=1e-6)


@pytest.mark.parametrize("dtype_name", list(HALF))
@pytest.mark.parametrize("fixnorm", [False, True], ids=["plain", "fixnorm"])
def test_trains_with_label_smoothing(tiny_bin, fixnorm, dtype_name):
    """A few Adam steps with the masked criterion on a real training batch: finite loss and
    gradients, the loss goes down, and the output bias (initialised to 0) learns only where
    types are allowed."""
    model, task, args = masked_model(tiny_bin, fixnorm, "--criterion", "masked_label_smoothed_cross_entropy",
                                     "--label-smoothing", "0.1", "--dropout", "0")
    criterion = task.build_criterion(args)
    task.load_dataset("train")
    iterator = task.get_batch_iterator(task.dataset("train"), max_tokens=600, seed=1).next_epoch_itr(shuffle=False)
    sample = next(iterator)
    masked = ~model.decoder.target_vocab_mask.allowed
    assert model.decoder.output_projection.bias.abs().max() == 0  # --output-bias starts at 0
    half = model.to(HALF[dtype_name])
    optimizer = torch.optim.Adam([p for p in half.parameters()], lr=1e-3, eps=1e-4)
    losses = []
    for _ in range(4):
        loss, sample_size, _ = criterion(half.train(), sample)
        loss.backward()
        assert torch.isfinite(loss) and loss.item() / sample_size < 10
        assert all(torch.isfinite(p.grad).all() for p in half.parameters() if p.grad is not None)
        assert (half.decoder.output_projection.bias.grad[masked] == 0).all()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() / sample_size)
    bias = half.decoder.output_projection.bias
    assert (bias[masked] == 0).all() and (bias[~masked] != 0).sum() > 50  # learned where allowed
    assert losses[-1] < losses[0], losses


def test_flags_off_add_no_state_and_the_criterion_is_stock(tiny_bin):
    plain, task, args = build(tiny_bin, TINY, "--criterion", "masked_label_smoothed_cross_entropy",
                              "--label-smoothing", "0.1")
    assert type(plain.decoder).__name__ == "TransformerDecoderBase"
    assert not [n for n in plain.state_dict() if "target_vocab_mask" in n or n.endswith("output_projection.bias")]
    ours = task.build_criterion(args)
    stock = task.build_criterion(parse_args(tiny_bin, TINY, "--criterion", "label_smoothed_cross_entropy",
                                            "--label-smoothing", "0.1"))
    src, lengths, prev = toy_batch(task)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
              "target": torch.roll(prev, -1, 1), "ntokens": prev.numel()}
    plain.eval()
    assert torch.equal(ours(plain, sample)[0], stock(plain, sample)[0])


@pytest.mark.parametrize("flags,message", [
    (["--target-vocab-mask", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
     "--target-vocab-mask cannot be combined with --criterion label_smoothed_cross_entropy --label-smoothing 0.1"),
    (["--target-vocab-mask", "--adaptive-softmax-cutoff", "20,40"],
     "--target-vocab-mask cannot be combined with --adaptive-softmax-cutoff [20, 40]"),
    (["--output-bias", "--adaptive-softmax-cutoff", "20"], "--output-bias cannot be combined with"),
])
def test_bad_combinations_are_refused_at_argument_time(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, "transformer_normplug", *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_mask_built_without_data_waits_for_a_checkpoint():
    mask = TargetVocabMask(4)
    with pytest.raises(NormplugError, match="no checkpoint was loaded"):
        mask(torch.zeros(1, 4))
    mask.load_state_dict({"allowed": torch.tensor([False, True, True, False])})
    assert mask(torch.zeros(1, 4)).tolist() == [[MASKED_LOGIT, 0, 0, MASKED_LOGIT]] and mask.num_allowed == 2


def test_fp16_training_then_decoding_from_a_folder_without_training_data(tiny_bin, tmp_path):
    """fairseq-train --fp16 with the paper recipe's output layer (joint embedding, FixNorm,
    mask, output bias, masked label smoothing), then fairseq-generate --fp16 with beam search
    and --gnmt-alpha on a data folder that holds no training files: the mask comes from the
    checkpoint and no hypothesis contains a source-only type."""
    save_dir = tmp_path / "checkpoints"
    proc = run_fairseq([cli("fairseq-train"), tiny_bin, "--user-dir", USER_DIR, "--task", "translation_normplug",
                        "--arch", TINY, *MASKED, "--prenorm", "--fixnorm", "--scalenorm",
                        "--criterion", "masked_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
                        "--optimizer", "adam", "--adam-betas", "(0.9, 0.999)", "--lr", "2e-3", "--clip-norm", "1.0",
                        "--fp16", "--fp16-no-flatten-grads", "--fp16-init-scale", "1", "--max-tokens", "1200",
                        "--max-update", "6", "--cpu", "--num-workers", "0", "--seed", "1", "--log-format", "json",
                        "--log-interval", "2", "--disable-validation", "--no-epoch-checkpoints",
                        "--save-dir", str(save_dir)], env={"NORMPLUG_COMPILE": "0"})
    losses = [float(r["loss"]) for r in log_records(proc, "train_inner")]
    assert len(losses) == 3 and all(l == l and l < 20 for l in losses), losses
    assert "--target-vocab-mask: 62 of 128 types may be produced" in proc.stdout + proc.stderr
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=False)["model"]
    allowed = state["decoder.target_vocab_mask.allowed"]
    assert allowed.dtype == torch.bool and int(allowed.sum()) == 62

    decode_dir = tmp_path / "no-train"
    decode_dir.mkdir()
    for name in os.listdir(tiny_bin):
        if name.startswith(("dict.", "valid.")):
            shutil.copy(os.path.join(tiny_bin, name), decode_dir / name)
    proc = run_fairseq([cli("fairseq-generate"), str(decode_dir), "--user-dir", USER_DIR,
                        "--task", "translation_normplug", "--gnmt-alpha", "0.6",
                        "--path", str(save_dir / "checkpoint_last.pt"),
                        "--fp16", "--cpu", "--beam", "3", "--max-sentences", "50", "--gen-subset", "valid",
                        "--max-len-a", "0", "--max-len-b", "12", "--required-batch-size-multiple", "1",
                        *NO_LOADER_WORKERS], env={"NORMPLUG_COMPILE": "0"})
    hypotheses = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 100
    assert all(-1e4 < float(score) <= 0 for _, score, _ in hypotheses)
    assert not any(w.islower() for _, _, text in hypotheses for w in text.split() if w != "<unk>")
