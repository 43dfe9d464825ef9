"""--task translation_normplug: GNMT length normalisation on finished hypotheses, word
dropout statistics, and bit-identical training with word dropout off."""

import pytest
import torch
from fairseq.data import Dictionary

from model_helpers import build, toy_batch
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.tasks.gnmt_generator import GnmtSequenceGenerator, gnmt_length_penalty
from fairseq_normplug.tasks.word_dropout import word_dropout

TINY = "transformer_normplug_tiny"


def test_gnmt_length_penalty_formula():
    assert gnmt_length_penalty(1, 0.6) == 1.0
    assert gnmt_length_penalty(13, 0.6) == pytest.approx(3.0 ** 0.6)
    assert gnmt_length_penalty(7, 0.0) == 1.0


def _generate(tiny_bin, *task_flags, **gen_args):
    from argparse import Namespace

    model, task, _ = build(tiny_bin, TINY, *task_flags, task="translation_normplug")
    model.eval()
    eos_bonus = torch.zeros(len(task.target_dictionary))
    eos_bonus[task.target_dictionary.eos()] = 4.0  # an untrained model rarely ends a sentence
    output_layer = model.decoder.output_layer
    model.decoder.output_layer = lambda features: output_layer(features) + eos_bonus
    generator = task.build_generator([model], Namespace(beam=4, max_len_b=12, **gen_args))
    src, lengths, _ = toy_batch(task, batch=3, length=6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    with torch.no_grad():
        return generator, generator.generate([model], sample)


def test_gnmt_scores_finished_hypotheses(tiny_bin):
    generator, hypos = _generate(tiny_bin, "--gnmt-alpha", "0.6")
    assert isinstance(generator, GnmtSequenceGenerator)
    lengths = set()
    for nbest in hypos:
        assert len(nbest) == 4
        for hypo in nbest:
            length = len(hypo["tokens"])  # EOS included
            lengths.add(length)
            expected = hypo["positional_scores"].sum() / ((5 + length) / 6) ** 0.6
            assert float(hypo["score"]) == pytest.approx(float(expected), rel=1e-5)
        scores = [float(h["score"]) for h in nbest]
        assert scores == sorted(scores, reverse=True)
    assert len(lengths) > 1  # the formula was checked on different lengths


def test_lenpen_still_works_with_gnmt_off(tiny_bin):
    generator, hypos = _generate(tiny_bin, lenpen=0.6)
    assert not isinstance(generator, GnmtSequenceGenerator)
    for hypo in hypos[0]:
        expected = hypo["positional_scores"].sum() / len(hypo["tokens"]) ** 0.6
        assert float(hypo["score"]) == pytest.approx(float(expected), rel=1e-5)


def test_word_dropout_statistics():
    d = Dictionary()
    for i in range(50):
        d.add_symbol(f"w{i}")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d), (400, 50), generator=g)
    tokens[:, -1] = d.eos()
    tokens[:, :5] = d.pad()
    tokens[:, 5] = d.unk()
    tokens[:, 6] = d.bos()
    out = word_dropout(tokens, 0.1, d, torch.Generator().manual_seed(1))
    changed = out != tokens
    assert (out[changed] == d.unk()).all()
    assert not changed[:, :7].any() and not changed[:, -1].any()  # specials never touched
    rate = changed[:, 7:-1].float().mean().item()
    assert abs(rate - 0.1) < 0.01  # 17,200 draws: sd 0.0023
    again = word_dropout(tokens, 0.1, d, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)
    assert word_dropout(tokens, 0.0, d) is tokens


class _Optimizer:
    """What task.train_step needs from a fairseq optimizer."""

    def backward(self, loss):
        loss.backward()


def _train(tiny_bin, task_name, *flags, updates=3):
    model, task, args = build(tiny_bin, TINY, "--dropout", "0.3", *flags, task=task_name)
    criterion = task.build_criterion(args)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for update in range(updates):
        torch.manual_seed(100 + update)  # as fairseq's trainer does before every update
        src, lengths, prev = toy_batch(task, batch=4, length=8, seed=update)
        target = torch.cat([prev[:, 1:], prev[:, :1]], dim=1)
        sample = {"id": torch.arange(4), "nsentences": 4, "ntokens": target.numel(), "target": target,
                  "net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}}
        seen.append((src.clone(), prev.clone(), target.clone()))
        sgd.zero_grad()
        task.train_step(sample, model, criterion, _Optimizer(), update)
        sgd.step()
        assert torch.equal(sample["target"], target) and torch.equal(sample["net_input"]["src_tokens"], src)
    return model, task, torch.get_rng_state()


def test_word_dropout_off_is_bit_identical_to_translation(tiny_bin):
    stock, _, stock_rng = _train(tiny_bin, "translation")
    ours, _, our_rng = _train(tiny_bin, "translation_normplug", "--word-dropout", "0")
    for (name, a), (_, b) in zip(stock.named_parameters(), ours.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(stock_rng, our_rng)  # no random number drawn
    dropped, _, dropped_rng = _train(tiny_bin, "translation_normplug", "--word-dropout", "0.3")
    assert not all(torch.equal(a, b) for a, b in zip(stock.parameters(), dropped.parameters()))
    assert torch.equal(stock_rng, dropped_rng)  # own generator: model dropout masks unchanged


def test_word_dropout_applies_to_inputs_only_and_is_seeded(tiny_bin):
    _, task, _ = build(tiny_bin, TINY, "--word-dropout", "0.5", task="translation_normplug")
    src, lengths, prev = toy_batch(task, batch=8, length=20)
    sample = {"target": prev.clone(), "net_input": {"src_tokens": src, "src_lengths": lengths,
                                                    "prev_output_tokens": prev}}
    torch.manual_seed(7)
    first = task.apply_word_dropout(sample, task.word_dropout_generator(5))
    second = task.apply_word_dropout(sample, task.word_dropout_generator(5))  # next micro-batch
    torch.manual_seed(7)
    task._micro_batch = (None, 0)
    replay = task.apply_word_dropout(sample, task.word_dropout_generator(5))
    unk = task.source_dictionary.unk()
    for key in ("src_tokens", "prev_output_tokens"):
        changed = first["net_input"][key] != sample["net_input"][key]
        assert changed.any() and (first["net_input"][key][changed] == unk).all()
        assert torch.equal(replay["net_input"][key], first["net_input"][key])
    assert not torch.equal(second["net_input"]["src_tokens"], first["net_input"]["src_tokens"])
    assert torch.equal(first["target"], prev)
    assert (first["net_input"]["src_tokens"][:, -1] == task.source_dictionary.eos()).all()


@pytest.mark.parametrize("flags,message", [
    (["--word-dropout", "1.5"], "--word-dropout must be in [0, 1), got 1.5"),
    (["--gnmt-alpha", "-1"], "--gnmt-alpha must be >= 0"),
])
def test_bad_values_are_one_line_errors(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, *flags, task="translation_normplug")
    assert message in str(error.value)
