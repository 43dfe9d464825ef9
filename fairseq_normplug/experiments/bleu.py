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
* significance tests in any metric of :data:`METRIC_SCORERS` (paired bootstrap, Koehn 2004;
  over seeds; permutation; Holm): :mod:`fairseq_normplug.experiments.significance`, whose
  names are importable from here too (:data:`SIGNIFICANCE_NAMES`).
* :func:`read_fairseq_generate`: hypotheses and references of a ``fairseq-generate`` output.
* :func:`score_translation`: all of the above for one system, as a dict (also the CLI)::

    python -m fairseq_normplug.experiments.bleu --generate gen.out --ref test.tok.de \\
        --lang de [--detok-ref test.de] [--compound-split] [--baseline-generate base_gen.out]

Inputs are lists of lines (one sentence each); :func:`read_lines` reads a file.
"""
import argparse
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.base import Metric

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


def check_parallel(hyps: Sequence[str], refs: Sequence[str], what: str = "hypotheses") -> None:
    if len(hyps) != len(refs):
        raise NormplugError(f"{len(hyps)} {what} but {len(refs)} references: line counts must match")
    if not refs:
        raise NormplugError("no sentences to score (empty references)")


def _bleu_score(metric: BLEU, hyps: Sequence[str], refs: Sequence[str]) -> BleuScore:
    check_parallel(hyps, refs)
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
    """Moses-detokenize each line (sacremoses, which also unescapes ``&apos;`` and friends;
    imported here: its 0.2 s import is paid only by the processes that detokenize)."""
    from sacremoses import MosesDetokenizer

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
    check_parallel(hyps, refs)
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


def metric_scorer(metric: str) -> MetricScorer:
    if metric not in METRIC_SCORERS:
        raise NormplugError(f"unknown metric {metric!r} for a significance test; choose from "
                            f"{', '.join(METRIC_SCORERS)}")
    return METRIC_SCORERS[metric]


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
        from fairseq_normplug.experiments.significance import paired_bootstrap  # it imports this module
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



#: the significance tests (experiments/significance.py), importable from here too
SIGNIFICANCE_NAMES = ("BootstrapResult", "paired_bootstrap", "paired_bootstrap_seeds", "SEED_AWARE_SAMPLES",
                      "SeedAwareBootstrapResult", "seed_aware_bootstrap", "holm_adjust", "EXACT_PERMUTATION_LIMIT",
                      "seeds_permutation_test", "estimate_ci")


def __getattr__(name: str):
    """``bleu.paired_bootstrap`` and the other names of :data:`SIGNIFICANCE_NAMES`, read from
    :mod:`fairseq_normplug.experiments.significance` (which imports this module)."""
    if name in SIGNIFICANCE_NAMES:
        from fairseq_normplug.experiments import significance
        return getattr(significance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
