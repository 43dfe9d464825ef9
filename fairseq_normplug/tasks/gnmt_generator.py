"""GNMT length normalisation for fairseq's beam search (Wu et al. 2016, eq. 14).

A finished hypothesis Y of a source X is ranked by

    s(Y, X) = log P(Y|X) / lp(Y),   lp(Y) = ((5 + |Y|) / 6) ** alpha

(the paper's coverage penalty is not used: beta = 0). |Y| counts the end-of-sentence token,
as fairseq's own ``--lenpen`` length does (``step + 1`` in ``SequenceGenerator.finalize_hypos``)
and as tensor2tensor's beam search does (``(5 + i + 1) / 6`` at decoding step i).

This is ``--gnmt-alpha`` alone: fairseq's search, whose finished hypotheses are re-ranked. The
authors' search, where normalised scores rank the beam at every step, is ``--gnmt-search``
(gnmt_search.py).
"""
from typing import Dict, List

from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha of GNMT (Wu et al. 2016, eq. 14)."""
    return ((5.0 + length) / 6.0) ** alpha


class GnmtSequenceGenerator(SequenceGenerator):
    """fairseq's SequenceGenerator with GNMT length normalisation instead of ``--lenpen``.

    The parent finalizes hypotheses with ``len_penalty = 0`` (scores divided by
    ``len ** 0 = 1``, i.e. the plain sum of log probabilities); every hypothesis it has just
    finalized then gets its score divided by lp(Y). The final n-best list is sorted by these
    scores afterwards, so the ranking is GNMT's. ``positional_scores`` are untouched."""

    def __init__(self, models, tgt_dict, gnmt_alpha: float, **kwargs):
        kwargs["len_penalty"] = 0.0
        kwargs["normalize_scores"] = True
        super().__init__(models, tgt_dict, **kwargs)
        self.gnmt_alpha = float(gnmt_alpha)

    def finalize_hypos(self, step: int, bbsz_idx, eos_scores, tokens, scores,
                       finalized: List[List[Dict[str, Tensor]]], finished: List[bool], beam_size: int,
                       attn, src_lengths, max_len: int):
        before = [len(hypos) for hypos in finalized]
        newly_finished = super().finalize_hypos(step, bbsz_idx, eos_scores, tokens, scores, finalized,
                                                finished, beam_size, attn, src_lengths, max_len)
        penalty = gnmt_length_penalty(step + 1, self.gnmt_alpha)  # |Y| = step + 1, EOS included
        for hypos, count in zip(finalized, before):
            for hypo in hypos[count:]:
                hypo["score"] = hypo["score"] / penalty
        return newly_finished
