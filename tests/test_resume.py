"""Resuming reproduces the run (``--task translation_normplug``, ``--resume-batches``): a run
resumed from an epoch-end or a mid-epoch checkpoint is bit-identical to the uninterrupted
run (parameters after every update, every micro-batch's training loss), with dropout, word
dropout and --update-freq 2 on, over two epochs of the tiny model. fairseq-train runs
in-process; the resumed runs start from the uninterrupted run's own checkpoints."""
import contextlib
import hashlib
import os
import shutil

import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.tasks.translation import TranslationTask
from fairseq.trainer import Trainer
from fairseq_cli import train as fairseq_train

from conftest import REPO
from model_helpers import build
from fairseq_normplug.tasks.resume_batches import first_epoch_seeds
from fairseq_normplug.tasks.translation_normplug import TranslationNormplugTask

TINY = "transformer_normplug_tiny"
SEED = 3
#: 2,000 pairs of ~9.5 tokens at 2,000 tokens a batch: 11 batches, 6 updates an epoch
TRAIN_FLAGS = ["--optimizer", "adam", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
               "--dropout", "0.3", "--word-dropout", "0.1", "--max-tokens", "2000", "--update-freq", "2",
               "--seed", str(SEED), "--max-epoch", "2", "--log-format", "json", "--log-interval", "1",
               "--num-workers", "0", "--required-batch-size-multiple", "1", "--disable-validation"]


def _digest(model) -> str:
    h = hashlib.sha1()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _recording(records):
    """Append (update, [exact loss of each micro-batch], parameter digest) after every update."""
    micro = []
    task_step, trainer_step = TranslationNormplugTask.train_step, Trainer.train_step

    def task_train_step(self, *args, **kwargs):
        out = task_step(self, *args, **kwargs)
        micro.append(float(out[0]))
        return out

    def trainer_train_step(self, *args, **kwargs):
        out = trainer_step(self, *args, **kwargs)
        records.append((self.get_num_updates(), list(micro), _digest(self.model)))
        micro.clear()
        return out

    TranslationNormplugTask.train_step, Trainer.train_step = task_train_step, trainer_train_step
    try:
        yield
    finally:
        TranslationNormplugTask.train_step, Trainer.train_step = task_step, trainer_step


def train_in_process(data_bin, save_dir, *flags):
    """fairseq-train's main in this process; its per-update records."""
    for function in (checkpoint_utils.save_checkpoint, fairseq_train.should_stop_early):
        for attribute in ("best", "num_runs"):  # fairseq keeps these across calls in one process
            if hasattr(function, attribute):
                delattr(function, attribute)
    argv = [data_bin, "--user-dir", os.path.join(REPO, "fairseq_normplug"), "--task", "translation_normplug",
            "--arch", TINY, "--cpu", "--save-dir", save_dir, *TRAIN_FLAGS, *flags]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    records = []
    with _recording(records):
        fairseq_train.main(args)
    return records


def _parameters(path):
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_bin, tmp_path_factory):
    """Two epochs without a stop; it keeps its end-of-epoch-1 and update-8 checkpoints."""
    save_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    records = train_in_process(tiny_bin, save_dir, "--save-interval-updates", "8")
    return save_dir, records


def resume_from(tiny_bin, checkpoint, save_dir):
    os.makedirs(save_dir)
    shutil.copyfile(checkpoint, os.path.join(save_dir, "checkpoint_last.pt"))
    return train_in_process(tiny_bin, save_dir, "--no-epoch-checkpoints")


def _assert_continues(uninterrupted, resumed, first_update):
    save_dir, full = uninterrupted
    expected = [record for record in full if record[0] >= first_update]
    assert [r[0] for r in resumed] == [r[0] for r in expected] == list(range(first_update, 13))
    for got, want in zip(resumed, expected):
        assert got[1] == want[1], f"update {got[0]}: micro-batch losses {got[1]} != {want[1]}"
        assert got[2] == want[2], f"update {got[0]}: parameters differ"


def test_epoch_end_resume_is_bit_identical(uninterrupted, tiny_bin, tmp_path):
    save_dir, full = uninterrupted
    state = torch.load(os.path.join(save_dir, "checkpoint1.pt"), map_location="cpu", weights_only=False)
    assert state["extra_state"]["train_iterator"]["epoch"] == 2  # resumed at the start of epoch 2
    assert [len(r[1]) for r in full[:6]] == [2, 2, 2, 2, 2, 1]  # 11 batches, --update-freq 2
    resumed = resume_from(tiny_bin, os.path.join(save_dir, "checkpoint1.pt"), str(tmp_path / "run"))
    _assert_continues(uninterrupted, resumed, first_update=7)
    final, expected = _parameters(tmp_path / "run" / "checkpoint_last.pt"), _parameters(
        os.path.join(save_dir, "checkpoint_last.pt"))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_mid_epoch_resume_is_bit_identical(uninterrupted, tiny_bin, tmp_path):
    save_dir, _ = uninterrupted
    checkpoint = os.path.join(save_dir, "checkpoint_2_8.pt")
    iterator = torch.load(checkpoint, map_location="cpu", weights_only=False)["extra_state"]["train_iterator"]
    assert (iterator["epoch"], iterator["iterations_in_epoch"]) == (2, 4)  # 2 updates x 2 batches into epoch 2
    resumed = resume_from(tiny_bin, checkpoint, str(tmp_path / "run"))
    _assert_continues(uninterrupted, resumed, first_update=9)
    final, expected = _parameters(tmp_path / "run" / "checkpoint_last.pt"), _parameters(
        os.path.join(save_dir, "checkpoint_last.pt"))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def _iterator(task, epoch, seed=SEED, stock=False, **kwargs):
    task.dataset_to_epoch_iter = {}  # a fresh process: nothing cached yet
    get = TranslationTask.get_batch_iterator if stock else TranslationNormplugTask.get_batch_iterator
    return get(task, task.dataset("train"), max_tokens=2000, seed=seed, epoch=epoch,
               max_positions=(1024, 1024), **kwargs)


def _batches(iterator, epoch=None):
    """The iterator's frozen batches, or its batches of ``epoch`` in their shuffled order."""
    batches = iterator.frozen_batches if epoch is None else iterator.ordered_batches(epoch, False, True)
    return [list(map(int, batch)) for batch in batches]


def test_batches_are_built_as_at_epoch_one(tiny_bin):
    """What the fix does to fairseq's iterator: at a later epoch the batches and the shuffle
    seed are those of epoch 1 (stock fairseq's differ); epoch 1 and iterators fairseq rebuilds
    every epoch are stock; --update-ordered-indices-seed and --resume-batches fairseq."""
    _, task, _ = build(tiny_bin, TINY, task="translation_normplug")
    task.load_dataset("train")
    first = _iterator(task, 1)
    stock_first = _iterator(task, 1, stock=True)
    assert _batches(first) == _batches(stock_first) and first.seed == SEED
    later = _iterator(task, 3)
    assert _batches(later) == _batches(first) and later.seed == SEED
    assert _batches(later, 3) == _batches(first, 3)
    stock_later = _iterator(task, 3, stock=True)
    assert _batches(stock_later) != _batches(first)  # the bug: other sentences per batch
    rebuilt = _iterator(task, 3, disable_iterator_cache=True)  # sharded data: rebuilt every epoch
    assert _batches(rebuilt) == _batches(stock_later)
    task.cfg.update_ordered_indices_seed = True  # the trainer passes --seed + epoch
    shifted = _iterator(task, 3, seed=SEED + 3)
    assert _batches(shifted) == _batches(_iterator(task, 1, seed=SEED + 1, stock=True))
    assert shifted.seed == SEED + 1
    task.cfg.update_ordered_indices_seed = False
    task.cfg.resume_batches = "fairseq"
    assert _batches(_iterator(task, 3)) == _batches(stock_later)
    assert first_epoch_seeds(5, 1) == (5, 5) and first_epoch_seeds(5, 4) == (2, 5)
