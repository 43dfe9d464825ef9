"""The seed-aware bootstrap's BLEU of 10,000 resampled test sets a row at once
(significance.unsmoothed_bleu_scores) is sacreBLEU's BLEU of each, bit for bit; a sacreBLEU that
changes its formula fails here."""
import dataclasses

import numpy as np
import pytest
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.metrics.chrf import CHRF

from fairseq_normplug.experiments import significance
from fairseq_normplug.experiments.bleu import _tokenized_metric

from test_seeds import REFS, hypotheses


def sacrebleu_scores(totals, metric):
    return np.array([metric._compute_score_from_stats(list(row)).score for row in totals])


def random_statistics(rows, order=4, seed=0):
    """Sufficient statistics as a resample sums them (float64 integers): lengths, then correct
    and total counts per order, correct <= total, with every edge: no n-gram correct at some or
    every order, an order with no n-gram at all (a short corpus), an empty output, the output
    longer, shorter or as long as the reference."""
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(0, 400, rows)
    ref_len = np.where(rng.random(rows) < 0.2, sys_len, rng.integers(1, 400, rows))
    total = np.maximum(sys_len[:, None] - np.arange(order)[None, :], 0)
    total[rng.random(rows) < 0.1, 2:] = 0  # too short for 3-grams
    correct = (total * rng.random((rows, order))).astype(int)
    correct[rng.random((rows, order)) < 0.05] = 0
    correct[rng.random(rows) < 0.05] = 0
    return np.concatenate([sys_len[:, None], ref_len[:, None], correct, total], axis=1).astype("float64")


def test_every_row_is_sacrebleus_bleu_to_the_last_bit():
    totals = random_statistics(20_000)
    metric = _tokenized_metric()
    ours, theirs = significance.unsmoothed_bleu_scores(totals), sacrebleu_scores(totals, metric)
    assert np.array_equal(ours, theirs)
    assert (theirs == 0).sum() > 1000 and (theirs > 0).sum() > 10_000 and len(np.unique(theirs)) > 10_000, (
        (theirs == 0).sum(), len(np.unique(theirs)))
    order2 = BLEU(tokenize="none", force=True, smooth_method="none", max_ngram_order=2)
    short = random_statistics(2000, order=2, seed=1)
    assert np.array_equal(significance.unsmoothed_bleu_scores(short, 2), sacrebleu_scores(short, order2))


def test_only_unsmoothed_bleu_takes_it():
    assert significance._unsmoothed_bleu(_tokenized_metric())
    assert not significance._unsmoothed_bleu(BLEU(smooth_method="exp"))
    assert not significance._unsmoothed_bleu(BLEU(smooth_method="none", effective_order=True))
    assert not significance._unsmoothed_bleu(CHRF())


@pytest.mark.parametrize("metric", ["tokenized_bleu", "chrf"])
def test_the_seed_aware_bootstrap_is_unchanged(metric, monkeypatch):
    base, system = [hypotheses(15), hypotheses(21)], [hypotheses(30), hypotheses(18), hypotheses(24)]
    fast = significance.seed_aware_bootstrap(base, system, REFS, n_samples=3000, metric=metric)
    monkeypatch.setattr(significance, "_unsmoothed_bleu", lambda metric: False)
    slow = significance.seed_aware_bootstrap(base, system, REFS, n_samples=3000, metric=metric)
    assert dataclasses.asdict(fast) == dataclasses.asdict(slow)
    assert 0 < fast.p_value < 1 and fast.diff_ci_low < fast.difference < fast.diff_ci_high
