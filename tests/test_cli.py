"""The plugin through fairseq's command-line tools on a tiny generated corpus: in this process
(tests/inprocess.py), and as real commands where the process is the subject (marked slow)."""
import json
import os
import struct
import sys

import pytest
import torch

from conftest import REPO, cli, run_cli
import train_dump_params
from inprocess import run_fairseq, run_forked

USER_DIR = os.path.join(REPO, "fairseq_normplug")
TRAIN_COMMON = [
    "--user-dir", USER_DIR, "--task", "translation", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
    "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--clip-norm", "1.0",
    "--max-tokens", "1200", "--cpu", "--num-workers", "0", "--seed", "1", "--no-epoch-checkpoints",
    "--log-format", "json", "--log-interval", "10", "--disable-validation",
]
#: decodings bounded as the runner's dev decodes are (a barely trained model would go on to
#: fairseq's default of 200 tokens; the tiny corpus's sentences have at most 14)
SHORT_DECODES = ["--max-len-a", "1.2", "--max-len-b", "10"]
#: an in-process decode reads its batches in this process, as TRAIN_COMMON's trainings do:
#: fairseq's default (--num-workers 1) forks a data-loader worker that, when the finished
#: iterator is garbage-collected later in the test process, does not exit, and torch waits 5 s
#: for it before killing it
NO_LOADER_WORKERS = ["--num-workers", "0"]
#: half TRAIN_COMMON's batches, for a test of a run's course, logs and checkpoints rather than of
#: how well it translates (about 40 % less CPU a training)
HALF_BATCHES = ["--max-tokens", "600"]
COMBINATIONS = {
    "prenorm-scalenorm-fixnorm-smallinit": ["--prenorm", "--scalenorm", "--fixnorm", "--smallinit"],
    "postnorm-layernorm": [],
    "prenorm-dyt": ["--prenorm", "--dyt"],
}


def train(data_bin, save_dir, flags, max_update, arch="transformer_normplug_tiny", extra=()):
    args = [cli("fairseq-train"), data_bin, "--arch", arch, *TRAIN_COMMON, "--save-dir", str(save_dir),
            "--max-update", str(max_update), *flags, *extra]
    return run_fairseq(args)


def log_records(proc, tag):
    """The JSON records of one kind (train_inner, train, valid) from a fairseq log."""
    out = []
    for line in (proc.stdout + proc.stderr).splitlines():
        if f"| {tag} | " in line:
            out.append(json.loads(line.split(f"| {tag} | ", 1)[1]))
    return out


@pytest.fixture(scope="module")
def trained(tiny_bin, tmp_path_factory):
    """Each combination trained for 15 updates, logged every 5 (with TensorBoard logs), then
    resumed to 20, on HALF_BATCHES."""
    runs = {}
    for name, flags in COMBINATIONS.items():
        save_dir = tmp_path_factory.mktemp(name)
        first = train(tiny_bin, save_dir, flags, 15, extra=[*HALF_BATCHES, "--log-interval", "5",
                                                           "--tensorboard-logdir", str(save_dir / "tensorboard")])
        resumed = train(tiny_bin, save_dir, flags, 20, extra=HALF_BATCHES)
        runs[name] = (save_dir, first, resumed)
    return runs


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_train_and_resume(trained, name):
    save_dir, first, resumed = trained[name]
    assert os.path.exists(os.path.join(save_dir, "checkpoint_last.pt"))
    assert log_records(first, "train")[-1]["train_num_updates"] == "15"
    assert "Loaded checkpoint" in resumed.stdout + resumed.stderr
    assert "@ 15 updates" in resumed.stdout + resumed.stderr
    assert log_records(resumed, "train")[-1]["train_num_updates"] == "20"


def tensorboard_scalars(folder):
    """{tag: {step: value}} of the TensorBoard event files under ``folder`` (TFRecord framing:
    length, its CRC, an Event protobuf, its CRC)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_logdir_writes_the_logged_training_curve(trained):
    """The event files hold the numbers of the text log: every logged update's loss and lr."""
    save_dir, first, _ = trained["postnorm-layernorm"]
    assert "Please install tensorboardX" not in first.stdout + first.stderr
    inner = tensorboard_scalars(save_dir / "tensorboard" / "train_inner")
    records = log_records(first, "train_inner")
    assert [int(r["num_updates"]) for r in records] == [5, 10, 15]
    for key in ("loss", "lr", "gnorm"):
        assert sorted(inner[key]) == [5, 10, 15], key
        for record in records:  # the text log rounds to 3 decimals
            assert inner[key][int(record["num_updates"])] == pytest.approx(float(record[key]), abs=6e-4), key
    epoch = tensorboard_scalars(save_dir / "tensorboard" / "train")
    assert epoch["loss"][15] == pytest.approx(float(log_records(first, "train")[-1]["train_loss"]), abs=6e-4)


@pytest.fixture(scope="module")
def printed_user_dir(tmp_path_factory):
    """What the real ``fairseq-normplug-path`` prints in a folder outside the repository (run
    once for this module's tests of the README's ``--user-dir "$(fairseq-normplug-path)"``)."""
    return run_cli([cli("fairseq-normplug-path")], cwd=str(tmp_path_factory.mktemp("elsewhere"))).stdout.strip()


@pytest.mark.slow
def test_generate_elsewhere_needs_the_user_dir_as_the_readme_says(trained, tiny_bin, tmp_path, printed_user_dir):
    """README: outside the repository, pass --user-dir "$(fairseq-normplug-path)"; without
    it fairseq's torch.load refuses the checkpoint (nothing imported the plugin)."""
    save_dir, _, _ = trained["prenorm-scalenorm-fixnorm-smallinit"]
    user_dir = printed_user_dir
    command = [cli("fairseq-generate"), tiny_bin, "--path", str(save_dir / "checkpoint_last.pt"),
               "--beam", "2", "--cpu", "--gen-subset", "valid", "--max-tokens", "4000",
               "--required-batch-size-multiple", "1", *SHORT_DECODES]
    with_dir = run_cli(command + ["--user-dir", user_dir], cwd=str(tmp_path))
    assert len([line for line in with_dir.stdout.splitlines() if line.startswith("H-")]) == 100
    without = run_cli(command, cwd=str(tmp_path), check=False)
    assert without.returncode != 0
    assert "argparse.Namespace" in without.stderr


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_generate_from_checkpoint(trained, tiny_bin, name):
    save_dir, _, _ = trained[name]
    proc = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR, "--path",
                        os.path.join(save_dir, "checkpoint_last.pt"), "--beam", "4", "--cpu",
                        "--max-tokens", "4000", "--gen-subset", "test", *SHORT_DECODES, *NO_LOADER_WORKERS,
                        # fairseq's main branch drops the last batch unless it is a multiple of this
                        "--required-batch-size-multiple", "1"])
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 100
    assert not any("<pad>" in h for h in hypotheses)
    assert "BLEU4" in proc.stdout + proc.stderr


def test_interactive_and_hub_give_the_same_translation(trained, tiny_bin, tiny_raw):
    """fairseq-interactive and the hub translate a test sentence alike (same checkpoint,
    beam 2): the same hypothesis, with a finite log-probability score."""
    save_dir, _, _ = trained["prenorm-scalenorm-fixnorm-smallinit"]
    sentence = open(os.path.join(tiny_raw, "test.src")).readline()
    proc = run_fairseq([cli("fairseq-interactive"), tiny_bin, "--user-dir", USER_DIR, "--path",
                        os.path.join(save_dir, "checkpoint_last.pt"), "--beam", "2", "--cpu", "--source-lang", "src",
                        "--target-lang", "tgt", *NO_LOADER_WORKERS], input=sentence)
    (interactive,) = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("H-0\t")]
    _, score, text = interactive
    assert text.strip() and -1e3 < float(score) < 0

    from fairseq_normplug.models import TransformerNormplugModel

    hub = TransformerNormplugModel.from_pretrained(str(save_dir), checkpoint_file="checkpoint_last.pt",
                                                   data_name_or_path=tiny_bin, source_lang="src",
                                                   target_lang="tgt")
    assert type(hub.models[0]).__name__ == "TransformerNormplugModel"
    assert hub.translate(sentence.strip(), beam=2) == text


@pytest.mark.slow
def test_checkpoints_load_safely_only_through_the_plugin(trained, monkeypatch):
    """torch >= 2.6 loads with weights_only=True: the plugin allow-lists fairseq's classes.
    Without the plugin: a real process that imports only fairseq; with it: this process, which
    imported the plugin (torch reads its WEIGHTS_ONLY settings at each load)."""
    checkpoint = os.path.join(trained["prenorm-dyt"][0], "checkpoint_last.pt")
    code = ("import sys, torch; {imp}"
            "state = torch.load(sys.argv[1], map_location='cpu'); print(sorted(state)[:3])")
    env = {k: None for k in os.environ if "WEIGHTS_ONLY" in k}
    without = run_cli([sys.executable, "-c", code.format(imp="import fairseq; "), checkpoint],
                      check=False, env=env, timeout=300)
    assert without.returncode != 0 and "weights_only" in without.stderr
    import fairseq_normplug  # noqa: F401  (imported by the test process already: its allow-list)

    for key in env:
        monkeypatch.delenv(key)
    with_plugin = str(sorted(torch.load(checkpoint, map_location="cpu"))[:3])
    assert "cfg" in with_plugin


class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_the_runner_reads_checkpoints_safely(trained, tmp_path):
    """experiments.runner.selected_checkpoint: the update and dev score of a real checkpoint;
    a file that would run code when unpickled is refused, and the code does not run."""
    from fairseq_normplug.experiments.runner import selected_checkpoint

    save_dir, _, resumed = trained["prenorm-dyt"]
    assert selected_checkpoint(str(save_dir / "checkpoint_last.pt")) == {"selected_update": 20, "dev_bleu": None}
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"optimizer_history": [{"num_updates": 7}], "extra_state": {},
                "payload": RunsCodeWhenUnpickled(str(marker))}, evil)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        selected_checkpoint(str(evil))
    assert not marker.exists()


def test_eval_bleu_validation_and_best_checkpoint(tiny_bin, tmp_path):
    """Dev BLEU every 10 updates (and at the epoch's end, update 17); checkpoint_best.pt is the
    checkpoint of the best BLEU (ties: the later one, as fairseq compares with >=) and records
    that BLEU."""
    from fairseq_normplug.experiments.runner import selected_checkpoint

    flags = [f for f in TRAIN_COMMON if f != "--disable-validation"]
    proc = run_fairseq([cli("fairseq-train"), tiny_bin, "--arch", "transformer_normplug_tiny", *flags,
                        "--prenorm", "--scalenorm", "--fixnorm", "--save-dir", str(tmp_path), "--max-update", "30",
                        "--validate-interval-updates", "10", "--save-interval-updates", "10", "--eval-bleu",
                        "--eval-bleu-args", json.dumps({"beam": 1, "max_len_a": 1.2, "max_len_b": 10}), "--best-checkpoint-metric", "bleu",
                        "--maximize-best-checkpoint-metric"])
    valid = log_records(proc, "valid")
    curve = [(int(r["valid_num_updates"]), float(r["valid_bleu"])) for r in valid]
    assert [u for u, _ in curve] == [10, 17, 20, 30]
    assert all(0 <= bleu <= 100 for _, bleu in curve) and max(b for _, b in curve) > 0, curve
    running = [max(b for _, b in curve[:i + 1]) for i in range(len(curve))]
    # fairseq logs the best so far from the second validation on (after a first save)
    assert "valid_best_bleu" not in valid[0]
    assert [float(r["valid_best_bleu"]) for r in valid[1:]] == pytest.approx(running[1:])
    best = max(b for _, b in curve)
    expected = max(u for u, b in curve if b == best)
    assert selected_checkpoint(str(tmp_path / "checkpoint_best.pt")) == {
        "selected_update": expected, "dev_bleu": pytest.approx(best, abs=1e-6)}


@pytest.mark.slow
def test_a_longer_run_learns(tiny_bin, tmp_path):
    """150 updates: the loss of the last 10 falls below 0.6 of the first 10's (about 0.55)."""
    proc = train(tiny_bin, tmp_path, COMBINATIONS["prenorm-scalenorm-fixnorm-smallinit"], 150,
                 extra=["--no-save", "--log-interval", "10"])
    losses = [float(r["loss"]) for r in log_records(proc, "train_inner")]
    assert len(losses) >= 8
    assert losses[-1] < 0.6 * losses[0], losses


def test_norm_stats_are_logged(tiny_bin, tmp_path):
    proc = train(tiny_bin, tmp_path, ["--prenorm", "--dyt", "--norm-stats-interval", "10"], 20,
                 extra=["--no-save", *HALF_BATCHES])
    record = log_records(proc, "train_inner")[-1]
    assert float(record["alpha:enc0.attn"]) == pytest.approx(0.5, abs=0.05)
    assert float(record["in_std:dec.final"]) > 0 and "gain:dec1.ffn" in record


BAD_CLI = [
    (["--scalenorm", "--dyt"], "two norm types at once: --scalenorm and --dyt"),
    (["--dyt", "--dyt-alpha-init", "0"], "--dyt-alpha-init must be > 0, got 0.0"),
    (["--dyt-alpha-init", "auto"], "--dyt-alpha-init needs --norm-type dyt (or --dyt), got --norm-type layernorm"),
    (["--prenorm", "--postnorm"], "--prenorm contradicts --postnorm"),
]


@pytest.mark.parametrize("flags,message", BAD_CLI, ids=[" ".join(f) for f, _ in BAD_CLI])
def test_bad_input_on_the_command_line(tmp_path, flags, message):
    """A one-line error with exit status 2 and no traceback, before any data is read
    (the data directory does not even exist)."""
    proc = run_fairseq([cli("fairseq-train"), str(tmp_path / "no-such-data"), "--arch",
                        "transformer_normplug_tiny", *TRAIN_COMMON, *flags], check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-normplug: error:")]
    assert len(errors) == 1 and message in errors[0]


def train_data_parallel(data_bin, save_dir, flags, max_update, dump_dir=None, dump_at_update=None):
    """Two CPU processes (gloo) train one model data-parallel: fairseq-train's ranks, each a fork
    of this process (tests/inprocess.py's ``run_forked``: their own pids and gloo connections,
    without starting Python, torch and fairseq again) that saves its parameters to ``dump_dir``
    after every update (tests/train_dump_params.py; kept for ``dump_at_update``); returns their
    outputs. When one rank fails, the other (waiting for its peer) is killed at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [cli("fairseq-train"), data_bin, "--arch", "transformer_normplug_tiny", *TRAIN_COMMON, *flags,
              "--max-update", str(max_update), "--log-interval", "3",
              "--save-dir", str(save_dir), "--distributed-world-size", "2", "--distributed-backend", "gloo",
              "--ddp-backend", "legacy_ddp", "--distributed-no-spawn", "--device-id", "0",
              "--distributed-init-method", f"tcp://127.0.0.1:{port}"]
    dump_dir = dump_dir or os.path.join(str(save_dir), "params")
    os.makedirs(dump_dir, exist_ok=True)
    procs = run_forked([common + ["--distributed-rank", str(rank)] for rank in (0, 1)], cwd=REPO, peers=True,
                       at_start=train_dump_params.install,
                       env={"DUMP_PARAMS_DIR": str(dump_dir),
                            "DUMP_PARAMS_AT_UPDATE": None if dump_at_update is None else str(dump_at_update)})
    outputs = [p.stdout + p.stderr for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "training on 2 devices" in outputs[0]
    return outputs


def rank_parameters(dump_dir, update=None):
    """Both ranks' parameters after their last update (or after ``update``, kept by
    ``train_data_parallel``'s ``dump_at_update``); asserts that they are identical."""
    suffix = "" if update is None else f"-update{update}"
    ranks = [torch.load(os.path.join(dump_dir, f"rank{r}{suffix}.pt")) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    return ranks[0]


#: DyT with its data-driven alpha init, and the TED recipe's word dropout with two micro-batches
#: an update (word dropout's draws differ per rank and micro-batch and are seeded by the update
#: number: tasks/translation_normplug.py)
DATA_PARALLEL = ["--prenorm", "--dyt", "--dyt-alpha-init", "auto", "--task", "translation_normplug",
                 "--word-dropout", "0.1", "--update-freq", "2"]


@pytest.mark.slow
def test_data_parallel_on_cpu_with_gloo_agrees_and_resumes_exactly(tiny_bin, tmp_path):
    """Two CPU processes train one model data-parallel (docs/experiments.md). The ranks see
    different batches, yet --dyt-alpha-init auto chooses one alpha per norm for both, and
    after every update their parameters are identical. A run resumed at update 3 (from the
    checkpoint the uninterrupted run saved there, --save-interval-updates 3) and trained to 6
    (no second auto init) ends with exactly the parameters of the uninterrupted run. Two pairs
    of rank processes: the uninterrupted run and the resumed one."""
    import glob
    import shutil

    whole = train_data_parallel(tiny_bin, tmp_path / "whole", [*DATA_PARALLEL, "--save-interval-updates", "3"], 6,
                                dump_at_update=3)
    logged = [line for line in whole[0].splitlines() if "auto init of alpha" in line]
    assert len(logged) == 1 and "2 data-parallel ranks" in logged[0]
    assert '"train_num_updates": "6"' in whole[0]
    uninterrupted = rank_parameters(tmp_path / "whole" / "params")
    alphas = {k: v.item() for k, v in uninterrupted.items() if k.endswith(".alpha")}
    assert len(alphas) == 12 and all(abs(a - 0.5) > 1e-3 for a in alphas.values()), alphas
    (at_3,) = glob.glob(str(tmp_path / "whole" / "checkpoint_*_3.pt"))
    os.makedirs(tmp_path / "resumed")
    shutil.copyfile(at_3, tmp_path / "resumed" / "checkpoint_last.pt")
    after_3 = rank_parameters(tmp_path / "whole" / "params", update=3)
    dump = tmp_path / "resumed" / "params"
    resumed = train_data_parallel(tiny_bin, tmp_path / "resumed", DATA_PARALLEL, 6, dump_dir=dump)
    assert "@ 3 updates" in resumed[0] and '"train_num_updates": "6"' in resumed[0]
    assert "auto init" not in resumed[0]
    final = rank_parameters(dump)
    assert any(not torch.equal(after_3[k], final[k]) for k in final)  # it trained after resuming
    for name in uninterrupted:
        assert torch.equal(final[name], uninterrupted[name]), name


NEW_NORMS = {
    "derf": ["--norm-type", "derf", "--derf-alpha-init", "auto"],
    "dyisru": ["--norm-type", "dyisru"],
    "identity": ["--norm-type", "identity"],
}


@pytest.mark.slow
def test_new_norm_types_train_resume_and_generate(tiny_bin, tmp_path):
    """derf (with auto init), dyisru and identity: train, resume (no second auto init), and
    decode incrementally from the reloaded checkpoints (one ensemble of the three)."""
    checkpoints = []
    for name, flags in NEW_NORMS.items():
        first = train(tiny_bin, tmp_path / name, ["--prenorm", *flags], 4)
        assert log_records(first, "train")[-1]["train_num_updates"] == "4"
        assert ("auto init of alpha" in first.stdout + first.stderr) == (name == "derf")
        checkpoints.append(str(tmp_path / name / "checkpoint_last.pt"))
    resumed = train(tiny_bin, tmp_path / "derf", ["--prenorm", *NEW_NORMS["derf"]], 6)
    assert "@ 4 updates" in resumed.stdout + resumed.stderr
    assert "auto init" not in resumed.stdout + resumed.stderr
    assert log_records(resumed, "train")[-1]["train_num_updates"] == "6"
    proc = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR, "--path",
                        ":".join(checkpoints), "--beam", "2", "--cpu", "--max-tokens", "4000",
                        "--gen-subset", "valid", "--required-batch-size-multiple", "1", *SHORT_DECODES])
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 100 and not any("<pad>" in h for h in hypotheses)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["repository root, relative --user-dir", "elsewhere, fairseq-normplug-path"])
def test_user_dir_from_the_repository_and_from_anywhere(tmp_path, where, request):
    if where.startswith("repository"):
        cwd, user_dir = REPO, "fairseq_normplug"
    else:
        cwd = str(tmp_path)
        user_dir = request.getfixturevalue("printed_user_dir")
        assert os.path.samefile(user_dir, USER_DIR)
    # the plugin is loaded when its own flag validation answers
    proc = run_cli([cli("fairseq-train"), str(tmp_path / "data"), "--user-dir", user_dir, "--arch",
                    "transformer_normplug_tiny", "--scalenorm", "--rmsnorm", "--cpu"], cwd=cwd, check=False)
    assert proc.returncode == 2
    assert "fairseq-normplug: error: two norm types at once: --scalenorm and --rmsnorm" in proc.stderr
