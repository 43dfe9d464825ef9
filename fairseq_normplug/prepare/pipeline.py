"""The common path from parallel text to fairseq binarized data, shared by every corpus.

Output folder ``DEST`` (default ``data/<corpus>/<src>-<tgt>``)::

    raw/{train,valid,test}.{src,tgt}   the corpus's text as extracted (one sentence a line)
    tok/{train,valid,test}.{src,tgt}   tokenized (a copy of raw/ for pre-tokenized corpora);
                                       train is length-filtered, valid and test never are
    bpe/{train,valid,test}.{src,tgt}   subword-segmented, plus the model (codes or spm.model)
    bin/                               fairseq-preprocess --joined-dictionary output:
                                       point fairseq-train at DEST/bin
    ref/{valid,test}.tok.{tgt}         references for tokenized BLEU (= tok/, untouched)
    ref/{valid,test}.detok.{tgt}       references for sacreBLEU (original text, or
                                       Moses-detokenized when the corpus is only tokenized)
    manifest.json                      how it was made; written last

Everything is built in ``DEST.tmp-<pid>`` and renamed to ``DEST`` at the end, so an
interrupted or failed run never leaves a folder that looks complete. ``manifest.json``
holds the *recipe* (every option that shapes the output): a re-run with the same recipe does
nothing, one with another recipe refuses to touch ``DEST`` unless ``--overwrite``.
"""
import datetime
import glob
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Dict, List, Optional, Tuple

from fairseq_normplug.atomic_files import pid_running, publish_directory
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.command_start import run_command
from fairseq_normplug.prepare import bpe as bpe_methods
from fairseq_normplug.prepare.cli import DATA_ROOT, Log
from fairseq_normplug.prepare.text import (
    MosesSteps, count_lines, detokenizer_factory, filter_pairs, map_lines, read_lines, tokenizer_factory,
)

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")
#: a side of a split is refused when more than this share of its lines is empty (white space
#: only, or nothing left after tokenization): an empty source has nothing to translate, an empty
#: target nothing to learn or score, and more than half empty means the wrong file, not a few
#: missing sentences. A few empty lines are kept (the train filter drops them from train).
MOSTLY_EMPTY = 0.5
MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # 2: explicit subword_method


@dataclass
class Corpus:
    """What a corpus module hands to :func:`prepare`.

    ``write_raw(raw_dir)`` writes ``raw/{train,valid,test}.{src,tgt}`` (clean lines, see
    :func:`~fairseq_normplug.prepare.text.clean_line`) and returns the source's provenance
    for the manifest. ``tokenization[split]`` says how each split is tokenized; ``None``
    means the text is already tokenized and is used as it is.
    """

    name: str
    src: str
    tgt: str
    write_raw: Callable[[str], dict]
    tokenization: Dict[str, Optional[MosesSteps]]
    recipe: dict  # corpus-specific choices that shape the output (besides the common ones)
    #: the user's file behind each ``raw/`` file, ``{(split, lang): path}``, to name in errors
    source_files: Dict[Tuple[str, str], str] = field(default_factory=dict)


@dataclass
class Options:
    """The common options (see :func:`fairseq_normplug.prepare.cli.build_parser`)."""

    dest: str
    bpe: str
    bpe_merges: int
    max_len: int
    max_len_ratio: Optional[float]
    workers: int
    overwrite: bool


class FolderConflict(NormplugError):
    """``DEST`` exists and may not be reused or replaced as it is. The message ends with what
    the prepare_* commands offer (``--overwrite``, ``--dest``); :attr:`problem` is the message
    without that advice, for callers that offer other options (scripts/demo.sh)."""

    def __init__(self, problem: str, advice: str):
        super().__init__(f"{problem}; {advice}")
        self.problem = problem


def default_dest(corpus: str, src: str, tgt: str) -> str:
    return os.path.join(DATA_ROOT, corpus, f"{src}-{tgt}")


def options_from_args(args, corpus: str, src: str, tgt: str) -> Options:
    """Resolve the common options' defaults (destination, BPE size) for a corpus and pair."""
    return Options(
        dest=os.path.abspath(args.dest or default_dest(corpus, src, tgt)),
        bpe=args.bpe,
        bpe_merges=args.bpe_merges or bpe_methods.default_merges(corpus, src, tgt),
        max_len=args.max_len,
        max_len_ratio=args.max_len_ratio,
        workers=args.workers,
        overwrite=args.overwrite,
    )


def check_tools(bpe: str) -> None:
    """Fail early, with one clear message, if a Python tool the pipeline needs is missing."""
    needed = {"sacremoses": "sacremoses", bpe_methods.METHODS[bpe].module: bpe.replace("_", "-")}
    for module, package in needed.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise NormplugError(f"missing tool: {package} cannot be imported ({exc}); "
                                "run scripts/setup_env.sh to install it") from None
    # found, not imported: importing it would reconfigure this process's logging
    if importlib.util.find_spec("fairseq_cli") is None:
        raise NormplugError("missing tool: fairseq-preprocess (package fairseq_cli) is not "
                            "installed; run scripts/setup_env.sh to install it")


def recipe_of(corpus: Corpus, options: Options) -> dict:
    """Every choice that shapes the output, as JSON values (compared across runs)."""
    recipe = {
        "corpus": corpus.name, "src": corpus.src, "tgt": corpus.tgt,
        "tokenization": {split: None if steps is None else steps.describe("LANG")
                         for split, steps in corpus.tokenization.items()},
        "bpe": options.bpe, "bpe_merges": options.bpe_merges,
        "max_len": options.max_len, "max_len_ratio": options.max_len_ratio,
        **corpus.recipe,
    }
    return json.loads(json.dumps(recipe))


def is_up_to_date(dest: str, recipe: dict, overwrite: bool) -> bool:
    """True if ``dest`` was already made with ``recipe``, is complete, and ``overwrite`` is off.

    Raises :class:`FolderConflict` if ``dest`` exists but was made with another recipe (and
    ``overwrite`` is off) or was not made by these scripts at all (never replaced).
    """
    if not os.path.exists(dest):
        return False
    manifest = read_manifest(dest)
    if manifest is None:
        if os.path.isdir(dest) and not os.listdir(dest):
            return False
        raise FolderConflict(f"{dest} exists and was not made by these scripts (no readable {MANIFEST})",
                             "choose another --dest or remove it yourself")
    if overwrite:
        return False
    if manifest.get("recipe") == recipe:
        return not binarized_files_missing(dest, recipe["src"], recipe["tgt"])
    old = manifest.get("recipe", {})
    changes = ", ".join(f"{key}: {json.dumps(old.get(key))} -> {json.dumps(recipe.get(key))}"
                        for key in sorted(set(old) | set(recipe)) if old.get(key) != recipe.get(key))
    raise FolderConflict(f"{dest} was prepared with other options ({changes})",
                         "pass --overwrite to replace it, or choose another --dest")


def binarized_files_missing(dest: str, src: str, tgt: str) -> List[str]:
    """The files fairseq-train needs that ``dest/bin`` lacks (e.g. deleted by hand)."""
    needed = [f"dict.{lang}.txt" for lang in (src, tgt)]
    needed += [f"{split}.{src}-{tgt}.{lang}.{ext}" for split in SPLITS for lang in (src, tgt)
               for ext in ("bin", "idx")]
    return [name for name in needed if not os.path.isfile(os.path.join(dest, "bin", name))]


def read_manifest(dest: str) -> Optional[dict]:
    try:
        with open(os.path.join(dest, MANIFEST), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prepare(corpus: Corpus, options: Options, log: Log) -> str:
    """Build ``options.dest`` for ``corpus`` unless it is up to date; return its ``bin/``."""
    recipe = recipe_of(corpus, options)
    bin_dir = os.path.join(options.dest, "bin")
    if is_up_to_date(options.dest, recipe, options.overwrite):
        log(f"{options.dest} is up to date (same options); nothing to do. "
            f"fairseq-train data: {bin_dir}")
        return bin_dir
    _remove_stale_staging(options.dest)
    stage = f"{options.dest}.tmp-{os.getpid()}"
    os.makedirs(stage)
    try:
        manifest = _build(corpus, options, recipe, stage, log)
        with open(os.path.join(stage, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, ensure_ascii=False)
            f.write("\n")
        publish_directory(stage, options.dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log(f"done: {options.dest} (fairseq-train data: {bin_dir}, "
        f"--source-lang {corpus.src} --target-lang {corpus.tgt})")
    return bin_dir


class _Stage:
    """Paths inside the staging folder."""

    def __init__(self, root: str):
        self.root = root
        for name in ("raw", "tok", "bpe", "bin", "ref"):
            os.makedirs(self.dir(name))

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def file(self, name: str, split: str, lang: str) -> str:
        return os.path.join(self.root, name, f"{split}.{lang}")


def _build(corpus: Corpus, options: Options, recipe: dict, root: str, log: Log) -> dict:
    """Run every step in the staging folder ``root``; return the manifest."""
    stage, src, tgt = _Stage(root), corpus.src, corpus.tgt
    commands: List[str] = []
    counts: Dict[str, Dict[str, int]] = {}

    log("writing raw text")
    source = corpus.write_raw(stage.dir("raw"))
    counts["raw"] = check_parallel(stage.dir("raw"), src, tgt)
    check_not_mostly_empty(stage.dir("raw"), corpus)
    commands += _tokenize(corpus, stage, options.workers, log)
    check_not_mostly_empty(stage.dir("tok"), corpus, " after tokenization")
    commands += _write_references(corpus, stage, options.workers, log)
    kept, dropped, command = _filter_train(stage, src, tgt, options, log)
    commands.append(command)
    counts["tok"] = check_parallel(stage.dir("tok"), src, tgt)
    method = bpe_methods.METHODS[options.bpe]
    commands += _segment(method, stage, src, tgt, options, log)
    counts["bpe"] = check_parallel(stage.dir("bpe"), src, tgt)
    commands.append(_binarize(stage, src, tgt, options.workers, log))
    counts["bin"] = _binarized_sizes(stage.dir("bin"), src, tgt)
    if counts["bin"] != counts["bpe"]:
        raise RuntimeError(f"fairseq-preprocess wrote {counts['bin']} sentences for {counts['bpe']}")

    return {
        "manifest_version": MANIFEST_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe,
        "subword_method": method.name,  # fairseq's post-processing name (--remove-bpe); read by the runner
        "source": source,
        "commands": commands,
        "line_counts": counts,
        "train_filter": {"kept": kept, "dropped": dropped},
        "subword_model": method.model_stats(stage.dir("bpe")),
        "dictionary_size": count_lines(os.path.join(stage.dir("bin"), f"dict.{src}.txt")),
        "fairseq_train": {"data": "bin", "source_lang": src, "target_lang": tgt,
                          "note": "joined dictionary: use --share-all-embeddings"},
        "versions": _versions(options.bpe),
    }


def _tokenize(corpus: Corpus, stage: _Stage, workers: int, log: Log) -> List[str]:
    """raw/ -> tok/: Moses tokenization where the corpus needs it, else a copy."""
    log("tokenizing" if any(corpus.tokenization.values()) else "text is already tokenized: copying it")
    commands = []
    for split in SPLITS:
        steps = corpus.tokenization[split]
        for lang in (corpus.src, corpus.tgt):
            if steps is None:
                shutil.copyfile(stage.file("raw", split, lang), stage.file("tok", split, lang))
            else:
                map_lines(stage.file("raw", split, lang), stage.file("tok", split, lang),
                          tokenizer_factory(lang, steps), workers, f"tokenize {split}.{lang}")
        commands.append(f"tok/{split}: " + ("copy of raw/ (already tokenized)" if steps is None else
                                           " / ".join(steps.describe(lang) for lang in (corpus.src, corpus.tgt))))
    return commands


def _write_references(corpus: Corpus, stage: _Stage, workers: int, log: Log) -> List[str]:
    """ref/: target side of valid and test, tokenized (for tokenized BLEU) and detokenized
    (for sacreBLEU: the original text, or a Moses detokenization of pre-tokenized text)."""
    log("writing references")
    tgt = corpus.tgt
    commands = []
    for split in EVAL_SPLITS:
        shutil.copyfile(stage.file("tok", split, tgt), stage.file("ref", split, f"tok.{tgt}"))
        detok = stage.file("ref", split, f"detok.{tgt}")
        if corpus.tokenization[split] is None:
            map_lines(stage.file("raw", split, tgt), detok, detokenizer_factory(tgt), workers,
                      f"detokenize {split}.{tgt}")
            commands.append(f"ref/{split}.detok.{tgt}: detokenizer.perl -l {tgt} < raw/{split}.{tgt} (sacremoses)")
        else:
            shutil.copyfile(stage.file("raw", split, tgt), detok)
            commands.append(f"ref/{split}.detok.{tgt}: copy of raw/{split}.{tgt}")
    commands.append(f"ref/{{valid,test}}.tok.{tgt}: copies of tok/")
    return commands


def _filter_train(stage: _Stage, src: str, tgt: str, options: Options, log: Log):
    """tok/train: keep pairs of 1..max_len tokens a side (and a bounded length ratio)."""
    ratio = f", length ratio <= {options.max_len_ratio}" if options.max_len_ratio else ""
    log(f"filtering train: 1..{options.max_len} tokens per side{ratio}")
    kept, dropped = filter_pairs(stage.file("tok", "train", src), stage.file("tok", "train", tgt),
                                 options.max_len, options.max_len_ratio)
    log(f"train: kept {kept} pairs, dropped {dropped}")
    if kept == 0:
        raise NormplugError(f"no training pair has 1..{options.max_len} tokens per side{ratio}: "
                            "the train split is empty after filtering")
    ratio_flag = f" -ratio {options.max_len_ratio}" if options.max_len_ratio else ""
    return kept, dropped, (f"tok/train: clean-corpus-n.perl{ratio_flag} train {src} {tgt} train 1 "
                           f"{options.max_len} (in Python; train only)")


def _segment(method, stage: _Stage, src: str, tgt: str, options: Options, log: Log) -> List[str]:
    """tok/ -> bpe/: learn the joint subword model on both train sides, apply it everywhere."""
    log(f"learning a joint {options.bpe} model of size {options.bpe_merges} on train")
    learn_text = os.path.join(stage.dir("bpe"), "learn.txt")
    bpe_methods.learn_input([stage.file("tok", "train", src), stage.file("tok", "train", tgt)], learn_text)
    commands = [method.learn(learn_text, stage.dir("bpe"), options.bpe_merges, options.workers)]
    os.remove(learn_text)
    log("applying the subword model")
    for split in SPLITS:
        for lang in (src, tgt):
            map_lines(stage.file("tok", split, lang), stage.file("bpe", split, lang),
                      method.segmenter(stage.dir("bpe")), options.workers, f"segment {split}.{lang}")
    commands.append(f"bpe/SPLIT.LANG: {method.describe_apply()} < tok/SPLIT.LANG")
    return commands


def _binarize(stage: _Stage, src: str, tgt: str, workers: int, log: Log) -> str:
    """bpe/ -> bin/ with fairseq-preprocess and a joined dictionary; returns the command."""
    log("binarizing with fairseq-preprocess")
    args = ["--source-lang", src, "--target-lang", tgt]
    for split in SPLITS:
        args += [f"--{split}pref", os.path.join(stage.dir("bpe"), split)]
    args += ["--destdir", stage.dir("bin"), "--joined-dictionary", "--workers", str(workers)]
    command = [sys.executable, "-m", "fairseq_cli.preprocess", *args]
    proc = run_command(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # the tests fork it
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise NormplugError(f"fairseq-preprocess failed with exit status {proc.returncode}: {last}")
    return "fairseq-preprocess " + " ".join(args).replace(stage.root, "DEST")


def check_parallel(folder: str, src: str, tgt: str) -> Dict[str, int]:
    """Line counts of each split; raises if the two sides differ or a split is empty."""
    counts = {}
    for split in SPLITS:
        n_src = count_lines(os.path.join(folder, f"{split}.{src}"))
        n_tgt = count_lines(os.path.join(folder, f"{split}.{tgt}"))
        if n_src != n_tgt:
            raise NormplugError(f"split '{split}' is not parallel: {n_src} lines in {src}, "
                                f"{n_tgt} lines in {tgt}")
        if n_src == 0:
            raise NormplugError(f"split '{split}' is empty")
        counts[split] = n_src
    return counts


def mostly_empty_problem(what: str, split: str, empty: int, total: int, after: str = "") -> Optional[str]:
    """One line when more than :data:`MOSTLY_EMPTY` of the ``total`` lines of ``what`` (one side
    of ``split``: a file) are empty, else None."""
    if total == 0 or empty <= MOSTLY_EMPTY * total:
        return None
    return (f"{what} (split '{split}'): {empty} of {total} lines are empty{after}; at most "
            f"{MOSTLY_EMPTY:.0%} of a side's lines may be empty (a sentence needs text on both sides "
            f"to train on or to score)")


def check_not_mostly_empty(folder: str, corpus: Corpus, after: str = "") -> None:
    """Refuse (:func:`mostly_empty_problem`) a side of a split of ``folder`` (raw/ or tok/) that
    is mostly empty, naming the user's file (``corpus.source_files``) where there is one."""
    for split in SPLITS:
        for lang in (corpus.src, corpus.tgt):
            path = os.path.join(folder, f"{split}.{lang}")
            total = empty = 0
            for line in read_lines(path):
                total += 1
                empty += not line.strip()
            what = corpus.source_files.get((split, lang), f"the {corpus.name} corpus's {split}.{lang}")
            problem = mostly_empty_problem(what, split, empty, total, after)
            if problem:
                raise NormplugError(problem)


def _binarized_sizes(bin_dir: str, src: str, tgt: str) -> Dict[str, int]:
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    sizes = {}
    for split in SPLITS:
        lengths = {len(MMapIndexedDataset(os.path.join(bin_dir, f"{split}.{src}-{tgt}.{lang}")))
                   for lang in (src, tgt)}
        if len(lengths) != 1:
            raise RuntimeError(f"bin/{split}: the two sides hold different numbers of sentences")
        sizes[split] = lengths.pop()
    return sizes


def _versions(bpe: str) -> Dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for package in ("fairseq-normplug", "fairseq-fixed", "fairseq", "sacremoses",
                    bpe.replace("_", "-")):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _remove_stale_staging(dest: str) -> None:
    """Delete ``DEST.tmp-<pid>`` folders that runs killed outright left behind."""
    for stage in glob.glob(glob.escape(dest) + ".tmp-*"):
        pid = stage.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_running(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)


