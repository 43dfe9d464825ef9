"""``scripts/demo.sh``: the main job on a built-in default.

A small version of the paper's main comparison, end to end on 2 CPU cores:
PostNorm + LayerNorm + warmup vs PreNorm + FixNorm + ScaleNorm + NoWarmup vs PreNorm + DyT
(``configs/experiments/demo.json``), trained, translated, scored, tabulated and plotted.

By default the corpus is the project's SYNTHETIC one (fairseq_normplug.synthetic_corpus: no
download; BLEU on it only shows that training works). ``--corpus DIR --src L --tgt L`` takes
any raw parallel corpus laid out as {train,valid or dev,test}.{L} instead, e.g.
``--corpus ../shared/data/multi30k_de_en/raw --src de --tgt en``.

The corpus is prepared (as by scripts/prepare_corpus.sh) into data/NAME-HASH/SRC-TGT-bpeN:
NAME is the corpus folder's name (its parent's for raw, tok, tokenized or orig), HASH 8 hex
digits of a sha256 of the folder's absolute path, its six files' content and --tokenized.
A re-run reuses the prepared data; an edited or moved corpus is prepared anew into a new
folder (older ones can be deleted), and corpora with the same folder name never collide.
"""
import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import launchers
from fairseq_normplug.experiments.configs import PROJECT_DIR, load_recipes, load_table
from fairseq_normplug.experiments.reproduce import report_failures, run_table
from fairseq_normplug.prepare import corpus as prepare_corpus
from fairseq_normplug.prepare.download import sha256_of
from fairseq_normplug.prepare.pipeline import FolderConflict
from fairseq_normplug.synthetic_corpus import SRC_LANG, TGT_LANG, write_corpus

PRESETS = {"tiny": "cpu_tiny", "small": "cpu_small"}
DATA_ROOT = os.path.join(PROJECT_DIR, "data")
SYNTHETIC_DIR = os.path.join(DATA_ROOT, "synthetic")


def corpus_folder(raw_dir: str, src: str, tgt: str, tokenized: bool) -> str:
    """``NAME-HASH``, the data/ folder of a corpus: unique to its location, content and
    --tokenized (all of which shape the prepared data; see the module docstring)."""
    files = prepare_corpus.find_split_files(raw_dir, src, tgt)
    identity = {"raw_dir": os.path.abspath(raw_dir), "tokenized": tokenized,
                "files": {f"{split}.{lang}": sha256_of(path) for (split, lang), path in sorted(files.items())}}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()
    return f"{prepare_corpus.corpus_name(raw_dir)}-{digest[:8]}"


def prepare(raw_dir: str, src: str, tgt: str, dest: str, tokenized: bool, bpe_merges: int) -> str:
    """Tokenize/BPE/binarize ``raw_dir`` into ``dest`` with scripts/prepare_corpus.sh's code."""
    argv = [raw_dir, "--src", src, "--tgt", tgt, "--dest", dest, "--bpe-merges", str(bpe_merges)]
    try:
        prepare_corpus.main(argv + (["--tokenized"] if tokenized else []))
    except FolderConflict as conflict:  # its advice names prepare_corpus.sh's options
        raise NormplugError(f"{conflict.problem}; delete that folder to let demo.sh prepare the "
                            "corpus again") from None
    return dest


def main(argv=None):
    """demo.sh; exits 1 when a run failed (a diverged run is a result: exit 0)."""
    parser = argparse.ArgumentParser(prog="demo.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--corpus", metavar="DIR", help="raw parallel corpus (default: built-in synthetic)")
    parser.add_argument("--src", help="source language of --corpus")
    parser.add_argument("--tgt", help="target language of --corpus")
    parser.add_argument("--tokenized", action="store_true", help="--corpus text is already tokenized")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                        help="size: small (default, ~10 min on 2 cores) or tiny (a few minutes)")
    parser.add_argument("--bpe-merges", type=int, default=4000, help="joint BPE merges (default 4000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], metavar="N",
                        help="train every row with each of these seeds (default: 1); cells show mean ± sd")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="runs at once on this machine, the cores shared among them (default 1)")
    parser.add_argument("--out", default=os.path.join(PROJECT_DIR, "results", "demo"),
                        help="output folder: results.csv, results.md, PNG figures (default results/demo)")
    args = parser.parse_args(argv)
    if args.corpus and not (args.src and args.tgt):
        parser.error("--corpus needs --src and --tgt")
    if not args.corpus and (args.src or args.tgt):
        parser.error("--src/--tgt describe --corpus; pass --corpus too")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    started = time.time()
    try:
        launcher = launchers.LocalLauncher(jobs=args.jobs)
        if args.corpus:
            raw, src, tgt, tokenized = args.corpus, args.src, args.tgt, args.tokenized
            name = prepare_corpus.corpus_name(raw)
        else:
            raw = os.path.join(SYNTHETIC_DIR, "raw")
            if not os.path.exists(os.path.join(raw, "README")):
                print(f"[demo] writing the built-in SYNTHETIC corpus to {raw}")
                write_corpus(raw)
            src, tgt, tokenized, name = SRC_LANG, TGT_LANG, True, "synthetic"
        pair = f"{src}-{tgt}"
        dest = os.path.join(DATA_ROOT, corpus_folder(raw, src, tgt, tokenized), f"{pair}-bpe{args.bpe_merges}")
        data_dir = prepare(raw, src, tgt, dest, tokenized, args.bpe_merges)
        table = load_table("demo")
        table = dataclasses.replace(table, recipe=load_recipes()[PRESETS[args.preset]], pairs=[pair],
                                    title=f"{table.title} ({name}, preset {args.preset})")
        results = run_table(table, [pair], {pair: data_dir}, os.path.join(args.out, "runs"), args.out,
                            echo_failures=False, seeds=args.seeds, launcher=launcher)
    except NormplugError as error:
        sys.exit(f"demo.sh: error: {error}")
    failed = getattr(results, "failed", None) or []
    print(f"[demo] done in {(time.time() - started) / 60:.1f} minutes; results in {args.out}"
          + (f"; {len(failed)} run(s) failed" if failed else ""))
    if failed:  # the last lines name them; a diverged run is a result, not a failure
        report_failures(failed)
        sys.exit(1)


if __name__ == "__main__":
    main()
