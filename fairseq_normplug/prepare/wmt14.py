"""``scripts/prepare_wmt14.sh``: WMT'14 English-German the way fairseq's
``examples/translation/prepare-wmt14en2de.sh --icml17`` does it, with pip tools instead of
cloned Moses scripts.

- train: Europarl v7 + Common Crawl + News Commentary v9, each line through Moses punctuation
  normalization, non-printing-character removal and ``tokenizer.perl -a`` (sacremoses);
- valid: newstest2013, test: newstest2014 (full, from the SGML files), with ``\u2019`` made
  an apostrophe and ``tokenizer.perl -a``, as the recipe does for test;
- train pairs longer than 250 tokens a side or with a length ratio above 1.5 are dropped
  (``clean-corpus-n.perl -ratio 1.5 ... 1 250``), then a joint 40k BPE.

Two deliberate differences from the recipe: validation is newstest2013 (the standard WMT'14
dev set) instead of every 100th training line, and the length filter counts tokens before
BPE, on train only, rather than subwords after it on train and valid.
"""
import os
import re
from typing import Iterable

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.prepare import pipeline
from fairseq_normplug.prepare.archives import read_members
from fairseq_normplug.prepare.cli import (
    Log, add_release_args, build_parser, release_files, run_main, validate_common,
)
from fairseq_normplug.prepare.download import fetch, fingerprint
from fairseq_normplug.prepare.text import MosesSteps, clean_line, open_text

PROG = "prepare_wmt14.sh"
LANGS = ("en", "de")
MAX_LEN_RATIO = 1.5
#: (archive file name, URL) as in fairseq's recipe with --icml17 (the WMT'14 corpora).
ARCHIVES = {
    "training-parallel-europarl-v7.tgz": "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
    "training-parallel-commoncrawl.tgz": "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "training-parallel-nc-v9.tgz": "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
    "dev.tgz": "http://data.statmt.org/wmt17/translation-task/dev.tgz",
    "test-full.tgz": "http://statmt.org/wmt14/test-full.tgz",
}
#: Training corpora: archive -> member path without the language suffix.
TRAIN_CORPORA = {
    "training-parallel-europarl-v7.tgz": "training/europarl-v7.de-en",
    "training-parallel-commoncrawl.tgz": "commoncrawl.de-en",
    "training-parallel-nc-v9.tgz": "training/news-commentary-v9.de-en",
}
VALID_MEMBER = "dev/newstest2013"
DOWNLOAD_SUBDIR = "wmt14"
TRAIN_STEPS = MosesSteps(normalize_punctuation=True, remove_non_printing=True,
                         right_quote_to_apostrophe=False, aggressive_dash_splits=True)
EVAL_STEPS = MosesSteps(normalize_punctuation=False, remove_non_printing=False,
                        right_quote_to_apostrophe=True, aggressive_dash_splits=True)
_SEG = re.compile(r"<seg[^>]*>\s*(.*?)\s*</seg>")

DESCRIPTION = """\
Prepare WMT'14 English-German for fairseq-train as fairseq's recipe does:
Moses tokenization (sacremoses), length filter, joint 40k BPE, binarization.
"""
EPILOG = f"""\
examples:
  scripts/prepare_wmt14.sh                          # en->de, downloads ~1.5 GB once
  scripts/prepare_wmt14.sh --archive-dir ~/wmt14     # offline: folder with the 5 archives
  scripts/prepare_wmt14.sh --src de --tgt en --workers 16

The archives: {' '.join(ARCHIVES)} (URLs as in fairseq's recipe).
Default output: data/wmt14/SRC-TGT (layout: docs/data.md). Several hours on a few cores:
tokenizing 4.5M pairs and learning 40k merges dominate.
"""


def test_member(side: str, lang: str) -> str:
    """newstest2014 SGML member: ``side`` is ``src`` (source text) or ``ref`` (reference)."""
    return f"test-full/newstest2014-deen-{side}.{lang}.sgm"


def sgml_segments(lines: Iterable[str]) -> Iterable[str]:
    """The text of each ``<seg id="N">...</seg>`` line, as the recipe's grep/sed extract it."""
    for line in lines:
        match = _SEG.search(line)
        if match:
            yield match.group(1)


def write_member(path: str, counts: dict, key, mode: str = "w", segments: bool = False):
    """A handler for :func:`read_members` writing a member's clean lines (its SGML segments if
    ``segments``) to ``path`` and their number to ``counts[key]``."""
    def handle(lines: Iterable[str]) -> None:
        with open_text(path, mode) as out:
            counts[key] = 0
            for line in sgml_segments(lines) if segments else lines:
                out.write(clean_line(line) + "\n")
                counts[key] += 1
    return handle


def extract(archives: dict, src: str, tgt: str, raw_dir: str, log) -> dict:
    """Write ``raw/{train,valid,test}.{src,tgt}`` from the five archives; return provenance."""
    def raw(split: str, lang: str) -> str:
        return os.path.join(raw_dir, f"{split}.{lang}")

    counts = {}
    for name, member in TRAIN_CORPORA.items():
        log(f"extracting {member} from {name}")
        read_members(archives[name], {f"{member}.{lang}": write_member(raw("train", lang), counts,
                                                                       (member, lang), mode="a")
                                      for lang in LANGS})
        if counts[member, "en"] != counts[member, "de"]:
            raise NormplugError(f"{member} in {name} is not parallel: {counts[member, 'en']} lines "
                                f"in en, {counts[member, 'de']} in de")
    log(f"extracting {VALID_MEMBER} and newstest2014")
    read_members(archives["dev.tgz"], {f"{VALID_MEMBER}.{lang}": write_member(raw("valid", lang), counts,
                                                                              ("valid", lang))
                                       for lang in LANGS})
    read_members(archives["test-full.tgz"], {
        test_member(side, lang): write_member(raw("test", lang), counts, ("test", lang), segments=True)
        for side, lang in (("src", src), ("ref", tgt))})
    return {"archives": {name: fingerprint(path) for name, path in archives.items()},
            "train_corpora": {member: counts[member, "en"] for member in TRAIN_CORPORA.values()},
            "valid": VALID_MEMBER, "test": [test_member("src", src), test_member("ref", tgt)]}


def main(argv) -> None:
    parser = build_parser(PROG, DESCRIPTION, EPILOG, downloads=True)
    parser.set_defaults(max_len_ratio=MAX_LEN_RATIO)
    add_release_args(parser, LANGS, "the five archives")
    args = parser.parse_args(argv)
    validate_common(args)
    archives = release_files(args, LANGS, ARCHIVES, DOWNLOAD_SUBDIR, "this WMT'14 recipe")
    pipeline.check_tools(args.bpe)

    log = Log(PROG)
    src, tgt = args.src, args.tgt
    options = pipeline.options_from_args(args, "wmt14", src, tgt)

    def write_raw(raw_dir: str) -> dict:
        if args.archive_dir is None:
            for name, path in archives.items():
                fetch(ARCHIVES[name], path, log)
        return extract(archives, src, tgt, raw_dir, log)

    corpus = pipeline.Corpus(
        name="wmt14", src=src, tgt=tgt, write_raw=write_raw,
        tokenization={"train": TRAIN_STEPS, "valid": EVAL_STEPS, "test": EVAL_STEPS},
        recipe={"valid": "newstest2013", "test": "newstest2014 (full)"},
    )
    pipeline.prepare(corpus, options, log)


if __name__ == "__main__":
    run_main(PROG, main)
