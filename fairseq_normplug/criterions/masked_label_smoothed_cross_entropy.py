"""``--criterion masked_label_smoothed_cross_entropy``: fairseq's label-smoothed cross
entropy with the smoothing spread over the types the model's ``--target-vocab-mask`` allows.

fairseq's ``label_smoothed_nll_loss`` sums -log p over the WHOLE vocabulary and gives every
other type eps / (V - 1). With masked types (log p ~ -1e9) that sum is dominated by them and
its gradient pulls every allowed logit up. Here, with A allowed types,

    loss = (1 - eps - eps_i) * nll + eps_i * sum_{allowed k} -log p_k,   eps_i = eps / (A - 1)

which is fairseq's formula with the vocabulary replaced by the allowed types (A = V gives
fairseq's loss exactly), the authors' "smoothing over the target language's types"
(tnq177/transformers_without_tears ``model.py``: the smoothing term is summed over the
``logit_mask`` types and divided by their number, eps / A with the target included; ours is
eps / (A - 1) over the others, fairseq's convention). A model without a mask is scored
exactly as by ``label_smoothed_cross_entropy`` (the parent's code runs).

A target the mask forbids (a dev or test token that never occurs in the training targets;
training targets never are) adds 0 to ``nll``, as in the authors' ``model.py``, where the
log-probabilities are multiplied by the mask before the target's is gathered. Its
log-probability is -1e9, and counting it would add about 1e9 / (number of tokens) to the
mean loss: the 5 such tokens among the 17,763 TED az-en dev target tokens made the dev loss
about 281,700.
"""
from typing import Optional

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from fairseq_normplug.modules.target_vocab_mask import model_target_vocab_mask


def masked_label_smoothed_nll_loss(lprobs: torch.Tensor, target: torch.Tensor, epsilon: float,
                                   allowed: torch.Tensor, ignore_index=None, reduce=True,
                                   num_allowed: Optional[int] = None,
                                   masked_index: Optional[torch.Tensor] = None):
    """fairseq's ``label_smoothed_nll_loss`` over the ``allowed`` types only (module docstring).
    ``lprobs``: (N, V); ``target``: (N,) or (N, 1); ``allowed``: (V,) bool; ``num_allowed``:
    its number of True entries, ``masked_index`` the indices of its False ones, if known (they
    save device syncs)."""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    # a forbidden target counts 0, the authors' choice (module docstring); in training no
    # target is forbidden and the values are unchanged
    nll_loss = nll_loss.masked_fill(~allowed[target], 0.0)
    if masked_index is None:
        masked_index = torch.nonzero(~allowed).flatten()
    # zeroed, not multiplied by 0: a masked log-probability times 0 must not reach the sum
    # (index_fill: the values of masked_fill with the broadcast mask, much faster on CPU)
    smooth_loss = -lprobs.index_fill(-1, masked_index, 0.0).sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    num_allowed = int(allowed.sum()) if num_allowed is None else num_allowed
    eps_i = epsilon / max(num_allowed - 1, 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


@register_criterion("masked_label_smoothed_cross_entropy", dataclass=LabelSmoothedCrossEntropyCriterionConfig)
class MaskedLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    """Label smoothing over the allowed types of ``--target-vocab-mask`` (module docstring)."""

    def compute_loss(self, model, net_output, sample, reduce=True):
        mask = model_target_vocab_mask(model)
        if mask is None:
            return super().compute_loss(model, net_output, sample, reduce=reduce)
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        return masked_label_smoothed_nll_loss(lprobs, target, self.eps, mask.allowed,
                                              ignore_index=self.padding_idx, reduce=reduce,
                                              num_allowed=mask.num_allowed, masked_index=mask.masked_index())
