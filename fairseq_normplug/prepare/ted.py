"""``scripts/prepare_ted.sh SRC TGT``: a language pair of the multilingual TED corpus of
Qi et al. (2018) (``ted_talks.tar.gz``, https://github.com/neulab/word-embeddings-for-nmt).

The archive holds ``all_talks_{train,dev,test}.tsv``: a header ``talk_name<TAB>en<TAB>es...``
and one row per sentence, one column per language, text already Moses-tokenized. The pair's
two columns are taken from each file, dropping rows where either cell is empty or marked
missing (``__NULL__``, or ``_ _ NULL _ _`` where the marker itself was tokenized); the text
is not tokenized again. dev becomes fairseq's ``valid``.

Language codes with a hyphen (``pt-br``, ``zh-cn``, ``fr-ca``, ``zh-tw``) are written with an
underscore in file names and fairseq language flags (``pt_br``), which fairseq needs.
"""
import os
from typing import Iterable

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.prepare import pipeline
from fairseq_normplug.prepare.archives import read_members
from fairseq_normplug.prepare.cli import Log, build_parser, run_main, validate_common
from fairseq_normplug.prepare.download import fetch, fingerprint
from fairseq_normplug.prepare.text import clean_line, open_text

PROG = "prepare_ted.sh"
URL = "http://phontron.com/data/ted_talks.tar.gz"
ARCHIVE_NAME = "ted_talks.tar.gz"
TSV_OF_SPLIT = {"train": "all_talks_train.tsv", "valid": "all_talks_dev.tsv", "test": "all_talks_test.tsv"}
MISSING_MARKERS = ("__NULL__", "_ _ NULL _ _")
#: The archive's language columns (checked again against the archive's own header).
LANGUAGES = (
    "en", "es", "pt-br", "fr", "ru", "he", "ar", "ko", "zh-cn", "it", "ja", "zh-tw", "nl", "ro",
    "tr", "de", "vi", "pl", "pt", "bg", "el", "fa", "sr", "hu", "hr", "uk", "cs", "id", "th",
    "sv", "sk", "sq", "lt", "da", "calv", "my", "sl", "mk", "fr-ca", "fi", "hy", "hi", "nb",
    "ka", "mn", "et", "ku", "gl", "mr", "zh", "ur", "eo", "ms", "az", "ta", "bn", "kk", "be",
    "eu", "bs",
)

DESCRIPTION = """\
Prepare a language pair of the TED corpus of Qi et al. (2018) for fairseq-train:
extract its columns, subword-segment (joint BPE) and binarize.
"""
EPILOG = f"""\
examples:
  scripts/prepare_ted.sh gl en                     # downloads {ARCHIVE_NAME} once
  scripts/prepare_ted.sh en he --archive ~/ted_talks.tar.gz
  scripts/prepare_ted.sh sk en --bpe sentencepiece --dest data/ted/sk-en-spm

The paper's pairs: gl en, sk en, ar en, en he. Default output: data/ted/SRC-TGT, with
fairseq-train data in its bin/ (layout: docs/data.md). Language codes: {' '.join(LANGUAGES)}.
"""


def file_lang(lang: str) -> str:
    """Language code as used in file names and fairseq flags (``pt-br`` -> ``pt_br``)."""
    return lang.replace("-", "_")


def is_missing(cell: str) -> bool:
    return not cell.strip() or any(marker in cell for marker in MISSING_MARKERS)


def extract_pair(archive: str, src: str, tgt: str, raw_dir: str) -> dict:
    """Write ``raw/{split}.{src,tgt}`` from the archive's TSV files; return per-split counts
    of rows read and kept."""
    stats = {}

    def handler(split: str):
        def handle(lines: Iterable[str]) -> None:
            lines = iter(lines)
            header = [column.strip() for column in next(lines, "").split("\t")]
            for lang in (src, tgt):
                if lang not in header:
                    languages = " ".join(column for column in header if column != "talk_name")
                    raise NormplugError(f"language '{lang}' is not a column of {TSV_OF_SPLIT[split]} "
                                        f"in {archive} (columns: {languages})")
            i_src, i_tgt = header.index(src), header.index(tgt)
            rows = kept = 0
            with open_text(os.path.join(raw_dir, f"{split}.{file_lang(src)}"), "w") as out_src, \
                    open_text(os.path.join(raw_dir, f"{split}.{file_lang(tgt)}"), "w") as out_tgt:
                for line in lines:
                    cells = line.split("\t")
                    rows += 1
                    cell_src = cells[i_src] if i_src < len(cells) else ""
                    cell_tgt = cells[i_tgt] if i_tgt < len(cells) else ""
                    if is_missing(cell_src) or is_missing(cell_tgt):
                        continue
                    out_src.write(clean_line(cell_src) + "\n")
                    out_tgt.write(clean_line(cell_tgt) + "\n")
                    kept += 1
            stats[split] = {"rows": rows, "kept": kept}
        return handle

    read_members(archive, {TSV_OF_SPLIT[split]: handler(split) for split in pipeline.SPLITS})
    return stats


def main(argv) -> None:
    parser = build_parser(PROG, DESCRIPTION, EPILOG, downloads=True)
    parser.add_argument("src", metavar="SRC", help="source language code, e.g. gl")
    parser.add_argument("tgt", metavar="TGT", help="target language code, e.g. en")
    parser.add_argument("--archive", metavar="PATH",
                        help=f"local {ARCHIVE_NAME} to use instead of downloading {URL}")
    args = parser.parse_args(argv)
    validate_common(args)
    for lang in (args.src, args.tgt):
        if lang not in LANGUAGES:
            raise NormplugError(f"unknown TED language '{lang}' in pair {args.src}-{args.tgt} "
                                f"(known: {' '.join(LANGUAGES)})")
    if args.src == args.tgt:
        raise NormplugError(f"source and target are the same language ({args.src})")
    if args.archive is not None and not os.path.isfile(args.archive):
        raise NormplugError(f"archive not found: {args.archive}")
    pipeline.check_tools(args.bpe)

    log = Log(PROG)
    src, tgt = file_lang(args.src), file_lang(args.tgt)
    options = pipeline.options_from_args(args, "ted", src, tgt)

    def write_raw(raw_dir: str) -> dict:
        archive = args.archive or fetch(URL, os.path.join(args.download_dir, ARCHIVE_NAME), log)
        log(f"extracting {args.src}-{args.tgt} from {archive}")
        stats = extract_pair(archive, args.src, args.tgt, raw_dir)
        return {"archive": fingerprint(archive), "columns": [args.src, args.tgt], "rows": stats,
                "dropped": f"rows with an empty cell or {' / '.join(MISSING_MARKERS)} on either side"}

    corpus = pipeline.Corpus(
        name="ted", src=src, tgt=tgt, write_raw=write_raw,
        tokenization={split: None for split in pipeline.SPLITS}, recipe={},
    )
    pipeline.prepare(corpus, options, log)


if __name__ == "__main__":
    run_main(PROG, main)
