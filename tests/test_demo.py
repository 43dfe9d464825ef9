"""scripts/demo.sh: its corpus step (training stubbed out: one prepared folder per corpus, even
for corpora whose folders have the same name, and errors that name only demo.sh's options), and
its whole path once, training included, at a tiny size."""
import csv
import glob
import json
import os
import re
import shutil

import pytest
import tiny_demo
from inprocess import forked_commands
from prepare_fixtures import write_pairs

from fairseq_normplug.experiments import demo

PAIR = ["--src", "en", "--tgt", "de", "--tokenized"]


def make_corpus(folder: str, word: str) -> str:
    """A tiny tokenized en-de corpus whose text depends on ``word``."""
    for split, count in (("train", 40), ("valid", 5), ("test", 5)):
        write_pairs(folder, split, [(f"{word} a b {i} .", f"{word} x y {i} .") for i in range(count)])
    return folder


@pytest.fixture(scope="module")
def demo_corpus(tmp_path_factory):
    """``run(corpus)``: demo.sh's main with data/ in a temporary folder and no training;
    returns the prepared folder that would be trained on."""
    root = tmp_path_factory.mktemp("demo")
    trained_on = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo, "DATA_ROOT", str(root / "data"))
        patch.setattr(demo, "run_table", lambda table, pairs, data_dirs, *rest, **kw:
                      trained_on.append(data_dirs[pairs[0]]))

        def run(corpus: str) -> str:
            demo.main(["--corpus", corpus, *PAIR, "--bpe-merges", "30", "--out", str(root / "out")])
            return trained_on[-1]

        yield root, run


def recipe(data_dir: str) -> dict:
    with open(os.path.join(data_dir, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)["recipe"]


@pytest.fixture(scope="module")
def two_corpora(demo_corpus):
    """Two corpora in folders named x/raw, each through demo.sh: [(corpus, prepared folder)]
    (the preparation's fairseq-preprocess a fork of this process: tests/inprocess.py's forked_commands)."""
    root, run = demo_corpus
    corpora = [make_corpus(str(root / "a" / "x" / "raw"), "alpha"), make_corpus(str(root / "b" / "x" / "raw"), "beta")]
    with forked_commands():
        return [(corpus, run(corpus)) for corpus in corpora]


@pytest.mark.slow
def test_corpora_with_the_same_folder_name_get_their_own_prepared_folders(demo_corpus, two_corpora):
    root, run = demo_corpus
    (first, first_dir), (second, second_dir) = two_corpora
    assert first_dir != second_dir
    for data_dir, corpus in ((first_dir, first), (second_dir, second)):
        assert re.fullmatch(r"x-[0-9a-f]{8}", os.path.basename(os.path.dirname(data_dir)))
        assert os.path.basename(data_dir) == "en-de-bpe30"
        assert recipe(data_dir)["raw_dir"] == os.path.abspath(corpus)
        assert os.path.isfile(os.path.join(data_dir, "bin", "train.en-de.de.bin"))

    stamp = os.stat(os.path.join(first_dir, "manifest.json")).st_mtime_ns
    assert run(first) == first_dir  # a re-run reuses the prepared data
    assert os.stat(os.path.join(first_dir, "manifest.json")).st_mtime_ns == stamp

    name = demo.corpus_folder(first, "en", "de", True)
    moved = shutil.copytree(first, str(root / "moved" / "x" / "raw"))
    assert demo.corpus_folder(moved, "en", "de", True) != name
    assert demo.corpus_folder(first, "en", "de", False) != name
    with open(os.path.join(first, "test.de"), "a", encoding="utf-8") as f:
        f.write("an edited line .\n")
    with open(os.path.join(first, "test.en"), "a", encoding="utf-8") as f:
        f.write("an edited line .\n")
    assert demo.corpus_folder(first, "en", "de", True) != name


def options_of_demo(capsys) -> set:
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    return set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))


def foreign_folder(data_dir: str) -> str:
    os.makedirs(data_dir)
    with open(os.path.join(data_dir, "notes.txt"), "w") as f:
        f.write("mine\n")
    return "was not made by these scripts"


def other_options(data_dir: str) -> str:
    path = os.path.join(data_dir, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["recipe"]["max_len"] = 100
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return "was prepared with other options (max_len: 100 -> 250)"


@pytest.mark.slow
@pytest.mark.parametrize("damage", [foreign_folder, other_options])
def test_a_prepared_folder_that_cannot_be_reused_is_reported_with_demo_advice(demo_corpus, two_corpora,
                                                                             damage, capsys):
    root, run = demo_corpus
    if damage is other_options:  # a folder demo.sh prepared, its manifest changed by hand
        corpus, data_dir = two_corpora[1]
    else:
        corpus = make_corpus(str(root / "foreign" / "raw"), "gamma")
        data_dir = os.path.join(demo.DATA_ROOT, demo.corpus_folder(corpus, "en", "de", True), "en-de-bpe30")
    problem = damage(data_dir)
    with pytest.raises(SystemExit) as exit_info:
        run(corpus)
    message = str(exit_info.value.code)
    assert message.startswith(f"demo.sh: error: {data_dir} ") and problem in message
    assert "delete that folder" in message and "\n" not in message
    named = set(re.findall(r"--[a-z][a-z-]*", message))
    assert named <= options_of_demo(capsys), f"{message} names options demo.sh lacks"


@pytest.mark.slow
def test_demo_trains_scores_and_tabulates_through_its_own_path(tmp_path, monkeypatch, capsys):
    """demo.sh's main end to end, nothing mocked but the size: a corpus given with --corpus is
    prepared into data/, the --preset's recipe trains the table's first row (shrunk to 4
    updates, one row, to stay fast), the test set is translated and scored, and --out holds
    the results table, the figures and the run. The run's fairseq commands are forks of this
    process (tests/inprocess.py's forked_commands): demo.sh's logic is the subject here;
    tests/test_wheel.py runs demo.sh's main as a real script."""
    from fairseq_normplug.experiments import configs, reproduce

    corpus = make_corpus(str(tmp_path / "toy" / "raw"), "delta")
    monkeypatch.setattr(demo, "DATA_ROOT", str(tmp_path / "data"))
    # the real run_table: this module's demo_corpus fixture replaces it for the module's other tests
    monkeypatch.setattr(demo, "run_table", reproduce.run_table)
    tiny_demo.shrink(demo, monkeypatch.setattr)
    table = configs.load_table("demo")
    out = tmp_path / "out"
    with forked_commands():  # the run's fairseq commands as forks of this process (demo.sh itself: test_wheel)
        demo.main(["--corpus", corpus, *PAIR, "--bpe-merges", "30", "--preset", "tiny", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "[demo] done in" in printed and f"results in {out}" in printed
    (data_dir,) = glob.glob(str(tmp_path / "data" / "toy-*" / "en-de-bpe30"))
    assert recipe(data_dir)["raw_dir"] == os.path.abspath(corpus)
    with open(out / "results.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["row"] == table.rows[0].name and row["pair"] == "en-de" and row["status"] == "ok"
    assert int(row["updates"]) == 4 and 0 <= float(row["tokenized_bleu"]) <= 100
    assert "(toy, preset tiny)" in (out / "results.md").read_text()
    run_dir = out / "runs" / "demo" / "en-de" / "postnorm-layernorm-warmup"
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["tokenized_bleu"] == pytest.approx(float(row["tokenized_bleu"]), abs=0.01)
    status = json.loads((run_dir / "status.json").read_text())
    command = status["command"]
    assert command[command.index("--arch") + 1] == "transformer_normplug_tiny"  # the tiny preset's
    assert "$DATA/bin" in command  # portable: the runner resolves $DATA to data_dir
    with open(run_dir / "generate-test.txt", encoding="utf-8") as f:
        assert sum(line.startswith("H-") for line in f) == 5
    assert [name for name in os.listdir(out) if name.endswith(".png")]
