"""inv_sqrt_decay / val_decay through fairseq-train (in this process, tests/inprocess.py) on the
tiny generated corpus:
mid-epoch validations drive decays, NoWarmup starts at --lr, training stops at the lr floor
mid-epoch, a resumed run continues the schedule, bad flags fail with one line."""
import os
import re

import pytest
import torch

from conftest import REPO, cli
from inprocess import run_fairseq

import fairseq_normplug  # noqa: F401  (allow-lists checkpoint classes for torch.load)

USER_DIR = os.path.join(REPO, "fairseq_normplug")
# d = 32 comes from --encoder-embed-dim (no --lr-d-model anywhere below)
TINY = [
    "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "src",
    "--target-lang", "tgt", "--arch", "transformer_tiny", "--encoder-embed-dim", "32",
    "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-attention-heads", "2",
    "--decoder-attention-heads", "2", "--optimizer", "adam",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--cpu", "--num-workers", "0", "--seed", "1", "--no-epoch-checkpoints",
    "--log-format", "simple", "--log-interval", "1", "--no-progress-bar",
]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train_many(runs):
    """Run several independent fairseq-train commands (list of (data, save_dir, flags)) one
    after the other; return their CompletedProcess objects in order."""
    return [run_fairseq([cli("fairseq-train"), data, *TINY, "--save-dir", str(save), *flags], check=False, env=ENV)
            for data, save, flags in runs]


def train(data, save, flags, check=True):
    proc = train_many([(data, save, flags)])[0]
    if check and proc.returncode != 0:
        raise AssertionError(f"fairseq-train failed ({proc.returncode})\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def log(proc):
    return proc.stdout + proc.stderr


def inner_lrs(proc):
    """{num_updates: lr} from the train_inner lines (the lr of the *next* update)."""
    return {int(n): float(lr) for n, lr in
            re.findall(r"\| train_inner \|.* num_updates=(\d+), lr=([0-9.e+-]+)", log(proc))}


def epoch_sizes(proc):
    return {int(t) for t in re.findall(r"\| train_inner \| epoch \d+: +\d+ / (\d+) ", log(proc))}


def valid_metric(proc, name):
    """{num_updates: value} from fairseq's validation lines."""
    out = {}
    for line in log(proc).splitlines():
        if "| valid on 'valid' subset |" in line:
            value = re.search(rf"\| {name} ([0-9.e+-]+) ", line).group(1)
            out[int(re.search(r"\| num_updates (\d+)", line).group(1))] = float(value)
    return out


def decays_logged(proc):
    """[(update, lr before, lr after)] from our log lines."""
    return [(int(u), float(a), float(b)) for u, a, b in re.findall(
        r"val_decay: update (\d+): .*: decay #\d+, lr ([0-9.e+-]+) -> ([0-9.e+-]+)", log(proc))]


def scheduler_state(save_dir):
    state = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), weights_only=True)
    last = state["optimizer_history"][-1]
    return last["num_updates"], last["lr_scheduler_state"]


def test_nowarmup_bleu_mid_epoch_decays_and_lr_floor_stop(tiny_bin, tmp_path):
    """NoWarmup (--warmup-updates 0) at --lr 1e-3 with dev BLEU as the metric, a validation
    every 2 updates, patience 0 (every validation decays, by 0.5): 1e-3 -> 5e-4 -> 2.5e-4 ->
    1.25e-4 < --stop-lr 2e-4 at update 6, far from the end of the 40-update epoch."""
    save = tmp_path / "nowarmup"
    proc = train(tiny_bin, save, [
        "--lr-scheduler", "val_decay", "--warmup-updates", "0", "--lr", "1e-3",
        "--lr-patience", "0", "--lr-decay", "0.5", "--stop-lr", "2e-4",
        "--validate-interval-updates", "2", "--max-tokens", "500", "--max-update", "50",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}',
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"])
    text = log(proc)
    assert "val_decay: NoWarmup: constant lr 0.001 (--lr) from update 1" in text
    lrs = inner_lrs(proc)
    # train_inner is logged before the validation that follows the same update
    assert [lrs[n] for n in range(1, 7)] == [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4]
    assert decays_logged(proc) == [(2, 1e-3, 5e-4), (4, 5e-4, 2.5e-4), (6, 2.5e-4, 1.25e-4)]
    assert "valid bleu" in text  # the decisions read dev BLEU
    assert "val_decay: stopping training after update 6: lr 0.000125 < --stop-lr 0.0002" in text
    assert max(lrs) == 6  # stopped right away ...
    (epoch_size,) = epoch_sizes(proc)
    assert epoch_size > 20  # ... mid-epoch, not at the epoch boundary
    num_updates, state = scheduler_state(save)
    assert num_updates == 6
    bleu = valid_metric(proc, "bleu")
    assert [[u, m] for u, m in state["history"]] == [[u, bleu[u]] for u in (2, 4, 6)]
    assert state["flat_lr"] == 1.25e-4 and len(state["decays"]) == 3


def test_val_decay_resume_continues_the_schedule(tiny_bin, tmp_path):
    """ValDecay with warmup to the eq. 7 peak (lambda 0.02, d = 32 from the model, 4 warmup
    updates), validations every 3 updates and at each epoch end, patience 2,
    and the loss *maximised*, so a falling loss counts as getting worse. One run goes to
    update 14; another stops at 9 and is resumed from checkpoint_last.pt to 14: the resumed
    run must take the same decisions, which depend on validations made before the stop.
    (The resumed run's losses may differ from the uninterrupted run's in the 3rd decimal;
    the losses compared here differ by >= 0.02.)"""
    flags = ["--lr-scheduler", "val_decay", "--warmup-updates", "4", "--lr-lambda", "0.02",
             "--lr-patience", "2", "--lr-decay", "0.5", "--stop-lr", "0",
             "--maximize-best-checkpoint-metric", "--validate-interval-updates", "3",
             "--max-tokens", "3000"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    ref, first = train_many([(tiny_bin, whole, flags + ["--max-update", "14"]),
                             (tiny_bin, split, flags + ["--max-update", "9"])])
    for proc in (ref, first):
        assert proc.returncode == 0, log(proc)[-3000:]
    n_first, state_first = scheduler_state(split)
    assert n_first == 9
    resumed = train(tiny_bin, split, flags + ["--max-update", "14"])

    # warmup follows eq. 7 with d = 32 read from the model: lr(n) = 0.02 * 32^-0.5 * n * 4^-1.5
    peak = 0.02 * 32 ** -0.5 * 4 ** -0.5
    lrs = inner_lrs(ref)
    for n in (1, 2, 3):  # logged after update n: the lr of update n + 1
        assert lrs[n] == pytest.approx(0.02 * 32 ** -0.5 * (n + 1) * 4 ** -1.5, rel=1e-5)
    assert lrs[3] == pytest.approx(peak, rel=1e-5)

    (epoch_size,) = epoch_sizes(ref)
    _, state_ref = scheduler_state(whole)
    n_resumed, state_resumed = scheduler_state(split)
    assert n_resumed == 14
    updates = [u for u, _ in state_ref["history"]]
    # every validation counted once: mid-epoch ones, epoch ends (also reported by lr_step)
    assert updates == sorted(set(updates))
    expected = {3, 6, 9, 12, 14} | {e for e in (epoch_size, 2 * epoch_size) if e <= 14}
    assert updates == sorted(expected)
    assert epoch_size % 3 != 0, "precondition: an epoch end between the 3-update validations"
    assert updates[0] == 3  # made during warmup: recorded, no decision
    assert all(u >= 4 for u, _, _ in state_ref["decays"])
    losses = [m for _, m in state_ref["history"]]
    assert losses == sorted(losses, reverse=True), "precondition: the valid loss keeps falling"
    # maximised, a falling loss is worse each time: decay once 2 previous exist, after warmup
    assert [u for u, _, _ in state_ref["decays"]] == [u for i, u in enumerate(updates)
                                                      if i >= 2 and u >= 4]

    # the restored state is exactly what was saved at the stop
    assert (f"val_decay: restored at update 9: lr {state_first['flat_lr']:.6g}, "
            f"{len(state_first['history'])} validations") in log(resumed)
    assert inner_lrs(resumed)[10] == pytest.approx(state_first["flat_lr"], rel=1e-5)
    k = len(state_first["history"])
    assert state_resumed["history"][:k] == state_first["history"]
    assert state_resumed["decays"][:len(state_first["decays"])] == state_first["decays"]
    # ... and the resumed run decides like the uninterrupted one
    assert state_resumed["decays"] == state_ref["decays"]
    assert [u for u, _ in state_resumed["history"]] == updates
    assert [m for _, m in state_resumed["history"]] == pytest.approx(
        [m for _, m in state_ref["history"]], abs=0.02)
    assert any(u > 9 for u, _, _ in state_resumed["decays"])
    later = [d for d in state_ref["decays"] if d[0] > 9]
    logged = decays_logged(resumed)
    assert [u for u, _, _ in logged] == [u for u, _, _ in later]
    assert [b for _, _, b in logged] == pytest.approx([b for _, _, b in later], rel=1e-5)


def test_inv_sqrt_decay_zero_warmup_and_lr_floor(tiny_bin, tmp_path):
    """InvSqrtDecay with --warmup-updates 0 (fairseq's inverse_sqrt divides by zero there):
    lr(n) = 0.01 * (32 n)^-0.5 with d = 32 from the model; lr(4) = 8.8e-4 < --stop-lr 1e-3,
    so training stops after update 3."""
    save = tmp_path / "invsqrt"
    proc = train(tiny_bin, save, [
        "--lr-scheduler", "inv_sqrt_decay", "--warmup-updates", "0", "--lr-lambda", "0.01",
        "--stop-lr", "1e-3", "--validate-interval-updates", "2", "--max-tokens", "500",
        "--max-update", "50"])
    lrs = inner_lrs(proc)
    assert sorted(lrs) == [1, 2, 3]
    for n, lr in lrs.items():
        assert lr == pytest.approx(0.01 * (32 * (n + 1)) ** -0.5, rel=1e-5)
    text = log(proc)
    assert "inv_sqrt_decay: update 2: valid loss" in text  # each validation logs the lr
    assert "inv_sqrt_decay: stopping training after update 3" in text
    assert scheduler_state(save)[0] == 3


def test_bad_flags_fail_with_one_line_before_training(tiny_bin, tmp_path):
    bad_decay, no_valid = train_many([
        (tiny_bin, tmp_path / "a", ["--lr-scheduler", "val_decay", "--lr-decay", "1.5",
                                    "--max-tokens", "500", "--max-update", "5"]),
        (tiny_bin, tmp_path / "b", ["--lr-scheduler", "val_decay", "--disable-validation",
                                    "--max-tokens", "500", "--max-update", "5"]),
    ])
    for proc, words in ((bad_decay, ["--lr-decay", "1.5", "(0, 1)"]),
                        (no_valid, ["val_decay", "--disable-validation"])):
        assert proc.returncode == 2, log(proc)[-3000:]
        # the plugin's one line ends stderr (fairseq's hydra may print deprecation warnings
        # before it, once the configuration is composed); no traceback
        lines = proc.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("fairseq-normplug: error: ")]
        assert errors == lines[-1:] and "Traceback" not in proc.stderr, proc.stderr
        assert all(w in lines[-1] for w in words)
        assert "begin training epoch" not in proc.stdout
    # a bad value fails at argument time: before fairseq-train even prints its config
    assert "fairseq_cli.train" not in bad_decay.stdout
    assert not os.path.exists(os.path.join(tmp_path, "a", "checkpoint_last.pt"))
