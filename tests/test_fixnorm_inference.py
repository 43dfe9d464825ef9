"""FixNorm at inference: the normalised matrix is cached while the weights are fixed (and
recomputed when they change), a model trained in fp32 decodes in fp16 (same scores within
0.05 nats a token), and the decoding benchmark runs."""
import json

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_normplug.modules.fixnorm_embedding import FixNormEmbedding
from model_helpers import build, train_briefly

TINY = "transformer_normplug_tiny"


@pytest.fixture
def embedding():
    torch.manual_seed(0)
    return FixNormEmbedding(50, 16, padding_idx=1)


def cached(emb):
    """``normalized_weight()`` as decoding calls it, twice: (first, second)."""
    emb.eval()
    with torch.no_grad():
        return emb.normalized_weight(), emb.normalized_weight()


def test_cached_matrix_equals_the_uncached_one(embedding):
    first, second = cached(embedding)
    assert second is first  # computed once
    with torch.inference_mode():
        assert embedding.normalized_weight() is first
    assert torch.equal(first, embedding.normalize())
    embedding.train()
    assert torch.equal(first, embedding.normalized_weight().detach())


@pytest.mark.parametrize("change", [
    "in_place", "load_state_dict", "optimizer_step", "half", "to", "data_copy_while_training",
])
def test_a_weight_change_invalidates_the_cache(embedding, change):
    before, _ = cached(embedding)
    new = torch.rand_like(embedding.weight)
    new[1] = 0
    if change == "in_place":
        with torch.no_grad():
            embedding.weight.copy_(new)
    elif change == "load_state_dict":
        embedding.load_state_dict({"weight": new})
    elif change == "optimizer_step":  # still in eval mode: only the version changes
        embedding(torch.arange(50)).pow(3).sum().backward()
        torch.optim.SGD(embedding.parameters(), lr=0.1).step()
    elif change == "half":
        embedding.half()
    elif change == "to":
        embedding.to(torch.bfloat16)
    else:  # fairseq's FP16Optimizer writes the fp16 weights through .data (no version bump)
        embedding.train()
        embedding.weight.data.copy_(new)
    after, again = cached(embedding)
    assert again is after and after is not before
    assert after.dtype == embedding.weight.dtype
    torch.testing.assert_close(after, embedding.normalize(), rtol=0, atol=0)
    assert not torch.equal(after.float(), before.float())


def test_training_path_is_not_cached(embedding):
    embedding.train()
    first, second = embedding.normalized_weight(), embedding.normalized_weight()
    assert first is not second and first.requires_grad and embedding._cache is None
    embedding.eval()  # eval mode with autograd on (e.g. gradients for analysis): not cached
    assert embedding.normalized_weight().requires_grad and embedding._cache is None
    embedding(torch.tensor([0, 1, 2])).sum().backward()
    assert embedding.weight.grad[[0, 2]].abs().sum() > 0 and embedding.weight.grad[1].abs().max() == 0


def teacher_forced_scores(model, task, src, lengths, tokens):
    """log p of each of ``tokens`` (a hypothesis ending in EOS) given the source, one forward."""
    eos = task.target_dictionary.eos()
    prev = torch.cat([torch.tensor([eos]), tokens[:-1]]).unsqueeze(0)
    with torch.no_grad():
        out = model(src.unsqueeze(0), lengths.view(1), prev)
        lprobs = model.get_normalized_probs(out, log_probs=True)[0].float()
    return lprobs.gather(1, tokens.view(-1, 1)).squeeze(1)


def test_fp32_trained_fixnorm_model_decodes_in_fp16(tiny_bin):
    """A FixNorm model trained in float32, cast to float16: beam search gives finite scores and
    no pad; the float16 model scores every float32 hypothesis (teacher-forced) within 0.05
    nats a token of the float32 beam's scores, and finds the same best hypothesis for most
    sentences."""
    torch.manual_seed(0)
    model, task, _ = build(tiny_bin, TINY, "--prenorm", "--scalenorm", "--fixnorm")
    first, last = train_briefly(model, task)
    assert last < 0.7 * first, (first, last)  # trained, not a model at its init
    task.load_dataset("valid")
    items = [task.dataset("valid")[i] for i in range(8)]
    src = torch.nn.utils.rnn.pad_sequence([item["source"] for item in items], batch_first=True,
                                          padding_value=task.source_dictionary.pad())
    lengths = torch.tensor([len(item["source"]) for item in items])
    # fairseq's encoder expects left padding
    src = torch.stack([torch.cat([row[n:], row[:n]]) for row, n in zip(src, [src.size(1) - l for l in lengths])])
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    hypos = {}
    for dtype in (torch.float32, torch.float16):
        model = model.to(dtype).eval()
        generator = SequenceGenerator([model], task.target_dictionary, beam_size=3, max_len_b=12)
        with torch.no_grad():
            hypos[dtype] = [h[0] for h in generator.generate([model], sample)]
    pad = task.target_dictionary.pad()
    same = 0
    for i, (h32, h16) in enumerate(zip(hypos[torch.float32], hypos[torch.float16])):
        assert torch.isfinite(h16["positional_scores"]).all() and (h16["tokens"] != pad).all()
        scores16 = teacher_forced_scores(model, task, src[i], lengths[i], h32["tokens"])
        torch.testing.assert_close(scores16, h32["positional_scores"], atol=0.05, rtol=0)
        same += torch.equal(h16["tokens"], h32["tokens"])
    assert same >= 6, same


def test_bench_decode_smoke(tmp_path):
    from fairseq_normplug.bench import bench_decode

    out = tmp_path / "bench_decode.md"
    text = bench_decode.main(["--vocab", "120", "--arch", TINY, "--batch", "2", "--beam", "2",
                              "--steps", "4", "--src-len", "5", "--reps", "2",
                              "--out", str(out)])
    assert out.read_text() == text
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    assert set(data["variants"]) == {"no-fixnorm", "fixnorm", "fixnorm-uncached"}
    for variant in data["variants"].values():
        assert len(variant["tokens_per_s"]) == 2 and all(t > 0 for t in variant["tokens_per_s"])
        assert variant["ratio"] > 0 and variant["cpu_ratio"] > 0
    assert data["variants"]["no-fixnorm"]["ratio"] == data["variants"]["no-fixnorm"]["cpu_ratio"] == 1.0
    assert "| fixnorm " in text and "vs no-fixnorm" in text
