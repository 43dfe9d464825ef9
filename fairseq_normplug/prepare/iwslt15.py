"""``scripts/prepare_iwslt15.sh``: IWSLT'15 English-Vietnamese as released by Stanford NLP
(https://nlp.stanford.edu/projects/nmt/): ``train`` for training, ``tst2012`` as valid and
``tst2013`` as test. The release is already tokenized (Moses-style, with ``&apos;``-type
escapes) and is used as it is.
"""
import os

from fairseq_normplug.prepare import pipeline
from fairseq_normplug.prepare.cli import (
    Log, add_release_args, build_parser, release_files, run_main, validate_common,
)
from fairseq_normplug.prepare.download import fetch, fingerprint
from fairseq_normplug.prepare.text import clean_line, read_lines, write_lines

PROG = "prepare_iwslt15.sh"
BASE_URL = "https://nlp.stanford.edu/projects/nmt/data/iwslt15.en-vi/"
LANGS = ("en", "vi")
FILE_OF_SPLIT = {"train": "train", "valid": "tst2012", "test": "tst2013"}
DOWNLOAD_SUBDIR = "iwslt15.en-vi"

DESCRIPTION = """\
Prepare IWSLT'15 English-Vietnamese (Stanford NLP release) for fairseq-train:
joint BPE and binarization of the already tokenized text.
"""
EPILOG = f"""\
examples:
  scripts/prepare_iwslt15.sh                         # en->vi, downloads 6 files once
  scripts/prepare_iwslt15.sh --archive-dir ~/iwslt15  # offline: folder with the 6 files
  scripts/prepare_iwslt15.sh --src vi --tgt en

The files: {' '.join(f'{name}.{lang}' for name in FILE_OF_SPLIT.values() for lang in LANGS)}
from {BASE_URL}. Default output: data/iwslt15/SRC-TGT (layout: docs/data.md).
"""


def main(argv) -> None:
    parser = build_parser(PROG, DESCRIPTION, EPILOG, downloads=True)
    add_release_args(parser, LANGS, "the six release files")
    args = parser.parse_args(argv)
    validate_common(args)
    files = release_files(args, LANGS, [f"{name}.{lang}" for name in FILE_OF_SPLIT.values()
                                        for lang in LANGS], DOWNLOAD_SUBDIR, "the IWSLT'15 release")
    pipeline.check_tools(args.bpe)

    log = Log(PROG)
    options = pipeline.options_from_args(args, "iwslt15", args.src, args.tgt)

    def write_raw(raw_dir: str) -> dict:
        for name, path in files.items():
            if args.archive_dir is None:
                fetch(BASE_URL + name, path, log)
        for split, name in FILE_OF_SPLIT.items():
            for lang in LANGS:
                write_lines(os.path.join(raw_dir, f"{split}.{lang}"),
                            map(clean_line, read_lines(files[f"{name}.{lang}"])))
        return {"files": {name: fingerprint(path) for name, path in files.items()},
                "splits": {split: name for split, name in FILE_OF_SPLIT.items()}}

    corpus = pipeline.Corpus(
        name="iwslt15", src=args.src, tgt=args.tgt, write_raw=write_raw,
        tokenization={split: None for split in pipeline.SPLITS}, recipe={},
    )
    pipeline.prepare(corpus, options, log)


if __name__ == "__main__":
    run_main(PROG, main)
