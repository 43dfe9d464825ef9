"""QKNorm (Henry, Dachapally, Pawar & Chen 2020, "Query-Key Normalization for Transformers",
Findings of EMNLP 2020, arXiv:2010.04245), section 3:

    attention(Q, K, V) = softmax(g * Q_hat K_hat^T) V,   Q_hat, K_hat = Q, K l2-normalised per head

g is one learnable scalar per attention layer (the authors' ``ScaleUp`` module, one per
``MultiheadAttention``) replacing 1/sqrt(d_k), initialised to

    g0 = log2(L^2 - L)

with L the 97.5th percentile of the training sequence lengths (the number of off-diagonal
entries of an L x L attention matrix, in bits).

fairseq's ``MultiheadAttention`` is reused unchanged: its q/k projections become
:class:`HeadNormProjection` (same parameter names, plus ``g`` on the query projection), its
scaling becomes 1, and its PyTorch/xFormers fast path (which reads the projection weights
directly and would skip the normalisation) is switched off, so training, validation and
incremental decoding all take the one path that calls the projections. Keys are normalised
inside the projection, so the incremental-decoding cache holds normalised keys.
"""
import logging
import math
import os
from typing import Iterable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fairseq_normplug.errors import NormplugError

logger = logging.getLogger(__name__)

#: the paper's percentile of the training lengths
LENGTH_PERCENTILE = 97.5


def qknorm_g0(length: float) -> float:
    """g0 = log2(L^2 - L) (Henry et al. 2020, section 3)."""
    if length <= 2:
        raise NormplugError(f"QKNorm needs a length percentile L > 2 for g0 = log2(L^2 - L), got {length}")
    return math.log2(length * length - length)


def length_percentile(lengths: Iterable[int], percentile: float = LENGTH_PERCENTILE) -> float:
    """The ``percentile``-th percentile of ``lengths`` (numpy's linear interpolation)."""
    return float(np.percentile(np.asarray(list(lengths), dtype=np.float64), percentile))


def training_target_lengths(data: str, src: str, tgt: str, split: str = "train") -> np.ndarray:
    """Target lengths (tokens including the end-of-sentence token, as binarized) of the
    training split of a fairseq translation data dir: ``train``, ``train1``, ... of the first
    data path. Every data-parallel rank reads the same files, so all get the same value."""
    from fairseq.data import indexed_dataset

    data_path = data.split(os.pathsep)[0]
    sizes: List[np.ndarray] = []
    for k in range(1000):
        split_k = split + (str(k) if k > 0 else "")
        found = None
        for a, b in ((src, tgt), (tgt, src)):
            prefix = os.path.join(data_path, f"{split_k}.{a}-{b}.{tgt}")
            impl = indexed_dataset.infer_dataset_impl(prefix)
            if impl is not None and indexed_dataset.dataset_exists(prefix, impl):
                found = indexed_dataset.make_dataset(prefix, impl)
                break
        if found is None:
            break
        sizes.append(np.array(found.sizes, dtype=np.int64))  # a copy: the mmap closes with `found`
    if not sizes:
        raise NormplugError(
            f"--qknorm: no binarized training target {split}.{src}-{tgt}.{tgt} in {data_path} to "
            f"compute g0 from; pass --qknorm-g0 X")
    return np.concatenate(sizes)


class HeadNormProjection(nn.Linear):
    """A q/k projection whose output is l2-normalised within each of ``num_heads`` heads;
    the query projection also multiplies by the learnable scalar ``g``. Built in the dtype and
    on the device of the projection it replaces (a float64 model keeps float64 weights)."""

    def __init__(self, linear: nn.Linear, num_heads: int, g0: Optional[float] = None, eps: float = 1e-6):
        like = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, **like)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
        self.num_heads = num_heads
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(float(g0), **like)) if g0 is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        heads = y.view(*y.shape[:-1], self.num_heads, -1)
        y = F.normalize(heads, p=2.0, dim=-1, eps=self.eps).view(y.shape)
        return y * self.g if self.g is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads={self.num_heads}" + (", scale=g" if self.g is not None else "")


def attention_modules(model) -> List[nn.Module]:
    """Every MultiheadAttention of the model: encoder and decoder self-attention, cross-attention."""
    found = []
    for stack in (model.encoder, model.decoder):
        for layer in stack.layers:
            found += [m for m in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None))
                      if m is not None]
    return found


def install_qknorm(model, g0: float) -> None:
    """Turn every attention of ``model`` into QKNorm attention with g initialised to ``g0``."""
    for attn in attention_modules(model):
        attn.q_proj = HeadNormProjection(attn.q_proj, attn.num_heads, g0=g0)
        attn.k_proj = HeadNormProjection(attn.k_proj, attn.num_heads)
        attn.scaling = 1.0  # g replaces 1/sqrt(d_k)
        # fairseq's fast paths (F.multi_head_attention_forward, xFormers) read q_proj.weight
        # directly; this switch (also fairseq's own, for pruned heads) makes every call take
        # the path that applies the projections as modules
        attn._set_skip_embed_dim_check()


def resolve_g0(args, task) -> float:
    """--qknorm-g0 if given, else log2(L^2 - L) from the training target lengths. ``args`` is
    read only: the caller writes the value back (models/args_writer.py) so checkpoints (and
    generate/hub loading) never need the data."""
    if getattr(args, "qknorm_g0", None) is not None:
        return float(args.qknorm_g0)
    cfg = getattr(task, "cfg", args)
    data = getattr(cfg, "data", None) or getattr(args, "data", None)
    src = getattr(cfg, "source_lang", None) or getattr(args, "source_lang", None)
    tgt = getattr(cfg, "target_lang", None) or getattr(args, "target_lang", None)
    if not (data and src and tgt):
        raise NormplugError("--qknorm: cannot find the training data to compute g0 from; pass --qknorm-g0 X")
    lengths = training_target_lengths(data, src, tgt, getattr(args, "train_subset", None) or "train")
    length = length_percentile(lengths)
    g0 = qknorm_g0(length)
    logger.info(f"QKNorm: {LENGTH_PERCENTILE}th percentile of {len(lengths)} training target lengths "
                f"L = {length:.2f}, g0 = log2(L^2 - L) = {g0:.4f}")
    return g0
