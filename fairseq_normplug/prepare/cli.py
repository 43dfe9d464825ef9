"""Command-line plumbing shared by the ``prepare_*`` entry points: the common options,
progress log lines and the one-line error report for bad input."""
import argparse
import os
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.resources import PROJECT_DIR

#: default outputs go to ``data/`` of the checkout, or of the current directory when the
#: package is installed from a wheel (:mod:`fairseq_normplug.resources`)
DATA_ROOT = os.path.join(PROJECT_DIR, "data")
DEFAULT_DOWNLOAD_DIR = os.path.join(DATA_ROOT, "downloads")
DEFAULT_MAX_LEN = 250


class Log:
    """Progress lines ``[prepare_ted] message`` on stderr (stdout stays free)."""

    def __init__(self, prog: str):
        self.prefix = f"[{prog.rsplit('.', 1)[0]}]"

    def __call__(self, message: str) -> None:
        print(f"{self.prefix} {message}", file=sys.stderr, flush=True)


def build_parser(prog: str, description: str, epilog: str, downloads: bool) -> argparse.ArgumentParser:
    """A parser with the options every ``prepare_*`` command shares; the caller adds its own."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    out = parser.add_argument_group("output and processing (common to all prepare_* scripts)")
    out.add_argument("--dest", metavar="DIR",
                     help="output folder; fairseq-train reads DIR/bin (default: see below)")
    out.add_argument("--bpe", choices=("subword_nmt", "sentencepiece"), default="subword_nmt",
                     help="joint subword model learned on both sides of train (default: %(default)s)")
    out.add_argument("--bpe-merges", type=int, metavar="N",
                     help="subword-nmt merge operations, or the sentencepiece vocabulary size "
                          "(default: by corpus and pair from configs/bpe.json)")
    out.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, metavar="N",
                     help="drop train pairs with a side longer than N tokens, or empty "
                          "(valid/test are never filtered; default: %(default)s)")
    out.add_argument("--max-len-ratio", type=float, metavar="R",
                     help="also drop train pairs whose token-length ratio exceeds R "
                          "(default: off; 1.5 for WMT'14 as in fairseq's recipe)")
    out.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                     help="parallel processes for tokenization, BPE and fairseq-preprocess "
                          "(default: %(default)s)")
    out.add_argument("--overwrite", action="store_true",
                     help="rebuild DIR even if it is up to date, or replace one made with other options")
    if downloads:
        out.add_argument("--download-dir", default=DEFAULT_DOWNLOAD_DIR, metavar="DIR",
                         help="where downloads are kept and resumed (default: data/downloads)")
    return parser


def add_release_args(parser: argparse.ArgumentParser, langs: Sequence[str], holding: str) -> None:
    """``--src``/``--tgt`` (default ``langs``, either direction) and ``--archive-dir`` for a
    release of one fixed language pair (IWSLT'15, WMT'14)."""
    parser.add_argument("--src", default=langs[0], help="source language (default: %(default)s)")
    parser.add_argument("--tgt", default=langs[1], help="target language (default: %(default)s)")
    parser.add_argument("--archive-dir", metavar="DIR",
                        help=f"local folder holding {holding}, instead of downloading")


def release_files(args: argparse.Namespace, langs: Sequence[str], names: Iterable[str],
                  download_subdir: str, release: str) -> Dict[str, str]:
    """``{file name: local path}`` of a fixed-pair release's files, in ``--archive-dir`` or in
    the download folder; rejects another pair and, with ``--archive-dir``, missing files."""
    if {args.src, args.tgt} != set(langs):
        raise NormplugError(f"unknown language pair {args.src}-{args.tgt}: {release} has "
                            f"{'-'.join(langs)} only (either direction)")
    folder = args.archive_dir or os.path.join(args.download_dir, download_subdir)
    files = {name: os.path.join(folder, name) for name in names}
    if args.archive_dir is not None:
        missing = [name for name, path in files.items() if not os.path.isfile(path)]
        if missing:
            raise NormplugError(f"{args.archive_dir} lacks {', '.join(missing)}")
    return files


def validate_common(args: argparse.Namespace) -> None:
    """Reject out-of-range common option values (cheap, before any work)."""
    if args.bpe_merges is not None and args.bpe_merges < 1:
        raise NormplugError(f"--bpe-merges must be a positive number, got {args.bpe_merges}")
    if args.max_len < 1:
        raise NormplugError(f"--max-len must be a positive number, got {args.max_len}")
    if args.max_len_ratio is not None and args.max_len_ratio < 1:
        raise NormplugError(f"--max-len-ratio must be at least 1, got {args.max_len_ratio}")
    if args.workers < 1:
        raise NormplugError(f"--workers must be at least 1, got {args.workers}")


def run_main(prog: str, main: Callable[[List[str]], None], argv: Optional[List[str]] = None) -> None:
    """Run ``main(argv)``; report a :class:`NormplugError` as one line ``PROG: error: ...``
    on stderr and exit with status 2, like argparse does for a bad flag."""
    try:
        main(sys.argv[1:] if argv is None else argv)
    except NormplugError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2)
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted; nothing was published\n")
        raise SystemExit(130)
