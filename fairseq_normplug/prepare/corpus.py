"""``scripts/prepare_corpus.sh RAW_DIR --src SRC --tgt TGT``: any parallel corpus given as
files ``RAW_DIR/{train,valid,test}.{SRC,TGT}`` (``dev`` may stand for ``valid``), one
sentence a line, through the common pipeline.

Untokenized text is Moses-tokenized with sacremoses (punctuation normalization, non-printing
characters removed, ``-a`` hyphen splitting: the WMT recipe's tokenization); pass
``--tokenized`` when the files are already tokenized so that they are not tokenized twice.
"""
import os

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.prepare import pipeline
from fairseq_normplug.prepare.cli import Log, build_parser, run_main, validate_common
from fairseq_normplug.prepare.download import fingerprint
from fairseq_normplug.prepare.text import MosesSteps, clean_line, read_lines, write_lines

PROG = "prepare_corpus.sh"
#: File-name stems accepted for each split, in order of preference.
STEMS = {"train": ("train",), "valid": ("valid", "dev"), "test": ("test",)}
#: Folder names that describe a processing stage rather than the corpus.
STAGE_FOLDER_NAMES = ("raw", "tok", "tokenized", "orig")

DESCRIPTION = """\
Prepare a parallel corpus given as RAW_DIR/{train,valid|dev,test}.{SRC,TGT} for
fairseq-train: tokenize (unless --tokenized), length-filter train, joint BPE, binarize.
"""
EPILOG = """\
examples:
  scripts/prepare_corpus.sh ../shared/data/ted_az_en/tok --src az --tgt en --tokenized
  scripts/prepare_corpus.sh ../shared/data/multi30k_de_en/raw --src de --tgt en

Default output: data/NAME/SRC-TGT, NAME being RAW_DIR's folder name (its parent's name when
it is raw, tok, tokenized or orig): data/ted_az_en/az-en for the first example. Layout and
the shared corpora: docs/data.md.
"""


def corpus_name(raw_dir: str) -> str:
    """Name for the default output folder: RAW_DIR's name, or its parent's for a stage folder."""
    path = os.path.abspath(raw_dir)
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if name in STAGE_FOLDER_NAMES else name


def find_split_files(raw_dir: str, src: str, tgt: str) -> dict:
    """``{(split, lang): path}``; raises if a file is missing or valid/dev is ambiguous."""
    if not os.path.isdir(raw_dir):
        raise NormplugError(f"corpus folder not found: {raw_dir}")
    found = {}
    for split, stems in STEMS.items():
        present = [stem for stem in stems
                   if any(os.path.isfile(os.path.join(raw_dir, f"{stem}.{lang}")) for lang in (src, tgt))]
        if len(present) > 1:
            raise NormplugError(f"{raw_dir} holds both {' and '.join(present)} files for the "
                                f"{split} split; keep one")
        stem = present[0] if present else stems[0]
        for lang in (src, tgt):
            path = os.path.join(raw_dir, f"{stem}.{lang}")
            if not os.path.isfile(path):
                wanted = " or ".join(f"{name}.{lang}" for name in stems)
                raise NormplugError(f"{raw_dir} lacks {wanted} (pair {src}-{tgt})")
            found[split, lang] = path
    return found


def main(argv) -> None:
    parser = build_parser(PROG, DESCRIPTION, EPILOG, downloads=False)
    parser.add_argument("raw_dir", metavar="RAW_DIR", help="folder of {train,valid|dev,test}.{SRC,TGT}")
    parser.add_argument("--src", required=True, help="source language (file suffix)")
    parser.add_argument("--tgt", required=True, help="target language (file suffix)")
    parser.add_argument("--tokenized", action="store_true",
                        help="the text is already tokenized: do not tokenize it again")
    args = parser.parse_args(argv)
    validate_common(args)
    if args.src == args.tgt:
        raise NormplugError(f"source and target are the same language ({args.src})")
    files = find_split_files(args.raw_dir, args.src, args.tgt)
    pipeline.check_tools(args.bpe)

    log = Log(PROG)
    options = pipeline.options_from_args(args, corpus_name(args.raw_dir), args.src, args.tgt)

    def write_raw(raw_dir: str) -> dict:
        for (split, lang), path in files.items():
            write_lines(os.path.join(raw_dir, f"{split}.{lang}"), map(clean_line, read_lines(path)))
        return {"files": {f"{split}.{lang}": fingerprint(path) for (split, lang), path in files.items()}}

    steps = None if args.tokenized else MosesSteps()
    corpus = pipeline.Corpus(
        name=corpus_name(args.raw_dir), src=args.src, tgt=args.tgt, write_raw=write_raw,
        tokenization={split: steps for split in pipeline.SPLITS},
        recipe={"raw_dir": os.path.abspath(args.raw_dir)}, source_files=files,
    )
    pipeline.prepare(corpus, options, log)


if __name__ == "__main__":
    run_main(PROG, main)
