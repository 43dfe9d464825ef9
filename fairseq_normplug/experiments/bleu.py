"""BLEU the way the papers report it, plus sacreBLEU and significance.

* :func:`tokenized_bleu`: BLEU on already-tokenized text, equivalent to Moses'
  ``multi-bleu.perl`` (the paper's tables): whitespace tokens, case-sensitive, no smoothing.
* :func:`sacrebleu_detok`: standard sacreBLEU of detokenized text with its signature string
  (:func:`detokenize` Moses-detokenizes, :func:`remove_bpe` undoes subword splitting).
* :func:`chrf`: sacreBLEU's chrF2 (character 6-grams, beta 2), or chrF++ (``word_order=2``),
  with its signature, on the same detokenized hypotheses and references as :func:`sacrebleu_detok`
  (:func:`detokenized_pair` makes them from the tokenized lines).
* :func:`compound_split_bleu`: the WMT'14 en-de recipe (fairseq's
  ``scripts/compound_split_bleu.sh``): ``a-b`` becomes ``a ##AT##-##AT## b`` on both sides,
  then tokenized BLEU.
* :func:`multi_bleu_detok`: Moses' ``multi-bleu-detok.perl`` (mteval-v13a tokenization inside,
  no smoothing) on the same tokenized lines, as QKNorm's authors scored their 33.24 en-vi.
* :func:`paired_bootstrap`: p-value of a system against a baseline (sacreBLEU's paired
  bootstrap resampling, Koehn 2004) in any metric of :data:`METRIC_SCORERS`;
  :func:`paired_bootstrap_seeds` the same over the concatenated test sets of several seeds
  (source sentences resampled with all their seeds' translations);
  :func:`seeds_permutation_test` whether the rows' per-seed scores differ beyond the spread
  between training seeds.
* :func:`read_fairseq_generate`: hypotheses and references of a ``fairseq-generate`` output.
* :func:`score_translation`: all of the above for one system, as a dict (also the CLI)::

    python -m fairseq_normplug.experiments.bleu --generate gen.out --ref test.tok.de \\
        --lang de [--detok-ref test.de] [--compound-split] [--baseline-generate base_gen.out]

Inputs are lists of lines (one sentence each); :func:`read_lines` reads a file.
"""
import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.base import Metric
from sacrebleu.significance import PairedTest, _compute_p_value, estimate_ci
from sacremoses import MosesDetokenizer

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.atomic_files import write_text_atomic

BPE_KINDS = ("subword_nmt", "sentencepiece")
SENTENCEPIECE_SPACE = "\u2581"
COMPOUND_SPLIT = re.compile(r"(\S)-(\S)")
GENERATE_LINE = re.compile(r"^([HDT])-(\d+)\t(.*)$")


@dataclass(frozen=True)
class BleuScore:
    """A corpus BLEU with its parts: ``precisions`` are the 1-4-gram precisions in percent,
    ``brevity_penalty`` is in [0, 1], lengths count tokens, ``signature`` is sacreBLEU's."""
    score: float
    precisions: Tuple[float, float, float, float]
    brevity_penalty: float
    sys_len: int
    ref_len: int
    signature: str


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


@dataclass(frozen=True)
class GenerateOutput:
    """One ``fairseq-generate`` output ordered by sentence id: ``hypotheses`` are the ``H-``
    lines (tokenized; BPE removed if generated with ``--remove-bpe``), ``detok_hypotheses``
    the ``D-`` lines (detokenized by ``--tokenizer``, if any), ``references`` the ``T-``
    lines (rebuilt from the binarized data: prefer the reference file, which has no <unk>)."""
    ids: List[int]
    hypotheses: List[str]
    detok_hypotheses: List[str]
    references: List[str]


def read_lines(path: str) -> List[str]:
    """The lines of a UTF-8 text file without their line ends."""
    if not os.path.isfile(path):
        raise NormplugError(f"no such file: {path}")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _check_parallel(hyps: Sequence[str], refs: Sequence[str], what: str = "hypotheses") -> None:
    if len(hyps) != len(refs):
        raise NormplugError(f"{len(hyps)} {what} but {len(refs)} references: line counts must match")
    if not refs:
        raise NormplugError("no sentences to score (empty references)")


def _bleu_score(metric: BLEU, hyps: Sequence[str], refs: Sequence[str]) -> BleuScore:
    _check_parallel(hyps, refs)
    result = metric.corpus_score(list(hyps), [list(refs)])
    return BleuScore(score=result.score, precisions=tuple(result.precisions),
                     brevity_penalty=result.bp, sys_len=result.sys_len, ref_len=result.ref_len,
                     signature=str(metric.get_signature()))


def _tokenized_metric() -> BLEU:
    # multi-bleu.perl: split on whitespace, case-sensitive, and no smoothing (a zero n-gram
    # precision makes BLEU 0); force=True silences sacreBLEU's "already tokenized" warning.
    return BLEU(tokenize="none", force=True, lowercase=False, smooth_method="none")


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str]) -> BleuScore:
    """BLEU of tokenized ``hyps`` against tokenized ``refs`` (one reference per sentence),
    equivalent to ``multi-bleu.perl refs < hyps``."""
    return _bleu_score(_tokenized_metric(), hyps, refs)


def detokenize(lines: Sequence[str], lang: str) -> List[str]:
    """Moses-detokenize each line (sacremoses, which also unescapes ``&apos;`` and friends)."""
    detokenizer = MosesDetokenizer(lang=lang)
    return [detokenizer.detokenize(line.split()) for line in lines]


def remove_bpe(lines: Sequence[str], kind: str = "subword_nmt") -> List[str]:
    """Undo subword segmentation like fairseq's ``--post-process``: ``subword_nmt`` joins
    ``@@ `` continuations, ``sentencepiece`` drops spaces and turns ``\u2581`` into spaces."""
    if kind == "subword_nmt":
        return [(line + " ").replace("@@ ", "").rstrip() for line in lines]
    if kind == "sentencepiece":
        return [line.replace(" ", "").replace(SENTENCEPIECE_SPACE, " ").strip() for line in lines]
    raise NormplugError(f"unknown BPE kind {kind!r}; choose from {', '.join(BPE_KINDS)}")


def sacrebleu_detok(hyps: Sequence[str], refs: Sequence[str], lang: Optional[str] = None) -> BleuScore:
    """Standard sacreBLEU of detokenized text with its signature: sacreBLEU's own
    tokenization, its default for target language ``lang`` (13a, or zh/ja-mecab/ko-mecab
    for Chinese/Japanese/Korean). Detokenize Moses-tokenized text with :func:`detokenize`."""
    return _bleu_score(BLEU(trg_lang=lang or ""), hyps, refs)


@dataclass(frozen=True)
class ChrfScore:
    """A corpus chrF (chrF2, or chrF++ with ``word_order`` 2) and sacreBLEU's signature of it."""
    score: float
    word_order: int
    signature: str


#: the chrF metrics: {name (a key of scores.json and results.csv, and a table metric): word n-gram order}
CHRF_WORD_ORDERS = {"chrf": 0, "chrf++": 2}


def _chrf_metric(word_order: int = 0) -> CHRF:
    # sacreBLEU's defaults, as `sacrebleu -m chrf [--chrf-word-order 2]`: char order 6, beta 2, case-sensitive
    return CHRF(word_order=word_order)


def chrf(hyps: Sequence[str], refs: Sequence[str], word_order: int = 0) -> ChrfScore:
    """sacreBLEU's chrF of detokenized ``hyps`` against detokenized ``refs``: chrF2
    (``word_order`` 0, character n-grams up to 6, beta 2) or chrF++ (``word_order`` 2), equal to
    ``sacrebleu REFS -i HYPS -m chrf [--chrf-word-order 2]``. Give it the lines sacreBLEU's BLEU
    scores (:func:`detokenized_pair`)."""
    _check_parallel(hyps, refs)
    metric = _chrf_metric(word_order)
    result = metric.corpus_score(list(hyps), [list(refs)])
    return ChrfScore(score=result.score, word_order=word_order, signature=str(metric.get_signature()))


def detokenized_pair(hyps: Sequence[str], refs: Sequence[str], lang: str,
                     detok_refs: Optional[Sequence[str]] = None) -> Tuple[List[str], List[str]]:
    """The detokenized (hypotheses, references) that sacreBLEU and chrF score: the tokenized
    BPE-free ``hyps`` Moses-detokenized, against ``detok_refs`` (the raw references) or else the
    Moses-detokenized tokenized ``refs``."""
    return detokenize(hyps, lang), (detokenize(refs, lang) if detok_refs is None else list(detok_refs))


def compound_split(line: str) -> str:
    """``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`` of fairseq's compound_split_bleu.sh."""
    return COMPOUND_SPLIT.sub(r"\1 ##AT##-##AT## \2", line)


def compound_split_bleu(hyps: Sequence[str], refs: Sequence[str]) -> BleuScore:
    """Tokenized BLEU after compound splitting both sides (WMT'14 en-de convention of
    Vaswani et al. 2017 and fairseq's recipe; inflates BLEU, label it as such)."""
    return tokenized_bleu([compound_split(h) for h in hyps], [compound_split(r) for r in refs])


def _multi_bleu_detok_metric() -> BLEU:
    # multi-bleu-detok.perl: mteval-v13a's tokenization (sacreBLEU's 13a), case-sensitive, no smoothing
    return BLEU(tokenize="13a", force=True, lowercase=False, smooth_method="none")


def multi_bleu_detok(hyps: Sequence[str], refs: Sequence[str]) -> BleuScore:
    """``multi-bleu-detok.perl refs < hyps``: BLEU after mteval-v13a tokenization of both sides,
    unsmoothed. Meant for raw text; QKNorm's authors ran it on the tokenized, BPE-free output
    and the tokenized references (CyndxAI/QKNorm ``score_test_data.ipynb``), so it is computed
    here from the same lines as :func:`tokenized_bleu` (13a splits ``&apos;s`` further)."""
    return _bleu_score(_multi_bleu_detok_metric(), hyps, refs)


def _unchanged(lines: Sequence[str]) -> List[str]:
    return list(lines)


def _compound_split_lines(lines: Sequence[str]) -> List[str]:
    return [compound_split(line) for line in lines]


@dataclass(frozen=True)
class MetricScorer:
    """How one metric of ``tables.METRICS`` is computed from tokenized, BPE-free lines:
    ``prepare`` rewrites hypotheses and references alike, ``metric`` builds the sacreBLEU scorer.
    ``detokenized``: the metric scores the detokenized lines of :func:`detokenized_pair` (chrF,
    like sacreBLEU), which the caller passes instead of the tokenized ones."""
    prepare: Callable[[Sequence[str]], List[str]]
    metric: Callable[[], Metric]
    detokenized: bool = False


#: the metrics a results table's cells and its significance test can use (tables.CELL_METRICS)
METRIC_SCORERS: Dict[str, MetricScorer] = {
    "tokenized_bleu": MetricScorer(_unchanged, _tokenized_metric),
    "compound_split_bleu": MetricScorer(_compound_split_lines, _tokenized_metric),
    "multi_bleu_detok": MetricScorer(_unchanged, _multi_bleu_detok_metric),
    # chrF's sufficient statistics are per-sentence character (and word) n-gram match counts,
    # summed over a resample before the F-score is computed: resampled like BLEU's
    "chrf": MetricScorer(_unchanged, lambda: _chrf_metric(CHRF_WORD_ORDERS["chrf"]), detokenized=True),
    "chrf++": MetricScorer(_unchanged, lambda: _chrf_metric(CHRF_WORD_ORDERS["chrf++"]), detokenized=True),
}


def _scorer(metric: str) -> MetricScorer:
    if metric not in METRIC_SCORERS:
        raise NormplugError(f"unknown metric {metric!r} for a significance test; choose from "
                            f"{', '.join(METRIC_SCORERS)}")
    return METRIC_SCORERS[metric]


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
    _check_parallel(baseline_hyps, refs, "baseline hypotheses")
    _check_parallel(system_hyps, refs, "system hypotheses")
    if seed <= 0:
        raise NormplugError(f"bootstrap seed must be a positive integer, got {seed}")
    scorer = _scorer(metric)
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
        _check_parallel(hyps, refs, "baseline hypotheses")
    for hyps in system_by_seed:
        _check_parallel(hyps, refs, "system hypotheses")
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
    scorer = _scorer(metric)
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
    return np.array([[metric._compute_score_from_stats(list(seed_totals)).score for seed_totals in sample]
                     for sample in totals])


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
    scorer = _scorer(metric)
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
    resampled = []
    for row, draws in zip(stats, seed_draws):
        scores = np.empty((n_samples, len(row)))
        for start in range(0, n_samples, 1000):
            chunk = indices[start:start + 1000]
            counts = np.zeros((len(chunk), len(refs)))
            np.add.at(counts, (np.arange(len(chunk))[:, None], chunk), 1)
            scores[start:start + 1000] = _resampled_seed_scores(scoring, row, counts)
        resampled.append(np.take_along_axis(scores, draws, axis=1).mean(axis=1))
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


def _missing_ids(ids, expected: int) -> List[int]:
    return sorted(set(range(expected)) - set(ids))


def _id_list(ids: List[int], shown: int = 10) -> str:
    more = f", ... ({len(ids)} in all)" if len(ids) > shown else ""
    return ", ".join(map(str, ids[:shown])) + more


def read_fairseq_generate(path: str, expected: Optional[int] = None) -> GenerateOutput:
    """Parse ``fairseq-generate`` output (``H-<id>\\t<score>\\t<text>``, ``D-...`` alike,
    ``T-<id>\\t<text>``), ordered by id; the first (best) hypothesis of each id is kept.

    Every id 0..n-1 must have a hypothesis and a reference, n being ``expected`` (the
    number of lines of the test set's reference file) when given, else the largest id + 1.
    Fewer hypotheses than reference lines usually means fairseq dropped the last batch."""
    hyps: Dict[int, str] = {}
    detok: Dict[int, str] = {}
    refs: Dict[int, str] = {}
    for line in read_lines(path):
        match = GENERATE_LINE.match(line)
        if not match:
            continue
        kind, sentence_id, rest = match.group(1), int(match.group(2)), match.group(3)
        if kind == "T":
            refs.setdefault(sentence_id, rest)
        else:
            text = rest.split("\t", 1)[1] if "\t" in rest else ""
            (hyps if kind == "H" else detok).setdefault(sentence_id, text)
    if not hyps:
        raise NormplugError(f"no H-<id> hypothesis lines in {path}: not fairseq-generate output?")
    if not refs:
        raise NormplugError(f"no T-<id> reference lines in {path}: generated without references?")

    largest = max(max(hyps), max(refs)) + 1
    if expected is not None:
        if len(hyps) < expected:
            raise NormplugError(
                f"{path} has {len(hyps)} hypotheses but the reference file has {expected} lines "
                f"(missing ids: {_id_list(_missing_ids(hyps, expected))}); fairseq drops the last "
                f"batch unless fairseq-generate gets --required-batch-size-multiple 1 (and no "
                f"--skip-invalid-size-inputs-valid-test)")
        if largest > expected:
            raise NormplugError(f"{path} has sentence ids up to {largest - 1} but the reference file "
                                f"has only {expected} lines: wrong reference file?")
    count = largest if expected is None else expected
    for name, found in (("hypotheses (H-)", hyps), ("references (T-)", refs)):
        missing = _missing_ids(found, count)
        if missing:
            raise NormplugError(f"{path}: {name} missing for ids {_id_list(missing)} of 0..{count - 1}")
    ids = list(range(count))
    return GenerateOutput(ids=ids, hypotheses=[hyps[i] for i in ids],
                          detok_hypotheses=[detok.get(i, hyps[i]) for i in ids],
                          references=[refs[i] for i in ids])


def _reject_subwords(lines: Sequence[str], what: str) -> None:
    for number, line in enumerate(lines, 1):
        if "@@ " in line + " " or SENTENCEPIECE_SPACE in line:
            raise NormplugError(
                f"{what} line {number} still holds BPE pieces ({line[:60]!r}): generate with "
                f"--remove-bpe (or call remove_bpe()) before scoring")


def length_ratio(scores: dict) -> Optional[float]:
    """Hypothesis/reference token-length ratio ``sys_len / ref_len`` of a :func:`score_translation`
    dict (also of scores.json files written before it recorded ``length_ratio``); None if unknown."""
    if scores.get("length_ratio") is not None:
        return scores["length_ratio"]
    if scores.get("sys_len") is None or not scores.get("ref_len"):
        return None
    return scores["sys_len"] / scores["ref_len"]


def score_translation(hyps: Sequence[str], refs: Sequence[str], lang: Optional[str] = None,
                      detok_refs: Optional[Sequence[str]] = None, compound_split: bool = False,
                      baseline_hyps: Optional[Sequence[str]] = None) -> dict:
    """Every score of one system, from tokenized BPE-free ``hyps`` and ``refs``, as a flat
    JSON-ready dict: ``tokenized_bleu`` with ``precisions``, ``brevity_penalty``,
    ``sys_len``, ``ref_len``, ``length_ratio`` (``sys_len / ref_len``), ``bleu_signature``,
    ``sentences`` and ``multi_bleu_detok`` (:func:`multi_bleu_detok`); with ``lang``:
    ``sacrebleu`` and ``sacrebleu_signature`` (hypotheses Moses-detokenized, against
    ``detok_refs``, the raw references, or else the Moses-detokenized ``refs``); with
    ``chrf``, ``chrf_signature``, ``chrf++`` and ``chrf++_signature`` (:func:`chrf` of the same
    detokenized lines as sacreBLEU); with ``compound_split``: ``compound_split_bleu``; with ``baseline_hyps``: ``p_value``
    (paired bootstrap of tokenized BLEU), ``baseline_bleu``, ``bootstrap_mean``, ``bootstrap_ci``."""
    _reject_subwords(hyps, "hypothesis")
    _reject_subwords(refs, "reference")
    tok = tokenized_bleu(hyps, refs)
    scores = {"tokenized_bleu": tok.score, "precisions": list(tok.precisions),
              "brevity_penalty": tok.brevity_penalty, "sys_len": tok.sys_len, "ref_len": tok.ref_len,
              "bleu_signature": tok.signature, "sentences": len(refs),
              "multi_bleu_detok": multi_bleu_detok(hyps, refs).score}
    scores["length_ratio"] = length_ratio(scores)
    if lang:
        detok_hyps, detok_lines = detokenized_pair(hyps, refs, lang, detok_refs)
        detok = sacrebleu_detok(detok_hyps, detok_lines, lang)
        scores.update(sacrebleu=detok.score, sacrebleu_signature=detok.signature)
        scores.update(chrf_scores(detok_hyps, detok_lines))
    if compound_split:
        scores["compound_split_bleu"] = compound_split_bleu(hyps, refs).score
    if baseline_hyps is not None:
        test = paired_bootstrap(baseline_hyps, hyps, refs)
        scores.update(p_value=test.p_value, baseline_bleu=test.baseline_score,
                      bootstrap_mean=test.system_mean, bootstrap_ci=test.system_ci)
    return scores


def chrf_scores(detok_hyps: Sequence[str], detok_refs: Sequence[str]) -> dict:
    """``chrf``, ``chrf_signature``, ``chrf++``, ``chrf++_signature`` of detokenized lines
    (:func:`detokenized_pair`), as :func:`score_translation` records them in scores.json."""
    out = {}
    for name, word_order in CHRF_WORD_ORDERS.items():
        score = chrf(detok_hyps, detok_refs, word_order)
        out.update({name: score.score, f"{name}_signature": score.signature})
    return out


def _hypotheses(generate: Optional[str], hyp: Optional[str], expected: int) -> Optional[List[str]]:
    if generate:
        return read_fairseq_generate(generate, expected).hypotheses
    return read_lines(hyp) if hyp else None


def main(argv: Optional[Sequence[str]] = None) -> dict:
    # importing fairseq (via the plugin package) sets the root logger to DEBUG
    logging.getLogger().setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_normplug.experiments.bleu",
        description="Score tokenized translations: tokenized BLEU (multi-bleu.perl), optional "
                    "sacreBLEU and chrF/chrF++ (with --lang), compound-split BLEU and paired bootstrap p-value; prints JSON.")
    system = parser.add_mutually_exclusive_group(required=True)
    system.add_argument("--generate", help="fairseq-generate output (run with --remove-bpe)")
    system.add_argument("--hyp", help="tokenized hypotheses, one per line")
    parser.add_argument("--ref", required=True, help="tokenized references, one per line")
    parser.add_argument("--lang", help="target language: also report detokenized sacreBLEU, chrF and chrF++")
    parser.add_argument("--detok-ref", help="raw (untokenized) references for sacreBLEU (with --lang)")
    parser.add_argument("--compound-split", action="store_true", help="also report compound-split BLEU")
    baseline = parser.add_mutually_exclusive_group()
    baseline.add_argument("--baseline-generate", help="baseline fairseq-generate output: adds p_value")
    baseline.add_argument("--baseline-hyp", help="baseline hypotheses file: adds p_value")
    parser.add_argument("--json", help="also write the scores to this JSON file")
    args = parser.parse_args(argv)

    refs = read_lines(args.ref)
    scores = score_translation(
        _hypotheses(args.generate, args.hyp, len(refs)), refs, args.lang,
        read_lines(args.detok_ref) if args.detok_ref else None, args.compound_split,
        _hypotheses(args.baseline_generate, args.baseline_hyp, len(refs)))
    text = json.dumps(scores, indent=1)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    print(text)
    return scores


if __name__ == "__main__":
    main(sys.argv[1:])
