"""The fairseq command lines the runner, the training benchmark and the GPU check build: the
program of this Python's environment, the data folder, the plugin as ``--user-dir`` and each
caller's flags, item for item (fairseq_normplug/fairseq_commands.py)."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from fairseq_normplug.errors import NormplugError

BIN = os.path.dirname(sys.executable)
PLUGIN = os.path.join(REPO, "fairseq_normplug")
TRAIN, GENERATE, PREPROCESS = (os.path.join(BIN, name) for name in
                               ("fairseq-train", "fairseq-generate", "fairseq-preprocess"))


def test_one_helper_builds_program_data_user_dir_then_flags(tmp_path):
    from fairseq_normplug.fairseq_commands import fairseq_arguments, fairseq_command, program_path

    assert program_path("fairseq-train") == TRAIN
    assert fairseq_command("fairseq-generate", "/d", "--path", "c.pt") == [
        GENERATE, "/d", "--user-dir", PLUGIN, "--path", "c.pt"]
    assert fairseq_command("fairseq-train", "/d", "--cpu", plugin=False) == [TRAIN, "/d", "--cpu"]
    assert fairseq_arguments("/d", "--arch", "a") == ["/d", "--user-dir", PLUGIN, "--arch", "a"]
    with pytest.raises(NormplugError, match=r"'fairseq-trian'.*fairseq-generate, fairseq-preprocess, fairseq-train"):
        program_path("fairseq-trian")


def _fixed_run(data_dir):
    from fairseq_normplug.experiments.configs import Recipe, Row, Schedule, Table
    from fairseq_normplug.experiments.runner import Run

    recipe = Recipe(name="fixed", arch="transformer_normplug_cpu", generate=["--max-tokens", "6000"],
                    train=["--max-tokens", "1000", "--max-update", "10", "--validate-interval-updates", "5"],
                    decoding={"beam": 4, "lenpen": 0.6})
    schedule = Schedule(name="warmup", flags=["--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
                                              "--lr", "5e-4"], warmup=4)
    row = Row(name="PreNorm", model=["--prenorm"], schedule="warmup")
    table = Table(name="fixed", title="Fixed", recipe=recipe, pairs=["de-en"], rows=[row],
                  schedules={"warmup": schedule})
    return Run(table=table, row=row, pair="de-en", data_dir=data_dir, run_dir=os.path.join(data_dir, "run"),
               seed=3, num_devices=1, assumed_subword="sentencepiece")


def test_the_runners_train_and_generate_commands(tmp_path):
    from fairseq_normplug.experiments.runner import generate_command

    data = str(tmp_path)
    run = _fixed_run(data)
    head = ["--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "de", "--target-lang", "en"]
    assert run.train_command(["--dropout", "0.2"]) == [
        TRAIN, f"{data}/bin", *head, "--arch", "transformer_normplug_cpu",
        "--max-tokens", "1000", "--max-update", "10", "--validate-interval-updates", "5",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4", "--lr", "5e-4", "--prenorm",
        "--eval-bleu", "--eval-tokenized-bleu", "--eval-bleu-args", '{"beam": 4, "lenpen": 0.6}',
        "--eval-bleu-remove-bpe", "sentencepiece", "--best-checkpoint-metric", "bleu",
        "--maximize-best-checkpoint-metric", "--save-dir", f"{data}/run/checkpoints", "--no-epoch-checkpoints",
        "--seed", "3", "--log-format", "json", "--num-workers", "0", "--required-batch-size-multiple", "1",
        "--dropout", "0.2", "--save-interval-updates", "5", "--keep-interval-updates", "1"]
    assert generate_command(run, "/c/best.pt", "valid") == [
        GENERATE, f"{data}/bin", *head, "--path", "/c/best.pt", "--gen-subset", "valid",
        "--beam", "4", "--lenpen", "0.6", "--remove-bpe", "sentencepiece", "--max-tokens", "6000",
        "--required-batch-size-multiple", "1"]


BENCH_TRAINING = [
    "--task", "translation", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100", "--criterion", "label_smoothed_cross_entropy",
    "--label-smoothing", "0.1", "--clip-norm", "1.0", "--max-tokens", "1024", "--seed", "1", "--max-update", "120",
    "--log-format", "json", "--log-interval", "10", "--disable-validation", "--no-save", "--num-workers", "0"]


def test_the_training_benchmarks_commands():
    """Stock fairseq gets no --user-dir; a plugin variant names it after its --arch."""
    from fairseq_normplug.bench.bench_train import train_command

    args = argparse.Namespace(device="cpu", max_tokens=1024, max_update=120, log_interval=10)
    assert train_command("/d", "stock", args) == [
        TRAIN, "/d", "--cpu", *BENCH_TRAINING, "--arch", "transformer",
        "--encoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
        "--encoder-layers", "3", "--decoder-embed-dim", "256", "--decoder-ffn-embed-dim", "1024",
        "--decoder-attention-heads", "4", "--decoder-layers", "3", "--share-decoder-input-output-embed"]
    args.device = "cuda"
    assert train_command("/d", "dyt", args) == [
        TRAIN, "/d", *BENCH_TRAINING, "--arch", "transformer_normplug_cpu", "--user-dir", PLUGIN,
        "--norm-type", "dyt"]


def test_the_training_benchmarks_preprocessing(tmp_path, monkeypatch):
    from fairseq_normplug.bench import bench_train

    commands = []
    monkeypatch.setattr(bench_train, "run_command", lambda cmd, **kwargs: commands.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0))
    dest = bench_train.prepare_data(str(tmp_path), 5)
    raw = str(tmp_path / "raw-5")
    assert commands == [[
        PREPROCESS, "--source-lang", "src", "--target-lang", "tgt", "--trainpref", f"{raw}/train",
        "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", dest, "--joined-dictionary",
        "--workers", "1"]]


def test_the_gpu_checks_train_and_generate_commands(tmp_path, monkeypatch):
    from fairseq_normplug.bench import gpu_check_training
    from fairseq_normplug.bench.check_report import Deadline, Report

    cfg = {"arch": "transformer_normplug_cpu", "lr": 1e-3, "updates": 10, "max_tokens": 100, "log_interval": 2}
    command = gpu_check_training.train_command("/d", "prenorm-scalenorm-fixnorm-smallinit", "bf16", cfg,
                                               torch.device("cpu"), "/s")
    assert command == [
        TRAIN, "/d", "--user-dir", PLUGIN, "--arch", "transformer_normplug_cpu", "--prenorm", "--scalenorm",
        "--fixnorm", "--smallinit", "--share-all-embeddings", "--bf16", "--cpu", "--task", "translation",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.001", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "5", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--clip-norm", "1.0", "--max-tokens", "100", "--seed", "1", "--max-update", "10", "--log-format", "json",
        "--log-interval", "2", "--disable-validation", "--num-workers", "0", "--required-batch-size-multiple", "1",
        "--save-dir", "/s", "--no-epoch-checkpoints"]
    cuda = gpu_check_training.train_command("/d", "prenorm-layernorm", "fp16", cfg, torch.device("cuda"), None)
    assert cuda[:7] == [TRAIN, "/d", "--user-dir", PLUGIN, "--arch", "transformer_normplug_cpu", "--prenorm"]
    assert cuda[7] == "--fp16" and "--cpu" not in cuda and cuda[-1] == "--no-save"

    checkpoint = tmp_path / "best.pt"
    checkpoint.write_bytes(b"")
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gpu_check_training, "run_command", fake_run)  # the one seam (command_start)
    gpu_check_training.run_generate(Report(), "/d", str(checkpoint), "fp16", torch.device("cpu"), Deadline(60))
    assert commands == [[
        GENERATE, "/d", "--user-dir", PLUGIN, "--path", str(checkpoint), "--fp16", "--cpu", "--beam", "4",
        "--gen-subset", "test", "--max-tokens", "8000", "--required-batch-size-multiple", "1"]]
