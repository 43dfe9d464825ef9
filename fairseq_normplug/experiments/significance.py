"""Significance tests of one results-table cell against its baseline cell: the paired bootstrap
over test sentences (Koehn 2004, via sacreBLEU), the same over several training seeds, the
seed-aware bootstrap that resamples sentences and seeds together, the exact permutation test of
per-seed scores, and Holm's adjustment over a table's comparisons (Holm 1979)."""
import contextlib
import itertools
import math
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import numpy as np
from sacrebleu.metrics.base import Metric
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.significance import PairedTest, _compute_p_value, estimate_ci

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.bleu import check_parallel, metric_scorer


@dataclass(frozen=True)
class BootstrapResult:
    """Paired bootstrap of a system against a baseline. ``p_value`` is the probability of a
    BLEU difference at least as large as the observed one arising by chance (two-sided);
    ``system_mean`` +- ``system_ci`` is the system's mean BLEU over the resamples and the
    half-width of its 95% confidence interval."""
    p_value: float
    baseline_score: float
    system_score: float
    system_mean: float
    system_ci: float
    n_samples: int
    seed: int
    signature: str


@contextlib.contextmanager
def _sacrebleu_seed(seed: int) -> Iterator[None]:
    """sacreBLEU's significance tests take their seed from $SACREBLEU_SEED only."""
    previous = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = previous


def paired_bootstrap(baseline_hyps: Sequence[str], system_hyps: Sequence[str],
                     refs: Sequence[str], n_samples: int = 1000, seed: int = 12345,
                     metric: str = "tokenized_bleu") -> BootstrapResult:
    """Paired bootstrap resampling (Koehn 2004) of ``metric`` (tokenized BLEU by default; any
    name of :data:`METRIC_SCORERS`: for chrF give the detokenized lines of :func:`detokenized_pair`), via sacreBLEU's ``PairedTest(test_type="bs")``: the same
    ``n_samples`` resampled test sets score both systems. A zero observed difference gets
    p = 1: sacreBLEU's strict ``>`` count would otherwise give identical systems
    p = 1/(n_samples+1), i.e. "significant"."""
    check_parallel(baseline_hyps, refs, "baseline hypotheses")
    check_parallel(system_hyps, refs, "system hypotheses")
    if seed <= 0:
        raise NormplugError(f"bootstrap seed must be a positive integer, got {seed}")
    scorer = metric_scorer(metric)
    baseline_hyps, system_hyps, refs = (scorer.prepare(lines) for lines in (baseline_hyps, system_hyps, refs))
    with _sacrebleu_seed(seed):
        test = PairedTest([("baseline", list(baseline_hyps)), ("system", list(system_hyps))],
                          {"BLEU": scorer.metric()}, [list(refs)], test_type="bs", n_samples=n_samples)
    signatures, scores = test()
    name, = signatures  # keyed by the score's name: BLEU, chrF2, chrF2++
    baseline, system = scores[name]
    p_value = 1.0 if system.score == baseline.score else float(system.p_value)
    return BootstrapResult(p_value=p_value, baseline_score=baseline.score, system_score=system.score,
                           system_mean=float(system.mean), system_ci=float(system.ci),
                           n_samples=n_samples, seed=seed, signature=str(signatures[name]))


def _sentence_statistics(metric: Metric, by_seed: Sequence[Sequence[str]], refs: Sequence[str]) -> List[List[int]]:
    """Per source sentence, the metric's sufficient statistics (BLEU's n-gram counts, chrF's
    character/word n-gram match counts) summed over the seeds' translations."""
    per_seed = [metric._extract_corpus_statistics(list(hyps), [list(refs)]) for hyps in by_seed]
    return [[sum(values) for values in zip(*sentence)] for sentence in zip(*per_seed)]


def _check_bootstrap_inputs(baseline_by_seed: Sequence[Sequence[str]], system_by_seed: Sequence[Sequence[str]],
                            refs: Sequence[str], seed: int) -> None:
    """Every seed's hypotheses of both rows parallel to ``refs``, and a positive RNG seed."""
    for hyps in baseline_by_seed:
        check_parallel(hyps, refs, "baseline hypotheses")
    for hyps in system_by_seed:
        check_parallel(hyps, refs, "system hypotheses")
    if seed <= 0:
        raise NormplugError(f"bootstrap seed must be a positive integer, got {seed}")


def paired_bootstrap_seeds(baseline_by_seed: Sequence[Sequence[str]], system_by_seed: Sequence[Sequence[str]],
                           refs: Sequence[str], n_samples: int = 1000, seed: int = 12345,
                           metric: str = "tokenized_bleu") -> BootstrapResult:
    """Paired bootstrap resampling of ``metric`` over the concatenated test sets of several
    training seeds. Each system's score is the corpus score (BLEU, chrF) of all its seeds' translations
    together (the concatenation, seed k of the baseline paired with seed k of the system, in
    the order given). A resample draws source sentences with replacement and takes every
    seed's translation of each drawn sentence, for both systems: the translations of one
    sentence by different seeds are correlated (the sentence is as hard for each), so they are
    resampled as one unit, not as independent sentences. The p-value, the zero-difference rule
    and the RNG are those of :func:`paired_bootstrap` (sacreBLEU's test, here run on
    per-sentence statistics summed over seeds): one seed gives exactly :func:`paired_bootstrap`.
    docs/evaluation.md says why this test and what it cannot tell with few seeds."""
    if not system_by_seed or len(baseline_by_seed) != len(system_by_seed):
        raise NormplugError(f"paired bootstrap over seeds needs the same number (>= 1) of baseline and "
                            f"system seeds, got {len(baseline_by_seed)} and {len(system_by_seed)}")
    _check_bootstrap_inputs(baseline_by_seed, system_by_seed, refs, seed)
    scorer = metric_scorer(metric)
    bleu = scorer.metric()
    refs = scorer.prepare(refs)
    stats = [_sentence_statistics(bleu, [scorer.prepare(hyps) for hyps in by_seed], refs)
             for by_seed in (baseline_by_seed, system_by_seed)]
    baseline_score, system_score = (bleu._aggregate_and_compute(s).score for s in stats)
    # as sacreBLEU's _paired_bs_test: float32 statistics, the same index draws for both systems
    indices = np.random.default_rng(seed).choice(len(refs), size=(n_samples, len(refs)), replace=True)
    baseline_stats, system_stats = (np.array(s, dtype="float32") for s in stats)
    resampled_baseline = np.array([bleu._compute_score_from_stats(sample.sum(0)).score
                                   for sample in baseline_stats[indices]])
    resampled_system = np.array([bleu._compute_score_from_stats(sample.sum(0)).score
                                 for sample in system_stats[indices]])
    differences = np.abs(resampled_system - resampled_baseline)
    p_value = 1.0 if system_score == baseline_score else float(
        _compute_p_value(differences - differences.mean(), abs(baseline_score - system_score)))
    system_mean, system_ci = estimate_ci(resampled_system)
    signature = bleu.get_signature()
    signature.update("seed", str(seed))
    signature.update("bs", n_samples)
    return BootstrapResult(p_value=p_value, baseline_score=baseline_score, system_score=system_score,
                           system_mean=float(system_mean), system_ci=float(system_ci), n_samples=n_samples,
                           seed=seed, signature=str(signature) + (
                               f"|training_seeds:{len(system_by_seed)}" if len(system_by_seed) > 1 else ""))


#: resamples of :func:`seed_aware_bootstrap`: its smallest p, 1/10001, stays below 0.01 after Holm's
#: correction over up to 100 comparisons (1,000 resamples could not give a ‡ beyond 10)
SEED_AWARE_SAMPLES = 10_000


@dataclass(frozen=True)
class SeedAwareBootstrapResult:
    """A two-level paired bootstrap of a system's cell against its baseline's
    (:func:`seed_aware_bootstrap`): ``difference`` is the observed difference of the mean per-seed
    scores (system - baseline), [``diff_ci_low``, ``diff_ci_high``] its 95% bootstrap interval,
    ``p_value`` the two-sided p of a difference at least that large arising by chance."""
    p_value: float
    baseline_score: float
    system_score: float
    difference: float
    diff_ci_low: float
    diff_ci_high: float
    baseline_seeds: int
    system_seeds: int
    n_samples: int
    seed: int
    signature: str


def _seed_statistics(metric: Metric, by_seed: Sequence[Sequence[str]], refs: Sequence[str]) -> np.ndarray:
    """(seeds, sentences, statistics): the metric's per-sentence sufficient statistics of each seed."""
    return np.array([metric._extract_corpus_statistics(list(hyps), [list(refs)]) for hyps in by_seed],
                    dtype="float64")


def _resampled_seed_scores(metric: Metric, stats: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(resamples, seeds): each seed's corpus score on each resampled test set, the resample given
    as ``counts`` (resamples, sentences), how often each sentence was drawn."""
    totals = np.einsum("bn,snk->bsk", counts, stats)  # integer counts: exact in float64
    if _unsmoothed_bleu(metric):
        return unsmoothed_bleu_scores(totals.reshape(-1, totals.shape[-1]), metric.max_ngram_order).reshape(
            totals.shape[:2])
    return np.array([[metric._compute_score_from_stats(list(seed_totals)).score for seed_totals in sample]
                     for sample in totals])


def _unsmoothed_bleu(metric: Metric) -> bool:
    """The BLEU settings of every BLEU metric of the tables (bleu.py's): no smoothing, every order."""
    return isinstance(metric, BLEU) and metric.smooth_method == "none" and not metric.effective_order


def unsmoothed_bleu_scores(totals: np.ndarray, max_ngram_order: int = 4) -> np.ndarray:
    """sacreBLEU's ``BLEU.compute_bleu`` (Papineni et al. 2002, eq. 1-2; ``smooth_method="none"``,
    no effective order) of each row of ``totals`` (rows, 2 + 2 x order: sys_len, ref_len, correct
    and total n-gram counts, sacreBLEU's sufficient statistics), bit for bit, all rows at once:
    sacreBLEU takes about 30 us a row, a second or more for a table cell's 10,000 resamples. The
    same operations in the same order: the arithmetic on float64 arrays (IEEE, as Python's floats),
    the logarithms, sums and exponentials by Python, one value at a time
    (tests/test_unsmoothed_bleu.py compares the two)."""
    sys_len, ref_len = totals[:, 0], totals[:, 1]
    correct = totals[:, 2:2 + max_ngram_order]
    total = totals[:, 2 + max_ngram_order:2 + 2 * max_ngram_order]
    with np.errstate(divide="ignore", invalid="ignore"):
        # order n's precision: 0 where none of its n-grams is correct or an order up to n has none at all
        counted = np.cumprod(total != 0, axis=1).astype(bool)
        precisions = np.where(counted & (correct != 0), 100. * correct / total, 0.0)
        brevity_exponents = 1 - ref_len / sys_len
    scores = []
    for row, any_correct, shorter, output_length, exponent in zip(
            precisions.tolist(), correct.any(axis=1).tolist(), (sys_len < ref_len).tolist(), sys_len.tolist(),
            brevity_exponents.tolist()):
        if not any_correct:
            scores.append(0.0)
            continue
        brevity_penalty = (math.exp(exponent) if output_length > 0 else 0.0) if shorter else 1.0
        log_mean = sum([math.log(p) if p > 0 else -9999999999 for p in row]) / max_ngram_order  # sacreBLEU's my_log
        scores.append(brevity_penalty * math.exp(log_mean))
    return np.array(scores)


def seed_aware_bootstrap(baseline_by_seed: Sequence[Sequence[str]], system_by_seed: Sequence[Sequence[str]],
                         refs: Sequence[str], n_samples: int = SEED_AWARE_SAMPLES, seed: int = 12345,
                         metric: str = "tokenized_bleu") -> SeedAwareBootstrapResult:
    """Paired bootstrap over test sentences and training seeds together (a two-level bootstrap,
    as for clustered data: Davison & Hinkley 1997, section 3.8; the multi-seed replication of
    Clark et al. 2011). A cell's score is the mean of its seeds' corpus scores in ``metric``
    (the table's cell). Each of ``n_samples`` resamples draws the test sentences with replacement
    (the same draws for both rows: the rows translate the same sentences) and, independently for
    each row, as many seeds as it has, with replacement (unpaired: seed k of one row shares
    nothing with seed k of the other); a row's resampled score is the mean over its drawn seeds
    of their scores on the drawn sentences. The p-value is sacreBLEU's (``_paired_bs_test``:
    centred absolute differences, p = (c + 1) / (n_samples + 1)), a zero observed difference gives
    p = 1; the 95% interval of the difference is the 2.5 and 97.5 percentiles of the resampled
    differences (sacreBLEU's ``estimate_ci`` rule). The rows may have different numbers of seeds.
    With one seed each it is sacreBLEU's paired bootstrap (:func:`paired_bootstrap` with the same
    ``n_samples`` and ``seed``, to the last digit). Smallest p: 1 / (n_samples + 1)."""
    if not baseline_by_seed or not system_by_seed:
        raise NormplugError(f"seed-aware bootstrap needs >= 1 seed of each row, got {len(baseline_by_seed)} "
                            f"baseline and {len(system_by_seed)} system seeds")
    _check_bootstrap_inputs(baseline_by_seed, system_by_seed, refs, seed)
    if n_samples < 40:
        raise NormplugError(f"seed-aware bootstrap needs n_samples >= 40 for a 95% interval, got {n_samples}")
    scorer = metric_scorer(metric)
    scoring = scorer.metric()
    refs = scorer.prepare(refs)
    stats = [_seed_statistics(scoring, [scorer.prepare(hyps) for hyps in by_seed], refs)
             for by_seed in (baseline_by_seed, system_by_seed)]
    observed = [float(np.mean([scoring._aggregate_and_compute(seed_stats.astype(int).tolist()).score
                               for seed_stats in row])) for row in stats]
    rng = np.random.default_rng(seed)
    # the sentence draws of sacreBLEU's _paired_bs_test, then each row's seed draws
    indices = rng.choice(len(refs), size=(n_samples, len(refs)), replace=True)
    seed_draws = [rng.integers(len(row), size=(n_samples, len(row))) for row in stats]
    scores = [np.empty((n_samples, len(row))) for row in stats]
    for start in range(0, n_samples, 1000):
        chunk = indices[start:start + 1000]
        # how often each resample drew each sentence
        drawn = (np.arange(len(chunk))[:, None] * len(refs) + chunk).ravel()
        counts = np.bincount(drawn, minlength=chunk.size).reshape(chunk.shape).astype("float64")
        for row, row_scores in zip(stats, scores):
            row_scores[start:start + 1000] = _resampled_seed_scores(scoring, row, counts)
    resampled = [np.take_along_axis(row_scores, draws, axis=1).mean(axis=1)
                 for row_scores, draws in zip(scores, seed_draws)]
    differences = resampled[1] - resampled[0]
    difference = observed[1] - observed[0]
    absolute = np.abs(differences)
    p_value = 1.0 if difference == 0 else float(_compute_p_value(absolute - absolute.mean(), abs(difference)))
    ordered = np.sort(differences)
    lower = n_samples // 40
    signature = scoring.get_signature()
    signature.update("seed", str(seed))
    signature.update("bs", n_samples)
    return SeedAwareBootstrapResult(
        p_value=p_value, baseline_score=observed[0], system_score=observed[1], difference=difference,
        diff_ci_low=float(ordered[lower]), diff_ci_high=float(ordered[n_samples - lower - 1]),
        baseline_seeds=len(baseline_by_seed), system_seeds=len(system_by_seed), n_samples=n_samples, seed=seed,
        signature=f"{signature}|training_seeds:{len(baseline_by_seed)}+{len(system_by_seed)}|seed_resampling:yes")


def holm_adjust(p_values: Sequence[Optional[float]]) -> List[Optional[float]]:
    """Holm's (1979) step-down adjustment of a family of p-values, in their order: the i-th
    smallest of the m given p becomes max over j <= i of min(1, (m - j + 1) p_(j)); reject where
    the adjusted p < alpha controls the family-wise error rate at alpha. None stays None and is
    not counted in m."""
    given = sorted((p, index) for index, p in enumerate(p_values) if p is not None)
    adjusted: List[Optional[float]] = [None] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(given):
        if not 0 <= p <= 1:
            raise NormplugError(f"p-value {p!r} outside [0, 1]")
        running = max(running, min(1.0, (len(given) - rank) * p))
        adjusted[index] = running
    return adjusted


#: above this many splits, :func:`seeds_permutation_test` samples them (more than 10 seeds a row)
EXACT_PERMUTATION_LIMIT = 200_000


def seeds_permutation_test(baseline_scores: Sequence[float], system_scores: Sequence[float],
                           seed: int = 12345) -> Optional[float]:
    """Two-sided exact permutation test (Fisher's randomization test) of the difference between
    two rows' mean per-seed scores: the question "would other training seeds agree", which the
    bootstrap over test sentences does not ask. Under the null hypothesis every split of the
    pooled scores into groups of the two sizes is equally likely; p is the share of the
    C(n+m, n) splits whose |mean difference| is at least the observed one (1e-9 tolerance for
    float ties). Unpaired: seed k of one row has nothing in common with seed k of the other.
    None when either row has fewer than 2 scores. The smallest p it can give is 2 / C(n+m, n):
    0.1 with 3 seeds against 3, 0.029 with 4 against 4. Beyond :data:`EXACT_PERMUTATION_LIMIT`
    splits it draws that many at random (RNG ``seed``) and returns (1 + extreme) / (1 + draws)."""
    baseline, system = [float(x) for x in baseline_scores], [float(x) for x in system_scores]
    if len(baseline) < 2 or len(system) < 2:
        return None
    pooled, n = np.array(baseline + system), len(system)
    total = pooled.sum()
    observed = abs(sum(system) / n - sum(baseline) / len(baseline))
    if math.comb(len(pooled), n) <= EXACT_PERMUTATION_LIMIT:
        chosen = np.array(list(itertools.combinations(range(len(pooled)), n)))
        extra = 0
    else:
        rng = np.random.default_rng(seed)
        chosen = np.argsort(rng.random((EXACT_PERMUTATION_LIMIT, len(pooled))), axis=1)[:, :n]
        extra = 1
    chosen_sums = pooled[chosen].sum(axis=1)
    differences = np.abs(chosen_sums / n - (total - chosen_sums) / len(baseline))
    return float((extra + np.count_nonzero(differences >= observed - 1e-9)) / (extra + len(chosen)))
