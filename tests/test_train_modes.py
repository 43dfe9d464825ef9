"""fairseq-train modes no other test runs end to end: DyT and RMSNorm under --bf16 and --amp,
and a QKNorm run stopped and resumed. fairseq-train's own main runs in this process (the
tests share one start-up of torch and fairseq); a hook on fairseq's Trainer records what
each update saw (parameter dtypes, the optimizer, QKNorm's g)."""
import logging
import json

import pytest
import torch
from fairseq import checkpoint_utils, options, trainer
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq_cli import train as fairseq_cli_train

from conftest import REPO
from fairseq_normplug.modules.qknorm import length_percentile, qknorm_g0, training_target_lengths

COMMON = [
    "--user-dir", f"{REPO}/fairseq_normplug", "--task", "translation", "--arch", "transformer_normplug_tiny",
    "--optimizer", "adam", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1200",
    "--cpu", "--num-workers", "0", "--seed", "1", "--no-epoch-checkpoints", "--log-format", "json",
    "--log-interval", "1", "--disable-validation",
]


def fairseq_train(argv, caplog, monkeypatch):
    """fairseq-train ``argv`` in this process; returns ({log kind: [JSON records]}, [per
    update: {"dtypes": {name: dtype}, "optimizer": class name, "params": {name: tensor}}])."""
    seen = []
    train_step = trainer.Trainer.train_step

    def recording_train_step(self, *args, **kwargs):
        out = train_step(self, *args, **kwargs)
        seen.append({"dtypes": {n: p.dtype for n, p in self.model.named_parameters()},
                     "optimizer": type(self.optimizer).__name__,
                     "params": {n: p.detach().float().clone() for n, p in self.model.named_parameters()}})
        return out

    monkeypatch.setattr(trainer.Trainer, "train_step", recording_train_step)
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        distributed_utils.call_main(convert_namespace_to_omegaconf(args), fairseq_cli_train.main)
    records = {}
    for record in caplog.records:
        if record.name in ("train_inner", "train"):
            records.setdefault(record.name, []).append(json.loads(record.getMessage()))
    return records, seen, "\n".join(r.getMessage() for r in caplog.records)


PRECISIONS = {
    # --bf16: a bfloat16 model (fairseq's FP16Optimizer, fp32 master copy; on a CPU fairseq needs
    # unflattened grads, docs/precision.md); --amp: float32 weights, AMPOptimizer (autocast on a GPU)
    "bf16": (["--bf16", "--fp16-no-flatten-grads"], torch.bfloat16, "FP16Optimizer"),
    "amp": (["--amp"], torch.float32, "AMPOptimizer"),
}
NORMS = {"dyt": (["--dyt"], "alpha"), "rmsnorm": (["--rmsnorm"], None)}


@pytest.mark.parametrize("precision,norm", [("bf16", "dyt"), ("bf16", "rmsnorm"), ("amp", "rmsnorm")])
def test_dyt_and_rmsnorm_train_in_bf16_and_amp(norm, precision, tiny_bin, tmp_path, caplog, monkeypatch):
    """8 updates of 600-token batches (half COMMON's: 3 CPU s less for the three): the loss falls
    and stays finite, the model runs in the precision's dtype with DyT's alpha in float32 (and
    moving), and the checkpoint is finite."""
    monkeypatch.setenv("NORMPLUG_COMPILE", "0")  # eager half-precision kernels: no compile time
    flags, dtype, optimizer = PRECISIONS[precision]
    norm_flags, scalar = NORMS[norm]
    records, seen, _ = fairseq_train([tiny_bin, *COMMON, "--prenorm", *norm_flags, *flags, "--max-update", "8",
                                      "--max-tokens", "600", "--save-dir", str(tmp_path)], caplog, monkeypatch)
    losses = [float(r["loss"]) for r in records["train_inner"]]
    assert [int(r["num_updates"]) for r in records["train_inner"]] == list(range(1, 9))
    assert all(loss == loss and loss < 20 for loss in losses) and losses[-1] < losses[0] - 0.5, losses
    assert len(seen) == 8 and {s["optimizer"] for s in seen} == {optimizer}
    dtypes = seen[-1]["dtypes"]
    assert dtypes["encoder.layers.0.fc1.weight"] == dtype
    norm_weights = [n for n in dtypes if n.endswith("self_attn_layer_norm.weight")]
    assert norm_weights and all(dtypes[n] == dtype for n in norm_weights)
    if scalar:
        alphas = [n for n in dtypes if n.endswith(f".{scalar}")]
        assert len(alphas) == 12 and all(dtypes[n] == torch.float32 for n in alphas)
        first, last = seen[0]["params"], seen[-1]["params"]
        assert all(not torch.equal(first[n], last[n]) for n in alphas)  # trained in float32
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)["model"]
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


QKNORM = ["--prenorm", "--qknorm"]


def qknorm_gains(params):
    return {n: v.item() for n, v in params.items() if n.endswith(".g")}


@pytest.mark.slow  # trains for more than about 10 s
def test_qknorm_run_resumes_exactly(tiny_bin, tmp_path, caplog, monkeypatch):
    """QKNorm stopped at update 3 and resumed to 6 ends with exactly the parameters of a run
    straight to 6: the resumed model takes the learned g from the checkpoint (not g0 again),
    and the checkpoint keeps g0 = log2(L^2 - L) of the training data."""
    expected_g0 = qknorm_g0(length_percentile(training_target_lengths(tiny_bin, "src", "tgt")))
    _, whole, _ = fairseq_train([tiny_bin, *COMMON, *QKNORM, "--max-update", "6", "--save-dir", str(tmp_path / "a")],
                                caplog, monkeypatch)
    _, first, _ = fairseq_train([tiny_bin, *COMMON, *QKNORM, "--max-update", "3", "--save-dir", str(tmp_path / "b")],
                                caplog, monkeypatch)
    stopped = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "b" / "checkpoint_last.pt"))
    assert stopped["cfg"]["model"].qknorm_g0 == pytest.approx(expected_g0)
    saved_g = {n: v.item() for n, v in stopped["model"].items() if n.endswith(".g")}
    assert len(saved_g) == 6 and saved_g == qknorm_gains(first[-1]["params"])
    assert all(g != pytest.approx(expected_g0, abs=1e-7) for g in saved_g.values())  # g learned
    records, resumed, log = fairseq_train([tiny_bin, *COMMON, *QKNORM, "--max-update", "6",
                                           "--save-dir", str(tmp_path / "b")], caplog, monkeypatch)
    assert "@ 3 updates" in log and [int(r["num_updates"]) for r in records["train_inner"]] == [4, 5, 6]
    assert len(resumed) == 3
    final, straight = resumed[-1]["params"], whole[-1]["params"]
    assert final.keys() == straight.keys()
    for name in straight:
        assert torch.equal(final[name], straight[name]), name
    after = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "b" / "checkpoint_last.pt"))
    assert after["cfg"]["model"].qknorm_g0 == pytest.approx(expected_g0)
