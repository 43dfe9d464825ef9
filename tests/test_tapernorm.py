"""TaperNorm (``modules/taper_norm.py``) and its fold (``diagnostics/fold.py``): the gate
schedule, the formula, calibration, refusals, a 20-update PreNorm run tapered to gate 0 whose
resume is bit-identical and whose folded checkpoint decodes the dev set identically."""
import math
import os
import shutil
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

from model_helpers import assert_incremental_matches_full, build, randomized, toy_batch
from test_resume import TINY, _parameters, train_in_process
from fairseq_normplug.diagnostics import convert, fold
from fairseq_normplug.diagnostics.loading import DEFAULT_GENERATION, dev_loss, dev_translations, load_checkpoint
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.norm_registry import NormSlot, build_norm, norm_args
from fairseq_normplug.modules.taper_norm import TAPER_EPS, TaperNorm, taper_gate

START, END = 4, 10
TAPER = ["--norm-placement", "pre", "--norm-type", "tapernorm", "--taper-updates", str(START), str(END),
         "--max-epoch", "4", "--max-update", "20"]


def test_gate_is_one_then_a_cosine_then_zero():
    assert [taper_gate(n, 4, 10) for n in (0, 3, 4)] == [1.0, 1.0, 1.0]
    assert taper_gate(7, 4, 10) == pytest.approx(0.5)
    assert taper_gate(5, 4, 10) == pytest.approx((1 + math.cos(math.pi / 6)) / 2)
    assert [taper_gate(n, 4, 10) for n in (10, 11, 1000)] == [0.0, 0.0, 0.0]
    assert taper_gate(5, 5, 5) == 1.0 and taper_gate(6, 5, 5) == 0.0


def test_output_is_the_gated_mix_of_layernorm_and_the_calibrated_affine_map():
    norm = build_norm(norm_args("tapernorm", taper_updates=[2, 6]), 8)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    x = torch.randn(5, 8) * 3 + 1
    norm.train()
    assert torch.equal(norm(x), F.layer_norm(x, (8,), norm.weight, norm.bias, TAPER_EPS))  # gate 1
    s = 1 / torch.sqrt(x.var(-1, unbiased=False) + TAPER_EPS).mean()
    assert norm.inv_std.item() == pytest.approx(s.item(), rel=1e-6)  # the first batch sets s
    norm(2 * x)  # an EMA step
    assert norm.inv_std.item() == pytest.approx(0.99 * s.item() + 0.01 * s.item() / 2, rel=1e-6)
    s = norm.inv_std.clone()
    norm.set_num_updates(4)  # gate 0.5: s is frozen
    y = norm(x)
    assert norm.gate.item() == pytest.approx(0.5) and torch.equal(norm.inv_std, s)
    affine = norm.weight * s * x + norm.bias
    layer_norm = F.layer_norm(x, (8,), norm.weight, norm.bias, TAPER_EPS)
    assert torch.allclose(y, 0.5 * layer_norm + 0.5 * affine, atol=1e-6)
    norm.set_num_updates(6)
    assert torch.allclose(norm(x), affine, atol=1e-6)
    norm.half()  # fp16 weights and input: statistics, gate and s in float32, output fp16
    assert norm.gate.dtype == norm.inv_std.dtype == torch.float32 and norm.weight.dtype == torch.float16
    assert torch.allclose(norm(x.half()).float(), affine, atol=1e-2) and norm(x.half()).dtype == torch.float16
    output = build_norm(norm_args("tapernorm", taper_updates=[2, 6]), 8, NormSlot(feeds_output=True))
    output.train()
    output.set_num_updates(6)  # the output norm, the paper's scale anchor, never tapers
    assert not output.tapers and output.gate == 1
    assert torch.equal(output(x), F.layer_norm(x, (8,), output.weight, output.bias, TAPER_EPS))
    assert output.inv_std == 0  # nor calibrates


@pytest.mark.parametrize("values,message", [
    ({}, "--norm-type tapernorm needs --taper-updates START END"),
    ({"taper_updates": [8, 4]}, "needs 1 <= START <= END .*got 8 4"),
    ({"taper_updates": [-1, 4]}, "needs 1 <= START <= END .*got -1 4"),
    ({"taper_updates": [0, 4]}, "needs 1 <= START <= END .*got 0 4"),
])
def test_bad_taper_updates_are_refused_in_one_line(values, message):
    with pytest.raises(NormplugError, match=message):
        norm_args("tapernorm", **values)


def test_taper_updates_need_tapernorm():
    with pytest.raises(NormplugError, match="--taper-updates needs --norm-type tapernorm, got --norm-type dyt"):
        norm_args("dyt", taper_updates=[1, 2])


@pytest.fixture(scope="module")
def tapered(tiny_bin, tmp_path_factory):
    """20 updates of the tiny PreNorm TaperNorm model (gate 1 until 4, 0 from 10)."""
    save_dir = str(tmp_path_factory.mktemp("tapered"))
    records = train_in_process(tiny_bin, save_dir, *TAPER)
    return save_dir, records


def test_twenty_updates_train_finite_and_the_checkpoints_keep_the_gate(tapered, tiny_bin):
    save_dir, records = tapered
    assert [r[0] for r in records] == list(range(1, 21))
    assert all(math.isfinite(loss) for r in records for loss in r[1])
    # a checkpoint keeps the gate its last update trained with: fairseq's task.train_step sets it
    # from the updates done before that update (5 for the 6th)
    for checkpoint, gate in (("checkpoint1.pt", taper_gate(5, START, END)), ("checkpoint_last.pt", 0.0)):
        norms = named_norms(load_checkpoint(os.path.join(save_dir, checkpoint), tiny_bin).model)
        assert all(isinstance(norm, TaperNorm) for norm in norms.values())
        assert not norms["dec.final"].tapers and norms["dec.final"].gate == 1
        gates = {name: float(norm.gate) for name, norm in norms.items() if norm.tapers}
        assert len(gates) == len(norms) - 1 and list(gates.values()) == [pytest.approx(gate)] * len(gates), checkpoint
        assert all(norm.inv_std > 0 for norm in norms.values() if norm.tapers)


def test_resume_mid_taper_is_bit_identical(tapered, tiny_bin, tmp_path):
    save_dir, full = tapered
    os.makedirs(tmp_path / "run")
    shutil.copyfile(os.path.join(save_dir, "checkpoint1.pt"), tmp_path / "run" / "checkpoint_last.pt")
    resumed = train_in_process(tiny_bin, str(tmp_path / "run"), *TAPER, "--no-epoch-checkpoints")
    expected = [record for record in full if record[0] >= 7]
    assert [r[0] for r in resumed] == [r[0] for r in expected]
    assert [r[1:] for r in resumed] == [r[1:] for r in expected]
    final, want = _parameters(tmp_path / "run" / "checkpoint_last.pt"), _parameters(
        os.path.join(save_dir, "checkpoint_last.pt"))
    assert all(torch.equal(final[k], want[k]) for k in want)


def test_folded_checkpoint_has_no_tapered_norm_and_decodes_identically(tapered, tiny_bin, tmp_path):
    save_dir, _ = tapered
    source, out = os.path.join(save_dir, "checkpoint_last.pt"), str(tmp_path / "folded.pt")
    report = convert.main([source, tiny_bin, out, "--to", "folded", "--beam", "2"])
    assert report["hypotheses_equal"] and report["remaining_norms"] == ["dec.final"]
    assert report["folded"]["enc.final"] == 2 * 2 and report["folded"]["dec0.attn"] == 3
    original, folded = load_checkpoint(source, tiny_bin), load_checkpoint(out, tiny_bin)
    norms = named_norms(folded.model)
    assert not norms.pop("dec.final").tapers
    assert all(type(norm) is IdentityNorm for norm in norms.values())
    assert not [key for key in folded.state["model"] if "layer_norm" in key and not key.startswith("decoder.layer_norm")]
    assert [key for key in original.state["model"] if "layer_norm" in key]  # (the test can fail)
    generation = {**DEFAULT_GENERATION, "beam": 4}
    hypotheses = dev_translations(original.model, original.task, original.bpe, generation)[0]
    assert dev_translations(folded.model, folded.task, folded.bpe, generation)[0] == hypotheses
    criterion = original.task.build_criterion(original.cfg.criterion)
    before, after = dev_loss(original.model, original.task, criterion), dev_loss(folded.model, folded.task, criterion)
    assert after["loss"] == pytest.approx(before["loss"], abs=1e-5)


def test_fold_refusals_one_line(tapered, tiny_bin, tmp_path):
    save_dir, _ = tapered
    out = str(tmp_path / "folded.pt")
    with pytest.raises(SystemExit) as refused:
        convert.main([os.path.join(save_dir, "checkpoint1.pt"), tiny_bin, out, "--to", "folded"])
    assert str(refused.value) == (f"convert_norms.sh: error: {save_dir}/checkpoint1.pt: the TaperNorm gate is "
                                  f"0.933, not 0 yet (it reaches 0 at update 10); train until then before --to folded")
    assert not os.path.exists(out)
    loaded = load_checkpoint(os.path.join(save_dir, "checkpoint_last.pt"), tiny_bin)
    fold.check_foldable(loaded.model, "CKPT")  # gate 0, PreNorm TaperNorm: foldable
    # the verdict is the model's resolved configuration, not the checkpoint's raw flags: models
    # built with other flags are refused (the checkpoint's cfg changed after loading is not read)
    taper = ["--norm-type", "tapernorm", "--taper-updates", "4", "10"]
    for flags, message in ((["--norm-placement", "sandwich", *taper], "has --norm-placement sandwich; --to folded needs pre"),
                           (["--prenorm", "--qknorm", *taper], "has --qknorm, which changes what the norms feed"),
                           (["--prenorm", "--normformer", *taper], "has --normformer, which changes what the norms feed"),
                           (["--prenorm", "--cross-self-attention", *taper],
                            "has --cross-self-attention, which changes what the norms feed"),
                           (["--prenorm", "--dyt"], "has --norm-type dyt; --to folded takes a --norm-type tapernorm")):
        model, _, _ = build(tiny_bin, TINY, *flags)
        with pytest.raises(NormplugError, match=message):
            fold.check_foldable(model, "CKPT")
    loaded.cfg.model.norm_placement = "sandwich"
    fold.check_foldable(loaded.model, "CKPT")


def test_fold_is_exact_on_a_random_model(tiny_bin):
    """A randomised model at gate 0 (every parameter and scaling random, so the hypotheses are
    diverse, unlike the 20-update model's), in float64 so that rounding cannot hide an error:
    the folded model gives the same log-probabilities, beam hypotheses and scores."""
    model, task, _ = build(tiny_bin, TINY, "--prenorm", "--norm-type", "tapernorm", "--taper-updates", "1", "2")
    randomized(model).double()
    generator = torch.Generator().manual_seed(1)
    for norm in named_norms(model).values():
        if isinstance(norm, TaperNorm):
            norm.inv_std.fill_(float(torch.rand((), generator=generator)) + 0.5)
    model.set_num_updates(2)
    folded, absorbed = fold.fold_model(model)
    assert len(absorbed) == len(named_norms(model)) - 1
    model.eval(), folded.eval()
    src, lengths, prev = toy_batch(task, batch=4, length=9)
    with torch.no_grad():
        expected, got = model(src, lengths, prev)[0], folded(src, lengths, prev)[0]
    assert (got.log_softmax(-1) - expected.log_softmax(-1)).abs().max() < 1e-9
    search = task.build_generator([model], Namespace(**{**DEFAULT_GENERATION, "beam": 4}))
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    before, after = (search.generate([m], sample) for m in (model, folded))
    assert len({tuple(hyps[0]["tokens"].tolist()) for hyps in before}) == 4  # diverse
    for want, got in zip(before, after):
        assert [h["tokens"].tolist() for h in got] == [h["tokens"].tolist() for h in want]
        assert torch.allclose(torch.stack([h["score"] for h in got]), torch.stack([h["score"] for h in want]),
                              atol=1e-9)
    assert_incremental_matches_full(model, task)  # (randomises the model again)
    assert_incremental_matches_full(folded, task)


def test_at_gate_zero_no_per_token_statistic_is_computed(monkeypatch):
    """Past END the forward is the affine map alone (the LN branch is not computed, and the
    gate is read without a device sync); its values are the formula's."""
    import fairseq_normplug.modules.taper_norm as taper_module

    norm = TaperNorm(8, 2, 4)
    x = torch.randn(3, 5, 8)
    norm.train()
    norm(x)  # calibrates s
    norm.set_num_updates(4)
    expected = norm.weight * norm.inv_std * x + norm.bias
    monkeypatch.setattr(taper_module.F, "layer_norm", lambda *args, **kwargs: pytest.fail("LayerNorm computed at g = 0"))
    assert norm.gate_value == 0.0
    torch.testing.assert_close(norm(x), expected)
