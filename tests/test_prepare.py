"""The prepare_* scripts end to end on tiny corpora in the real source layouts (offline):
line counts and content at each stage, data fairseq-train accepts, idempotent re-runs,
refusal to mix options, and one clear error for each kind of bad input. The scripts
(scripts/prepare_*.sh) run for real; where a test runs a preparation in this process (its
logic the subject), the pipeline's fairseq-preprocess runs in a forked child of it
(tests/inprocess.py's forked_commands), and fairseq-train reads the prepared data in-process."""
import glob
import json
import os
import shutil
import sys

import pytest

from conftest import REPO, SHARED_DATA, cli, failure_report, run_cli, run_parallel
from inprocess import forked_commands, run_fairseq
from prepare_fixtures import (
    LONG_TOKENS, expected_pair, make_iwslt15_dir, make_raw_corpus, make_ted_archive,
    make_wmt14_archives, ted_rows, write_pairs,
)

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.prepare import corpus as corpus_cli
from fairseq_normplug.prepare import pipeline
from fairseq_normplug.prepare import iwslt15 as iwslt15_cli
from fairseq_normplug.prepare import ted as ted_cli
from fairseq_normplug.prepare import wmt14 as wmt14_cli
from fairseq_normplug.prepare.cli import run_main
from fairseq_normplug.prepare.text import MosesSteps, count_lines, map_lines, tokenizer_factory

TINY = ["--bpe-merges", "50", "--workers", "1"]
SPLITS = ("train", "valid", "test")


def script(name: str) -> str:
    return os.path.join(REPO, "scripts", f"prepare_{name}.sh")


def lines(path: str):
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n") for line in f]


def manifest(dest: str) -> dict:
    with open(os.path.join(dest, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def run_in_process(module, argv, capsys):
    """Run a prepare command in this process; return (exit status, stderr)."""
    capsys.readouterr()
    try:
        run_main(module.PROG, module.main, argv)
        status = 0
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


def assert_nothing_published(dest: str) -> None:
    assert not os.path.exists(dest), f"{dest} was created"
    assert not glob.glob(dest + ".tmp-*"), "a staging folder was left behind"


def undo_bpe(line: str) -> str:
    return line.replace("@@ ", "")


@pytest.fixture(scope="module", autouse=True)
def pipeline_commands_forked():
    """fairseq-preprocess of a preparation run in this process: a fork of it, not a new Python."""
    with forked_commands():
        yield


# --- TED ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ted_archive(tmp_path_factory):
    return make_ted_archive(str(tmp_path_factory.mktemp("ted") / "ted_talks.tar.gz"))


@pytest.fixture(scope="module")
def ted_gl_en(ted_archive, tmp_path_factory):
    """gl-en prepared by the real script."""
    dest = str(tmp_path_factory.mktemp("ted_out") / "gl-en")
    run_cli([script("ted"), "gl", "en", "--archive", ted_archive, "--dest", dest, *TINY])
    return dest


@pytest.mark.slow
def test_ted_stages_line_counts_and_content(ted_gl_en):
    expected = expected_pair(ted_rows(), "gl", "en")
    for split in SPLITS:  # raw: exactly the complete rows, in order, right columns
        assert list(zip(lines(f"{ted_gl_en}/raw/{split}.gl"), lines(f"{ted_gl_en}/raw/{split}.en"))) \
            == expected[split]
    # tok: the text is not tokenized again; train loses only the over-long pair
    for split in ("valid", "test"):
        assert lines(f"{ted_gl_en}/tok/{split}.en") == lines(f"{ted_gl_en}/raw/{split}.en")
    long_pairs = [pair for pair in expected["train"] if len(pair[0].split()) > 250]
    assert len(long_pairs) == 1
    assert list(zip(lines(f"{ted_gl_en}/tok/train.gl"), lines(f"{ted_gl_en}/tok/train.en"))) \
        == [pair for pair in expected["train"] if pair not in long_pairs]
    assert any(len(line.split()) == LONG_TOKENS for line in lines(f"{ted_gl_en}/tok/test.gl"))
    # bpe: same lines, subword-segmented, reversible
    for split in SPLITS:
        for lang in ("gl", "en"):
            bpe = lines(f"{ted_gl_en}/bpe/{split}.{lang}")
            assert [undo_bpe(line) for line in bpe] == lines(f"{ted_gl_en}/tok/{split}.{lang}")
    assert any("@@ " in line for line in lines(f"{ted_gl_en}/bpe/train.en"))
    # references: tokenized = tok/, detokenized: Moses-detokenized, same lines
    for split in ("valid", "test"):
        assert lines(f"{ted_gl_en}/ref/{split}.tok.en") == lines(f"{ted_gl_en}/tok/{split}.en")
        assert len(lines(f"{ted_gl_en}/ref/{split}.detok.en")) == len(expected[split])
    detok = lines(f"{ted_gl_en}/ref/valid.detok.en")  # tokenized rows end in ". it 's"
    assert all(line.endswith("it's") and " 's" not in line and " ." not in line for line in detok)
    # bin: a joined dictionary, split names fairseq expects, counts recorded
    files = set(os.listdir(f"{ted_gl_en}/bin"))
    for split in SPLITS:
        for lang in ("gl", "en"):
            assert {f"{split}.gl-en.{lang}.bin", f"{split}.gl-en.{lang}.idx"} <= files
    assert lines(f"{ted_gl_en}/bin/dict.gl.txt") == lines(f"{ted_gl_en}/bin/dict.en.txt")
    info = manifest(ted_gl_en)
    train_kept = len(expected["train"]) - 1
    assert info["line_counts"]["raw"] == {split: len(expected[split]) for split in SPLITS}
    assert info["line_counts"]["bin"] == {"train": train_kept, "valid": len(expected["valid"]),
                                          "test": len(expected["test"])}
    assert info["train_filter"] == {"kept": train_kept, "dropped": 1}
    assert info["recipe"]["bpe"] == "subword_nmt" and info["recipe"]["bpe_merges"] == 50
    assert info["subword_method"] == "subword_nmt" and info["manifest_version"] == 2
    assert info["subword_model"]["merges_learned"] == 50
    assert info["source"]["archive"]["size"] == os.path.getsize(info["source"]["archive"]["path"])
    assert any(cmd.startswith("fairseq-preprocess") and "--joined-dictionary" in cmd
               for cmd in info["commands"])
    assert not glob.glob(ted_gl_en + ".tmp-*")


@pytest.mark.slow
def test_ted_data_is_accepted_by_fairseq_train(ted_gl_en, tmp_path):
    proc = run_fairseq([
        cli("fairseq-train"), f"{ted_gl_en}/bin", "--arch", "transformer_tiny",
        "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
        "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--share-all-embeddings", "--max-update", "2", "--cpu", "--max-tokens", "500",
        "--num-workers", "0", "--no-save", "--optimizer", "adam", "--lr", "1e-3",
    ], cwd=str(tmp_path))
    assert "num_updates 2" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_ted_rerun_with_same_options_does_nothing(ted_gl_en, ted_archive, capsys):
    before = os.stat(f"{ted_gl_en}/manifest.json").st_mtime_ns
    status, err = run_in_process(ted_cli, ["gl", "en", "--archive", ted_archive, "--dest", ted_gl_en,
                                           *TINY], capsys)
    assert status == 0 and "up to date" in err
    assert os.stat(f"{ted_gl_en}/manifest.json").st_mtime_ns == before


@pytest.mark.slow
def test_ted_other_options_are_refused_unless_overwrite(ted_archive, tmp_path, capsys):
    """Also: a target language with a hyphen (pt-br -> pt_br), sentencepiece, and a re-run
    that rebuilds a folder missing some of its binarized files."""
    dest = str(tmp_path / "en-pt_br")
    base = ["en", "pt-br", "--archive", ted_archive, "--dest", dest, "--workers", "1"]
    spm = base + ["--bpe", "sentencepiece", "--bpe-merges", "80"]
    status, err = run_in_process(ted_cli, spm, capsys)
    assert status == 0, err
    os.remove(f"{dest}/bin/valid.en-pt_br.en.bin")
    status, err = run_in_process(ted_cli, spm, capsys)
    assert status == 0 and "up to date" not in err, err
    assert os.path.exists(f"{dest}/bpe/spm.model") and os.path.exists(f"{dest}/bin/train.en-pt_br.pt_br.bin")
    expected = expected_pair(ted_rows(), "en", "pt-br")
    assert lines(f"{dest}/raw/valid.pt_br") == [tgt for _, tgt in expected["valid"]]
    assert "▁" in lines(f"{dest}/bpe/valid.en")[0]
    first = manifest(dest)

    status, err = run_in_process(ted_cli, base + ["--bpe-merges", "50"], capsys)
    assert status == 2
    assert err.count("\n") == 1 and "prepared with other options" in err and "--overwrite" in err
    assert "bpe: \"sentencepiece\" -> \"subword_nmt\"" in err
    assert manifest(dest) == first

    status, err = run_in_process(ted_cli, base + ["--bpe-merges", "50", "--overwrite"], capsys)
    assert status == 0, err
    assert manifest(dest)["recipe"]["bpe"] == "subword_nmt"
    assert not os.path.exists(f"{dest}/bpe/spm.model")
    assert not glob.glob(dest + ".*-*")


# --- raw corpus, WMT'14, IWSLT'15 ----------------------------------------------------

@pytest.mark.slow
def test_raw_corpus_is_tokenized_filtered_and_binarized(tmp_path):
    raw = str(tmp_path / "wmtlike")
    pairs = make_raw_corpus(raw)  # valid is named dev.*
    dest = str(tmp_path / "out")
    run_cli([script("corpus"), raw, "--src", "en", "--tgt", "de", "--dest", dest, *TINY])
    assert lines(f"{dest}/raw/valid.en") == [en for en, _ in pairs["dev"]]
    tok = lines(f"{dest}/tok/valid.en")
    assert len(tok) == len(pairs["dev"])
    assert any("&apos;s" in line for line in tok) and any(" @-@ " in line for line in tok)
    assert not any("\u201c" in line for line in tok)  # punctuation normalized
    info = manifest(dest)
    assert info["train_filter"] == {"kept": len(pairs["train"]) - 2, "dropped": 2}  # long, empty side
    assert info["line_counts"]["bin"] == {"train": 198, "valid": 20, "test": 20}
    assert any(len(line.split()) >= LONG_TOKENS for line in lines(f"{dest}/tok/test.en"))
    assert lines(f"{dest}/ref/test.detok.de") == [de for _, de in pairs["test"]]
    assert lines(f"{dest}/ref/test.tok.de") == lines(f"{dest}/tok/test.de")
    assert info["recipe"]["raw_dir"] == os.path.abspath(raw)


@pytest.mark.slow
def test_tokenized_flag_keeps_text_as_is(tmp_path, capsys):
    raw = str(tmp_path / "tok")
    for split, count in (("train", 60), ("valid", 8), ("test", 8)):
        write_pairs(raw, split, [(f"a b , c {i} &apos;s .", f"x y {i} .") for i in range(count)])
    dest = str(tmp_path / "out")
    status, err = run_in_process(corpus_cli, [raw, "--src", "en", "--tgt", "de", "--tokenized",
                                              "--dest", dest, *TINY], capsys)
    assert status == 0, err
    assert lines(f"{dest}/tok/train.en") == lines(f"{raw}/train.en")
    assert lines(f"{dest}/ref/test.detok.de")[0] == "x y 0."


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """scripts/prepare_wmt14.sh and scripts/prepare_iwslt15.sh run for real (at the same time)
    on local files in their source layouts: {name: (fixture content, dest, input folder)}."""
    root = tmp_path_factory.mktemp("wrapped")
    archives, files = str(root / "wmt14"), str(root / "iwslt15")
    made = {"wmt14": (make_wmt14_archives(archives), str(root / "wmt14-out"), archives),
            "iwslt15": (make_iwslt15_dir(files), str(root / "iwslt15-out"), files)}
    procs = run_parallel([[script(name), "--archive-dir", folder, "--dest", dest, *TINY]
                          for name, (_, dest, folder) in made.items()], peers=False)
    for proc in procs:
        assert proc.returncode == 0, failure_report(proc)
    return made


@pytest.mark.slow
def test_wmt14_from_local_archives(wrapped):
    content, dest, _ = wrapped["wmt14"]
    train = [pair for member in wmt14_cli.TRAIN_CORPORA.values() for pair in content[member]]
    assert list(zip(lines(f"{dest}/raw/train.en"), lines(f"{dest}/raw/train.de"))) == train
    assert lines(f"{dest}/raw/valid.de") == [de for _, de in content["dev"]]
    assert lines(f"{dest}/raw/test.en") == [en for en, _ in content["test"]]  # from the SGML
    assert lines(f"{dest}/tok/test.de")[0] == "Es ist &apos; hier &apos; ."
    assert lines(f"{dest}/ref/test.detok.de")[0] == "Es ist \u2019hier\u2019."
    info = manifest(dest)
    assert info["recipe"]["max_len_ratio"] == 1.5
    assert info["train_filter"]["dropped"] == 1  # the 7:1 pair
    assert info["line_counts"]["bin"] == {"train": len(train) - 1, "valid": 15, "test": 12}
    assert "normalize-punctuation.perl" in info["recipe"]["tokenization"]["train"]
    assert "normalize-punctuation.perl" not in info["recipe"]["tokenization"]["test"]


@pytest.mark.slow
def test_iwslt15_from_local_files(wrapped):
    counts, dest, files = wrapped["iwslt15"]
    info = manifest(dest)
    assert info["line_counts"]["bin"] == {"train": counts["train"], "valid": counts["tst2012"],
                                          "test": counts["tst2013"]}
    assert lines(f"{dest}/tok/test.vi") == lines(f"{files}/tst2013.vi")  # not tokenized twice
    assert lines(f"{dest}/ref/test.detok.vi")[0].endswith(', đó là "thật".')
    assert lines(f"{dest}/ref/valid.tok.vi") == lines(f"{files}/tst2012.vi")


# --- bad input: one clear error each, nothing published -----------------------------------

def _truncated(path, out):
    with open(path, "rb") as f:
        data = f.read()
    with open(out, "wb") as f:
        f.write(data[: len(data) // 2])
    return out


def _archive_without_dev(out):
    rows = ted_rows()
    del rows["dev"]
    return make_ted_archive(out, rows)


def _archive_with_empty_dev(out):
    rows = ted_rows()
    for row in rows["dev"]:
        row["gl"] = "__NULL__"
    return make_ted_archive(out, rows)


def _not_an_archive(out):
    with open(out, "w") as f:
        f.write("talk_name\ten\tgl\n")
    return out


@pytest.mark.parametrize("case, make_archive, pair, message", [
    ("unknown-language", None, ("xx", "en"), "unknown TED language 'xx'"),
    ("language-not-in-archive", None, ("ar", "en"), "language 'ar' is not a column"),
    ("missing-archive", "missing", ("gl", "en"), "archive not found"),
    ("truncated-archive", "truncated", ("gl", "en"), "truncated"),
    ("not-an-archive", _not_an_archive, ("gl", "en"), "not a readable tar archive"),
    ("archive-without-dev", _archive_without_dev, ("gl", "en"), "lacks all_talks_dev.tsv"),
    ("empty-split", _archive_with_empty_dev, ("gl", "en"), "split 'valid' is empty"),
])
def test_ted_bad_input(case, make_archive, pair, message, ted_archive, tmp_path, capsys):
    archive = ted_archive
    if make_archive == "missing":
        archive = str(tmp_path / "nowhere.tar.gz")
    elif make_archive == "truncated":
        archive = _truncated(ted_archive, str(tmp_path / "cut.tar.gz"))
    elif make_archive is not None:
        archive = make_archive(str(tmp_path / "bad.tar.gz"))
    dest = str(tmp_path / "out")
    status, err = run_in_process(ted_cli, [*pair, "--archive", archive, "--dest", dest, *TINY], capsys)
    assert status == 2
    error_lines = [line for line in err.splitlines() if not line.startswith("[")]
    assert len(error_lines) == 1 and error_lines[0].startswith("prepare_ted.sh: error: "), err
    assert message in error_lines[0]
    assert_nothing_published(dest)


def _mismatched(raw):
    with open(f"{raw}/train.de", "a", encoding="utf-8") as f:
        f.write("one more line\n")


def _empty_test(raw):
    for lang in ("en", "de"):
        open(f"{raw}/test.{lang}", "w").close()


def _missing_test(raw):
    os.remove(f"{raw}/test.de")


def _valid_and_dev(raw):
    shutil.copy(f"{raw}/dev.en", f"{raw}/valid.en")


def _whitespace_dev_source(raw):
    with open(f"{raw}/dev.en", "w", encoding="utf-8") as f:
        f.write(" \t \n" * 20)


def _invisible_test_source(raw):
    """11 of the 20 test source lines hold only a zero-width space, which tokenization removes."""
    with open(f"{raw}/test.en", encoding="utf-8") as f:
        kept = f.read().splitlines()[11:]
    with open(f"{raw}/test.en", "w", encoding="utf-8") as f:
        f.write("\u200b\n" * 11 + "\n".join(kept) + "\n")


def _empty_train_target(raw):
    with open(f"{raw}/train.de", "w", encoding="utf-8") as f:
        f.write("\n" * 150 + "Ein Satz.\n" * 50)


@pytest.mark.parametrize("damage, message", [
    (_mismatched, "split 'train' is not parallel: 200 lines in en, 201 lines in de"),
    (_empty_test, "split 'test' is empty"),
    (_missing_test, "lacks test.de"),
    (_valid_and_dev, "both valid and dev"),
    (_whitespace_dev_source, "/raw/dev.en (split 'valid'): 20 of 20 lines are empty; at most 50% of a side's lines "
                             "may be empty"),
    (_invisible_test_source, "/raw/test.en (split 'test'): 11 of 20 lines are empty after tokenization; at most 50%"),
    (_empty_train_target, "/raw/train.de (split 'train'): 150 of 200 lines are empty; at most 50%"),
])
def test_corpus_bad_input(damage, message, tmp_path, capsys):
    raw = str(tmp_path / "raw")
    make_raw_corpus(raw)
    damage(raw)
    dest = str(tmp_path / "out")
    status, err = run_in_process(corpus_cli, [raw, "--src", "en", "--tgt", "de", "--dest", dest, *TINY], capsys)
    assert status == 2
    assert "prepare_corpus.sh: error: " in err and message in err, err
    assert len([line for line in err.splitlines() if not line.startswith("[")]) == 1, err
    assert_nothing_published(dest)


def test_mostly_empty_means_more_than_half():
    from fairseq_normplug.prepare.pipeline import mostly_empty_problem

    assert mostly_empty_problem("dev.en", "valid", 10, 20) is None  # half: kept
    assert mostly_empty_problem("dev.en", "valid", 11, 20).startswith("dev.en (split 'valid'): 11 of 20 lines are empty")
    assert mostly_empty_problem("dev.en", "valid", 0, 0) is None  # an empty split is refused by check_parallel


def write_binarized(folder: str, sentences: dict) -> None:
    """A prepared folder's bin/ (dictionaries, ``{split}.src-tgt.{lang}.bin/idx``), ref/ and
    manifest.json; ``sentences[(split, lang)]``: token-id lists, </s> (2) appended."""
    import numpy
    import torch
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder

    os.makedirs(os.path.join(folder, "bin"))
    os.makedirs(os.path.join(folder, "ref"))
    for lang in ("src", "tgt"):
        with open(os.path.join(folder, "bin", f"dict.{lang}.txt"), "w") as f:
            f.write("".join(f"w{i} 1\n" for i in range(20)))
    for (split, lang), lines_of_ids in sentences.items():
        prefix = os.path.join(folder, "bin", f"{split}.src-tgt.{lang}")
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
        for ids in lines_of_ids:
            builder.add_item(torch.tensor(ids + [2], dtype=torch.int32))
        builder.finalize(prefix + ".idx")
    with open(os.path.join(folder, "ref", "test.tok.tgt"), "w") as f:
        f.write("w4 w5\n" * 10)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"subword_method": "subword_nmt"}, f)


def test_preflight_reports_a_mostly_empty_prepared_split(tmp_path):
    from fairseq_normplug.experiments.preflight import data_problems

    text = [[4, 5, 6]] * 10
    sentences = {(split, lang): text for split in SPLITS for lang in ("src", "tgt")}
    good = str(tmp_path / "good")
    write_binarized(good, sentences)
    assert data_problems(good, "src-tgt") == []
    bad = str(tmp_path / "bad")
    write_binarized(bad, {**sentences, ("valid", "src"): [[]] * 10, ("test", "tgt"): [[]] * 6 + [[4]] * 4})
    assert data_problems(bad, "src-tgt") == [
        f"src-tgt: {bad}/bin/valid.src-tgt.src (split 'valid'): 10 of 10 lines are empty; at most 50% of a side's "
        f"lines may be empty (a sentence needs text on both sides to train on or to score)",
        f"src-tgt: {bad}/bin/test.src-tgt.tgt (split 'test'): 6 of 10 lines are empty; at most 50% of a side's "
        f"lines may be empty (a sentence needs text on both sides to train on or to score)"]


def test_unknown_pairs_and_missing_local_files(tmp_path, capsys):
    dest = str(tmp_path / "out")
    status, err = run_in_process(iwslt15_cli, ["--src", "en", "--tgt", "de", "--dest", dest], capsys)
    assert status == 2 and "unknown language pair en-de" in err
    status, err = run_in_process(wmt14_cli, ["--src", "en", "--tgt", "fr", "--dest", dest], capsys)
    assert status == 2 and "unknown language pair en-fr" in err
    status, err = run_in_process(iwslt15_cli, ["--archive-dir", str(tmp_path), "--dest", dest], capsys)
    assert status == 2 and "lacks train.en" in err
    archives = str(tmp_path / "wmt14")
    make_wmt14_archives(archives)
    _truncated(f"{archives}/dev.tgz", f"{archives}/dev.tgz.cut")
    os.replace(f"{archives}/dev.tgz.cut", f"{archives}/dev.tgz")
    status, err = run_in_process(wmt14_cli, ["--archive-dir", archives, "--dest", dest, *TINY], capsys)
    assert status == 2 and "dev.tgz is not a readable tar archive or is truncated" in err, err
    assert_nothing_published(dest)


def test_a_failed_fairseq_preprocess_is_one_line_error_with_its_output(tmp_path, capsys):
    """fairseq-preprocess (started through the runner's seam, here a fork) fails on a stage
    without BPE text: its exit status and last line in one NormplugError, its output on stderr."""
    stage = pipeline._Stage(str(tmp_path / "stage"))
    with pytest.raises(NormplugError) as error:
        pipeline._binarize(stage, "en", "de", 1, lambda message: None)
    message = str(error.value)
    assert "\n" not in message
    # the joined dictionary reads a set of the two sides' files: either one is missed first
    assert message in {f"fairseq-preprocess failed with exit status 1: FileNotFoundError: [Errno 2] "
                       f"No such file or directory: '{os.path.join(stage.dir('bpe'), 'train.' + lang)}'"
                       for lang in ("en", "de")}
    assert "Traceback" in capsys.readouterr().err
    assert not glob.glob(os.path.join(stage.dir("bin"), "*.bin"))


def test_foreign_destination_is_never_replaced(ted_archive, tmp_path, capsys):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        status, err = run_in_process(ted_cli, ["gl", "en", "--archive", ted_archive, "--dest", str(dest),
                                               *TINY, *extra], capsys)
        assert status == 2 and "was not made by these scripts" in err
    assert (dest / "notes.txt").read_text() == "keep me"


def test_missing_tool_is_reported(tmp_path, capsys, monkeypatch):
    """subword-nmt made unimportable in this process (None in sys.modules: ``import subword_nmt``
    raises ImportError, as it does where the package is not installed)."""
    monkeypatch.setitem(sys.modules, "subword_nmt", None)
    raw = str(tmp_path / "raw")
    make_raw_corpus(raw)
    dest = str(tmp_path / "out")
    status, err = run_in_process(corpus_cli, [raw, "--src", "en", "--tgt", "de", "--dest", dest], capsys)
    assert status == 2
    assert "prepare_corpus.sh: error: missing tool: subword-nmt cannot be imported" in err
    assert_nothing_published(dest)


@pytest.mark.parametrize("module, option", [
    (ted_cli, "--archive"), (iwslt15_cli, "--archive-dir"), (wmt14_cli, "--archive-dir"),
    (corpus_cli, "--tokenized"),
])
def test_help_of_every_script(module, option, capsys):
    """--help lists the options. Each scripts/prepare_*.sh wrapper runs for real above (TED,
    corpus, WMT'14 and IWSLT'15, on the local fixtures)."""
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {module.PROG}")
    for flag in (option, "--dest", "--bpe", "--bpe-merges", "--max-len", "--workers", "--overwrite"):
        assert flag in out
    assert os.access(script(module.PROG[len("prepare_"):-len(".sh")]), os.X_OK)


# --- real data (optional) -------------------------------------------------------------------

TED_AZ_EN = os.path.join(SHARED_DATA, "ted_az_en", "tok")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(TED_AZ_EN), reason="../shared/data/ted_az_en is absent")
def test_shared_ted_az_en_has_the_published_split_sizes(tmp_path, capsys):
    dest = str(tmp_path / "az-en")
    status, err = run_in_process(corpus_cli, [TED_AZ_EN, "--src", "az", "--tgt", "en", "--tokenized",
                                              "--dest", dest, "--workers", "2"], capsys)
    assert status == 0, err
    info = manifest(dest)
    assert info["line_counts"]["bin"] == {"train": 5946, "valid": 671, "test": 903}
    assert info["recipe"]["bpe_merges"] == 3000  # configs/bpe.json: az-en
    # the text is used as it is, outer white space aside
    assert lines(f"{dest}/tok/test.en") == [line.strip() for line in lines(f"{TED_AZ_EN}/test.en")]


def test_parallel_line_map_keeps_order_and_count(tmp_path):
    source = tmp_path / "in.en"
    source.write_text("".join(f"Line {i}, isn't it?\n" for i in range(5000)) + "last\rline", encoding="utf-8")
    out = str(tmp_path / "out.en")
    assert map_lines(str(source), out, tokenizer_factory("en", MosesSteps()), 2, "test") == 5001
    result = lines(out)
    assert count_lines(out) == 5001 and result[4999] == "Line 4999 , isn &apos;t it ?"
    assert result[-1].startswith("last")  # a carriage return is not a line break


MULTI30K = os.path.join(SHARED_DATA, "multi30k_de_en", "raw")
#: Multi30K's published split sizes
MULTI30K_SIZES = {"train": 29000, "valid": 1014, "test": 1000}
#: the train pairs prepared here: the first tenth (tokenization and fairseq-preprocess's
#: binarization take time in proportion to the lines: the full 29,000 took ~13 CPU s more)
MULTI30K_TRAIN_PAIRS = 2900


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k_de_en is absent")
def test_shared_multi30k_untokenized_is_tokenized_and_binarized(tmp_path, capsys):
    """The real untokenized Multi30K de-en (29,000 / 1,014 / 1,000 pairs; here the first 2,900
    train pairs with the whole valid and test sets), with a small BPE (200 merges) to stay fast:
    every pair survives the filter, the text is Moses-tokenized (punctuation split off, an
    apostrophe escaped), BPE is reversible, the references are the tokenized and the original text."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for split, size in MULTI30K_SIZES.items():
        for lang in ("de", "en"):
            text = lines(f"{MULTI30K}/{split}.{lang}")
            assert len(text) == size  # the published sizes
            kept = text[:MULTI30K_TRAIN_PAIRS] if split == "train" else text
            (raw / f"{split}.{lang}").write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    dest = str(tmp_path / "de-en")
    status, err = run_in_process(corpus_cli, [str(raw), "--src", "de", "--tgt", "en", "--dest", dest,
                                              "--bpe-merges", "200", "--workers", "1"], capsys)
    assert status == 0, err
    info = manifest(dest)
    sizes = {**MULTI30K_SIZES, "train": MULTI30K_TRAIN_PAIRS}
    assert info["line_counts"]["raw"] == sizes and info["line_counts"]["bin"] == sizes
    assert info["recipe"]["bpe_merges"] == 200 and info["subword_model"]["merges_learned"] == 200
    original = lines(f"{MULTI30K}/train.de")
    assert original[0] == "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."
    tokenized = lines(f"{dest}/tok/train.de")
    assert tokenized[0] == "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche ."
    assert tokenized != [line.strip() for line in original[:MULTI30K_TRAIN_PAIRS]]
    english = lines(f"{dest}/tok/train.en")
    assert any(" &apos;s " in line for line in english) and not any("'s " in line for line in english)
    for lang in ("de", "en"):
        bpe = lines(f"{dest}/bpe/test.{lang}")
        assert [undo_bpe(line) for line in bpe] == lines(f"{dest}/tok/test.{lang}")
    assert any("@@ " in line for line in lines(f"{dest}/bpe/train.en"))
    assert lines(f"{dest}/ref/test.tok.en") == lines(f"{dest}/tok/test.en")
    assert lines(f"{dest}/ref/test.detok.en") == [line.strip() for line in lines(f"{MULTI30K}/test.en")]
    for split in SPLITS:
        assert os.path.isfile(f"{dest}/bin/{split}.de-en.de.bin") and os.path.isfile(f"{dest}/bin/{split}.de-en.en.idx")
