"""``--target-vocab-mask``: the output layer never gives probability to a type that never
occurs on the target side of the training data (the authors' ``mask_logit``,
tnq177/transformers_without_tears ``model.py`` ``logit_fn`` and ``preprocessing.py``).

With a joint vocabulary (``--share-all-embeddings``) the output layer scores every type of
both languages; the authors set the logits of the types their target-side training text never
contains to -1e9, so after the softmax those types have probability exactly 0. Which types are
allowed (``preprocessing.py``): every type of the target training text, plus end-of-sentence and
unknown; padding and beginning-of-sentence are masked.

Here the allowed set is read at model build time from the binarized training target data of
the task's data dir (``train.SRC-TGT.TGT``, ``train1``, ... of every ``:``-separated path; all
data-parallel ranks read the same files, so all agree) and kept as a bool buffer
``decoder.target_vocab_mask.allowed``. The buffer is saved in every checkpoint, and a loaded
checkpoint's buffer replaces the one computed at build time, so fairseq-generate,
fairseq-interactive and the hub decode without the training data.

The masked logits are set to -1e9, or the dtype's most negative finite value where -1e9 does not
fit (float16: -65504): finite in every precision (no NaN/Inf anywhere), and exp() of it, in the
float32 log-softmax fairseq computes, is exactly 0. Label smoothing must then be spread over the
allowed types only: ``--criterion masked_label_smoothed_cross_entropy``
(``criterions/masked_label_smoothed_cross_entropy.py``).
"""
import logging
import os
from typing import List, Optional

import numpy as np
import torch
from torch import nn

from fairseq_normplug.errors import NormplugError

logger = logging.getLogger(__name__)

#: the authors' masked logit (``model.py``: ``logits[:, ~logit_mask] = -1e9``)
MASKED_LOGIT = -1e9


def masked_logit_value(dtype: torch.dtype) -> float:
    """-1e9, or the dtype's most negative finite value when -1e9 does not fit (float16)."""
    return max(MASKED_LOGIT, torch.finfo(dtype).min)


def _training_target_datasets(data_path: str, src: str, tgt: str, split: str):
    """The binarized target sides ``split``, ``split1``, ... found in one data path."""
    from fairseq.data import indexed_dataset

    found = []
    for k in range(1000):
        split_k = split + (str(k) if k > 0 else "")
        dataset = None
        for a, b in ((src, tgt), (tgt, src)):
            prefix = os.path.join(data_path, f"{split_k}.{a}-{b}.{tgt}")
            impl = indexed_dataset.infer_dataset_impl(prefix)
            if impl is not None and indexed_dataset.dataset_exists(prefix, impl):
                dataset = indexed_dataset.make_dataset(prefix, impl)
                break
        if dataset is None:
            break
        found.append((prefix, dataset))
    return found


def _token_counts(dataset, vocab_size: int) -> np.ndarray:
    """How often each type occurs in ``dataset`` (every token, end-of-sentence included)."""
    buffer = getattr(dataset, "_bin_buffer", None)
    index = getattr(dataset, "_index", None)
    if buffer is not None and index is not None:  # mmap: the whole token array at once
        tokens = np.frombuffer(buffer, dtype=index.dtype)
    else:
        tokens = np.concatenate([dataset[i].numpy() for i in range(len(dataset))] or [np.zeros(0, np.int64)])
    return np.bincount(tokens.astype(np.int64), minlength=vocab_size)[:vocab_size]


def training_target_types(data: str, src: str, tgt: str, vocab_size: int,
                          split: str = "train") -> Optional[tuple]:
    """(bool array over the vocabulary: occurs in the training targets, files read), or None
    when no binarized training target split exists in any path of ``data``."""
    seen = np.zeros(vocab_size, dtype=bool)
    files: List[str] = []
    for data_path in data.split(os.pathsep):
        for prefix, dataset in _training_target_datasets(data_path, src, tgt, split):
            seen |= _token_counts(dataset, vocab_size) > 0
            files.append(prefix)
    return (seen, files) if files else None


def allowed_types(seen: np.ndarray, dictionary) -> torch.Tensor:
    """The authors' rule: the types seen on the target side, plus end-of-sentence and
    unknown; padding and beginning-of-sentence never."""
    allowed = torch.from_numpy(seen.copy())
    allowed[dictionary.eos()] = True
    allowed[dictionary.unk()] = True
    allowed[dictionary.pad()] = False
    allowed[dictionary.bos()] = False
    return allowed


def build_allowed_types(args, task) -> Optional[torch.Tensor]:
    """The allowed types of the task's training target data, or None when the data dir has
    none (then the mask must come from a checkpoint: fairseq-generate on a folder without
    the training files)."""
    cfg = getattr(task, "cfg", args)
    data = getattr(cfg, "data", None) or getattr(args, "data", None)
    src = getattr(cfg, "source_lang", None) or getattr(args, "source_lang", None)
    tgt = getattr(cfg, "target_lang", None) or getattr(args, "target_lang", None)
    dictionary = task.target_dictionary
    split = getattr(args, "train_subset", None) or "train"
    found = training_target_types(data, src, tgt, len(dictionary), split) if data and src and tgt else None
    if found is None:
        logger.info("--target-vocab-mask: no binarized training target %s.%s-%s.%s in %s; the mask "
                    "must come from the checkpoint that is loaded", split, src, tgt, tgt, data)
        return None
    seen, files = found
    allowed = allowed_types(seen, dictionary)
    logger.info("--target-vocab-mask: %d of %d types may be produced (the types of %s, plus %s and "
                "%s); the other logits are set to %g", int(allowed.sum()), len(dictionary),
                ", ".join(os.path.basename(f) for f in files), dictionary.eos_word,
                dictionary.unk_word, MASKED_LOGIT)
    return allowed


class TargetVocabMask(nn.Module):
    """Sets the logits of the types outside ``allowed`` to :func:`masked_logit_value`.

    ``allowed`` is a persistent bool buffer (saved in checkpoints). Built without one
    (``allowed=None``: no training data at hand), the module refuses to run until a state
    dict has been loaded into it."""

    def __init__(self, vocab_size: int, allowed: Optional[torch.Tensor] = None):
        super().__init__()
        self.ready = allowed is not None
        if allowed is None:
            allowed = torch.ones(vocab_size, dtype=torch.bool)
        if allowed.shape != (vocab_size,) or allowed.dtype != torch.bool:
            raise NormplugError(f"--target-vocab-mask: expected a bool mask of {vocab_size} types, "
                                f"got {tuple(allowed.shape)} {allowed.dtype}")
        self.register_buffer("allowed", allowed.clone())
        self.num_allowed = int(allowed.sum())  # a Python int: the loss needs no device sync
        self._masked = (None, None)  # (what it was computed from, the masked types' indices)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "allowed" in state_dict:
            self.ready = True
            self.num_allowed = int(state_dict[prefix + "allowed"].sum())

    def masked_index(self) -> torch.Tensor:
        """The indices of the masked types (a long tensor on ``allowed``'s device), recomputed
        only when ``allowed`` changes (a load, a move, an in-place edit)."""
        key = (self.allowed.data_ptr(), self.allowed._version, self.allowed.device)
        if self._masked[0] != key:
            self._masked = (key, torch.nonzero(~self.allowed).flatten())
        return self._masked[1]

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the masked columns set (in place: they are freshly computed; no
        gradient flows through the masked columns). ``index_fill_`` over the masked columns,
        not ``masked_fill_`` with the broadcast mask: the same values, several times faster on
        CPU, where ``masked_fill`` is a serial loop over every logit."""
        if not self.ready:
            raise NormplugError("--target-vocab-mask: the data dir has no binarized training targets to "
                                "build the mask from and no checkpoint was loaded; train on a data dir "
                                "with train.SRC-TGT.TGT or decode with --path CHECKPOINT")
        return logits.index_fill_(-1, self.masked_index(), masked_logit_value(logits.dtype))

    def extra_repr(self) -> str:
        return f"allowed={int(self.allowed.sum())}/{self.allowed.numel()}"


def model_target_vocab_mask(model) -> Optional[TargetVocabMask]:
    """The :class:`TargetVocabMask` of ``model`` (or of the model a wrapper holds), or None."""
    return getattr(getattr(model, "decoder", None), "target_vocab_mask", None)
