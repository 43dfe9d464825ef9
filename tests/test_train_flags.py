"""``--train-flags`` cannot change what the runner sets in every run's command (issue 53): the
checkpoint folder (``--save-dir``: the run would end "trained, not evaluated" with no cause),
the seed (each run's is its folder's, ``--seeds``) and the data path (fairseq-train's
positional argument) are refused in one line before anything trains, also with
``--print-commands`` and ``--preflight``, and by train.sh."""
import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import reproduce, single_run
from fairseq_normplug.experiments.runner import train_flags

OWNED = [
    ("--save-dir /tmp/elsewhere", "--save-dir is set by the runner: each run keeps its checkpoints in its own folder"),
    ("--max-update 10 --save-dir=/tmp/elsewhere", "--save-dir is set by the runner"),
    ("--seed 7", "--seed is set by the runner: each run trains with its own seed, the one its folder is named "
                 "after (reproduce.sh --seeds N [N ...])"),
    ("data-bin/gl-en --max-update 10", "'data-bin/gl-en' is a data path, which the runner gives every run"),
    ("--fp16 --max-update 10 ../other/bin", "'../other/bin' is a data path"),
]


@pytest.mark.parametrize("mode", ["--print-commands", "--preflight", None])
@pytest.mark.parametrize("flags,message", OWNED, ids=[f for f, _ in OWNED])
def test_runner_owned_flags_are_refused_before_any_work(tmp_path, flags, message, mode):
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_:
        reproduce.main(["table3", "gl-en", "--seeds", "1", "2", "--runs-dir", str(runs),
                        "--results-dir", str(tmp_path / "results"), "--train-flags", flags,
                        *([mode] if mode else [])])
    text = str(exit_.value.code)
    assert text.startswith(f"reproduce.sh: error: --train-flags {flags!r}: ") and message in text
    assert "\n" not in text and not runs.exists() and not (tmp_path / "results").exists()


def test_train_sh_refuses_them_too(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        single_run.train_main(["table3", "PostNorm + LayerNorm", str(tmp_path / "data"), "--run-dir",
                               str(tmp_path / "run"), "--train-flags", "--save-dir /tmp/x"])
    assert str(exit_.value.code).startswith("train.sh: error: --train-flags '--save-dir /tmp/x': --save-dir is set")
    assert not (tmp_path / "run").exists()


def test_a_prepared_data_folder_is_a_data_path_anywhere(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dict.gl.txt").write_text("a 1\n")
    with pytest.raises(NormplugError, match=r"is a data path"):
        train_flags(f"--fp16 {tmp_path}")


@pytest.mark.parametrize("flags", ["--taper-updates 1 2", "--adam-betas '(0.9, 0.98)' --fp16",
                                   "--max-update 10 --lr 1e-3", "--eval-bleu-args '{\"beam\": 4}'",
                                   "--tensorboard-logdir tb --seed-norm-heads 2", ""])
def test_other_flags_pass(flags):
    assert train_flags(flags) == __import__("shlex").split(flags)
