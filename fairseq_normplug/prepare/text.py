"""Line-aligned text files: reading, counting, parallel line-by-line transforms, Moses
tokenization/detokenization (sacremoses) and the train length filter.

Lines are split on ``\\n`` only: a stray ``\\r`` or Unicode line separator inside a sentence
must never shift the alignment between the two sides. :func:`clean_line` replaces carriage
returns by spaces when a corpus is first written, because fairseq later reads files with
Python's universal newlines, which would split on them.
"""
import functools
import multiprocessing
import os
import re
import sys
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable, Iterator, Optional, Tuple

from tqdm import tqdm

from fairseq_normplug.atomic_files import move_into_place
from fairseq_normplug.errors import NormplugError

_CHUNK_LINES = 2000


def open_text(path: str, mode: str = "r"):
    """A UTF-8 text file whose lines end at ``\\n`` only."""
    return open(path, mode, encoding="utf-8", newline="\n")


def read_lines(path: str) -> Iterator[str]:
    """The lines of ``path`` without their newline."""
    try:
        with open_text(path) as f:
            for line in f:
                yield line.rstrip("\n")
    except UnicodeDecodeError as exc:
        raise NormplugError(f"{path} is not UTF-8 text ({exc})") from None


def clean_line(line: str) -> str:
    """A corpus line as stored in ``raw/``: carriage returns become spaces, outer white space
    is stripped (every tool downstream strips it too)."""
    return line.replace("\r", " ").strip()


def write_lines(path: str, lines: Iterable[str]) -> int:
    """Write ``lines`` (no newlines inside) to ``path``; return how many were written."""
    count = 0
    with open_text(path, "w") as f:
        for line in lines:
            f.write(line + "\n")
            count += 1
    return count


def count_lines(path: str) -> int:
    """Number of lines as :func:`read_lines` yields them (a last line without ``\\n`` counts)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def progress(total: Optional[int], desc: str):
    """A tqdm bar on stderr, shown only when stderr is a terminal."""
    return tqdm(total=total, desc=desc, unit=" lines", unit_scale=True, file=sys.stderr,
                disable=None, leave=False)


# ---------------------------------------------------------------------------------------
# Parallel line-by-line transforms. ``factory`` is a picklable callable (a module-level
# function or a functools.partial of one) returning the per-line function; each worker
# process calls it once.

_worker_fn: Optional[Callable[[str], str]] = None


def _init_worker(factory: Callable[[], Callable[[str], str]]) -> None:
    global _worker_fn
    _worker_fn = factory()


def _map_chunk(lines):
    return [_worker_fn(line) for line in lines]


def _chunks(lines: Iterator[str]):
    while True:
        chunk = list(islice(lines, _CHUNK_LINES))
        if not chunk:
            return
        yield chunk


def map_lines(in_path: str, out_path: str, factory: Callable[[], Callable[[str], str]],
              workers: int, desc: str) -> int:
    """Write ``fn(line)`` for every line of ``in_path`` to ``out_path`` (order kept), with
    ``workers`` processes; return the number of lines."""
    total = count_lines(in_path)
    with open_text(out_path, "w") as out, progress(total, desc) as bar:
        if workers <= 1 or total < 2 * _CHUNK_LINES:
            fn = factory()
            for line in read_lines(in_path):
                out.write(fn(line) + "\n")
                bar.update()
        else:
            with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(factory,)) as pool:
                for result in pool.imap(_map_chunk, _chunks(read_lines(in_path))):
                    out.writelines(line + "\n" for line in result)
                    bar.update(len(result))
    return total


# ---------------------------------------------------------------------------------------
# Moses tokenization with sacremoses, in place of the Moses perl scripts.

@dataclass(frozen=True)
class MosesSteps:
    """What is done to a raw line before it is split into tokens; mirrors the perl
    pipeline ``normalize-punctuation.perl | remove-non-printing-char.perl | tokenizer.perl``."""

    normalize_punctuation: bool = True
    remove_non_printing: bool = True
    right_quote_to_apostrophe: bool = False  # fairseq's WMT recipe does this on test sets
    aggressive_dash_splits: bool = True      # tokenizer.perl -a

    def describe(self, lang: str) -> str:
        """The equivalent Moses command line, for the manifest."""
        steps = []
        if self.right_quote_to_apostrophe:
            steps.append("sed \"s/\u2019/'/g\"")
        if self.normalize_punctuation:
            steps.append(f"normalize-punctuation.perl -l {lang}")
        if self.remove_non_printing:
            steps.append("remove-non-printing-char.perl")
        steps.append(f"tokenizer.perl{' -a' if self.aggressive_dash_splits else ''} -l {lang}")
        return " | ".join(steps) + "  (sacremoses)"


def _moses_lang(lang: str) -> str:
    """sacremoses language for a corpus language code (``pt_br`` -> ``pt``)."""
    return re.split(r"[-_]", lang)[0]


def moses_tokenizer(lang: str, steps: MosesSteps) -> Callable[[str], str]:
    """Factory (for :func:`map_lines`) of the tokenizing function of ``steps``."""
    import regex
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    tokenizer = MosesTokenizer(lang=_moses_lang(lang))
    normalizer = MosesPunctNormalizer(lang=_moses_lang(lang)) if steps.normalize_punctuation else None
    non_printing = regex.compile(r"\p{C}") if steps.remove_non_printing else None

    def tokenize(line: str) -> str:
        if steps.right_quote_to_apostrophe:
            line = line.replace("\u2019", "'")
        if normalizer is not None:
            line = normalizer.normalize(line)
        if non_printing is not None:
            line = non_printing.sub(" ", line)
        return tokenizer.tokenize(line, aggressive_dash_splits=steps.aggressive_dash_splits,
                                  return_str=True, escape=True)

    return tokenize


def moses_detokenizer(lang: str) -> Callable[[str], str]:
    """Factory of a Moses detokenizer (unescapes ``&apos;`` etc.), for references."""
    from sacremoses import MosesDetokenizer

    detokenizer = MosesDetokenizer(lang=_moses_lang(lang))
    return lambda line: detokenizer.detokenize(line.split(), unescape=True)


def tokenizer_factory(lang: str, steps: MosesSteps):
    return functools.partial(moses_tokenizer, lang, steps)


def detokenizer_factory(lang: str):
    return functools.partial(moses_detokenizer, lang)


# ---------------------------------------------------------------------------------------
# clean-corpus-n.perl equivalent, on whitespace tokens.

def filter_pairs(src_path: str, tgt_path: str, max_len: int,
                 max_ratio: Optional[float]) -> Tuple[int, int]:
    """Keep, in place, the pairs whose sides both have 1..``max_len`` tokens and (if
    ``max_ratio``) a length ratio of at most ``max_ratio``; return (kept, dropped)."""
    kept = dropped = 0
    src_tmp, tgt_tmp = src_path + ".filtering", tgt_path + ".filtering"
    with open_text(src_tmp, "w") as src_out, open_text(tgt_tmp, "w") as tgt_out:
        for src, tgt in zip(read_lines(src_path), read_lines(tgt_path)):
            n_src, n_tgt = len(src.split()), len(tgt.split())
            if (not 1 <= n_src <= max_len or not 1 <= n_tgt <= max_len
                    or (max_ratio is not None and max(n_src, n_tgt) > max_ratio * min(n_src, n_tgt))):
                dropped += 1
                continue
            src_out.write(src + "\n")
            tgt_out.write(tgt + "\n")
            kept += 1
    move_into_place(src_tmp, src_path)
    move_into_place(tgt_tmp, tgt_path)
    return kept, dropped
