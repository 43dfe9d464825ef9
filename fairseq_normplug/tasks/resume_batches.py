"""Batches of a resumed run, as an uninterrupted run has them (``--resume-batches``).

What stock fairseq does (0.12, ``FairseqTask.get_batch_iterator``, ``fairseq_cli/train.py``,
``checkpoint_utils.load_checkpoint``, ``data/iterators.py``):

* The training iterator is built once, at the epoch training starts in, and cached for the
  life of the process (``dataset_to_epoch_iter``; the dataset allows it unless the data are
  sharded or ``--update-epoch-batch-itr`` / ``--grouped-shuffling`` is set). Building it fixes
  the batches: the indices are ordered under ``numpy_seed(seed + epoch)`` (the order of
  equal-length sentences is random) and packed into batches by ``--max-tokens``.
* Every later epoch reuses those batches and only shuffles their order, under
  ``numpy_seed(iterator.seed + epoch)``.
* An uninterrupted run builds its iterator at epoch 1. A run resumed from a checkpoint builds
  it at the checkpoint's epoch E (the next one for an end-of-epoch checkpoint), so from the
  resume on it trains on batches of other sentences (same count and sizes at best), and its
  parameters drift away from the uninterrupted run's from the first update after the resume.

What ``--resume-batches uninterrupted`` (the default of ``--task translation_normplug``) does:
when the iterator is one fairseq caches, it is built with the seed that makes
``seed + epoch`` the seed an uninterrupted run's epoch-1 batches were ordered with, then the
iterator's own shuffle seed is set back to the uninterrupted run's. The resumed run then
holds the same batches, in the same per-epoch order, as the uninterrupted run, so
(with fairseq's per-update ``--seed`` + update number for dropout and word dropout, and the
optimizer, LR-scheduler and iterator state in the checkpoint) it continues bit for bit,
mid-epoch or at an epoch end, with any ``--update-freq``. Nothing changes for a fresh run
(built at epoch 1), for validation and test iterators (always epoch 1), or where fairseq
rebuilds the batches every epoch anyway (sharded data, ``--update-epoch-batch-itr``): there
the uninterrupted and the resumed run already agree. ``--resume-batches fairseq`` keeps
stock fairseq's batches.
"""
from typing import NamedTuple

RESUME_BATCHES = ["uninterrupted", "fairseq"]


class IteratorSeeds(NamedTuple):
    """``batching``: the ``seed`` argument for fairseq's ``get_batch_iterator`` (it orders the
    indices under ``batching + epoch``); ``shuffle``: the built iterator's ``seed`` (the
    per-epoch shuffle uses ``shuffle + epoch``)."""
    batching: int
    shuffle: int


def first_epoch_seeds(seed: int, epoch: int, seed_includes_epoch: bool = False) -> IteratorSeeds:
    """The seeds that give an iterator built at ``epoch`` the batches and shuffle seed of the
    one an uninterrupted run built at epoch 1.

    ``seed`` is what fairseq's trainer passes for this epoch: ``--seed``, or ``--seed`` +
    epoch with ``--update-ordered-indices-seed`` (``seed_includes_epoch``). At epoch 1 the
    result is ``(seed, seed)``, i.e. stock fairseq."""
    epoch = max(epoch, 1)  # fairseq's iterators count epochs from 1
    first = seed - (epoch - 1) if seed_includes_epoch else seed  # the seed passed at epoch 1
    return IteratorSeeds(batching=first + 1 - epoch, shuffle=first)
