"""The experiment entry points as a user runs them, on the tiny prepared corpus: scripts/train.sh
and scripts/evaluate.sh (experiments/single_run.py) train and score one row of the demo table;
reproduce.sh's own main finds that finished run (through --data or configs/data.json, with
--rows) and tabulates it; bad input fails in one line before anything is trained."""
import csv
import json
import os

import pytest

from conftest import REPO, assert_no_fallback, failure_report, run_cli, run_parallel
from fairseq_normplug.experiments import configs, reproduce, single_run
from fairseq_normplug.experiments.runner import run_folder

ROW = "PostNorm + LayerNorm + warmup"  # configs/experiments/demo.json, pair src-tgt
#: the demo recipe (cpu_small), shrunk by train.sh's --train-flags (the last occurrence counts)
SMALL = "--arch transformer_normplug_tiny --max-tokens 1000 --max-update 6 --validate-interval-updates 3"


def script(name: str) -> str:
    return os.path.join(REPO, "scripts", name)


@pytest.fixture(scope="module")
def row_run(tiny_prepared, tmp_path_factory):
    """ROW trained by scripts/train.sh and scored by scripts/evaluate.sh, in the run folder
    reproduce.sh uses under RUNS; returns (RUNS, run folder, train.sh, evaluate.sh outputs,
    and the output of scripts/reproduce.sh with a bad pair, run beside train.sh)."""
    work = tmp_path_factory.mktemp("entry")
    runs = work / "runs"
    run_dir = run_folder(str(runs), "demo", "src-tgt", ROW)
    trained, bad_pair = run_parallel([
        [script("train.sh"), "demo", ROW, tiny_prepared, "--run-dir", run_dir, "--train-flags", SMALL],
        [script("reproduce.sh"), "demo", "src_tgt", "--runs-dir", str(work / "bad-runs")],
    ], peers=False)
    assert trained.returncode == 0, failure_report(trained)
    bad_pair.runs_dir = work / "bad-runs"
    evaluated = run_cli([script("evaluate.sh"), "demo", ROW, tiny_prepared, "--run-dir", run_dir])
    return runs, run_dir, trained, evaluated, bad_pair


def printed_json(stdout: str) -> dict:
    """The JSON document a script prints last (after its progress lines)."""
    return json.loads(stdout[stdout.rindex("\n{\n") + 1:] if "\n{\n" in stdout else stdout)


def valid_records(run_dir: str):
    with open(os.path.join(run_dir, "train.log"), encoding="utf-8") as f:
        text = f.read()
    assert_no_fallback(text, "fairseq-train (train.log)")
    return [json.loads(line.split("| valid | ", 1)[1]) for line in text.splitlines() if "| valid | " in line]


@pytest.mark.slow
def test_train_sh_then_evaluate_sh(row_run, tiny_prepared):
    _, run_dir, trained, evaluated, _ = row_run
    status = json.loads(open(os.path.join(run_dir, "status.json")).read())
    assert status["status"] == "done" and status["updates"] == 6 and '"status": "done"' in trained.stdout
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == [  # and the hub's files (tests/test_hub.py)
        "bpecodes", "checkpoint_best.pt", "checkpoint_last.pt", "dict.src.txt", "dict.tgt.txt"]
    curve = {int(r["valid_num_updates"]): float(r["valid_bleu"]) for r in valid_records(run_dir)}
    assert sorted(curve) == [3, 6]
    scores = printed_json(evaluated.stdout)
    assert scores == json.loads(open(os.path.join(run_dir, "scores.json")).read())
    best = max(curve.values())
    assert scores["selected_update"] == max(u for u, b in curve.items() if b == best)
    assert scores["dev_bleu"] == pytest.approx(best)
    assert 0 <= scores["tokenized_bleu"] <= 100 and 0 <= scores["sacrebleu"] <= 100
    with open(os.path.join(run_dir, "generate-test.txt"), encoding="utf-8") as f:
        hypotheses = [line for line in f if line.startswith("H-")]
    with open(os.path.join(tiny_prepared, "ref", "test.tok.tgt"), encoding="utf-8") as f:
        assert len(hypotheses) == sum(1 for _ in f) == 100



def run_in_process(main, argv, capsys):
    """A script's main in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(argv)
        status = 0
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow
def test_a_second_run_reads_the_results_back(row_run, tiny_prepared, capsys):
    """train.sh skips the finished run, evaluate.sh prints its stored scores (single_run's mains
    in this process: the same code as the scripts, without a second start-up)."""
    _, run_dir, _, evaluated, _ = row_run
    log_before = open(os.path.join(run_dir, "train.log")).read()
    status, out, _ = run_in_process(single_run.train_main, ["demo", ROW, tiny_prepared, "--run-dir", run_dir],
                                    capsys)
    assert status == 0 and "done: skipped" in out
    assert open(os.path.join(run_dir, "train.log")).read() == log_before
    status, out, _ = run_in_process(single_run.evaluate_main, ["demo", ROW, tiny_prepared, "--run-dir", run_dir],
                                    capsys)
    assert status == 0 and printed_json(out) == printed_json(evaluated.stdout)


@pytest.mark.parametrize("main,argv,message", [
    ("train_main", ["demo", "No such row"], "train.sh: error: demo: no row named 'No such row'; rows: " + ROW),
    ("evaluate_main", ["demo", ROW], f"evaluate.sh: error: demo src-tgt | {ROW} is not trained"),
])
def test_single_run_bad_input_is_one_line(main, argv, message, tiny_data_dir, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    status, _, _ = run_in_process(getattr(single_run, main), [*argv, tiny_data_dir, "--run-dir", run_dir],
                                  capsys)
    assert str(status).startswith(message) and "\n" not in str(status), status
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))


def reproduce_main(argv, capsys):
    """reproduce.sh's main in this process: (exit status, stdout, stderr)."""
    return run_in_process(reproduce.main, argv, capsys)


def results_rows(results_dir) -> list:
    with open(os.path.join(results_dir, "results.csv"), newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["--data", "data.json"])
def test_reproduce_main_tabulates_the_finished_run(where, row_run, tiny_prepared, tmp_path, monkeypatch, capsys):
    """The finished train.sh run is found in --runs-dir and skipped, not trained again; the
    table holds its test BLEU. Data folder from --data PAIR=DIR, or from configs/data.json."""
    runs, run_dir, _, _, _ = row_run
    if where == "data.json":
        config_dir = tmp_path / "configs"
        config_dir.mkdir()
        (config_dir / "data.json").write_text(json.dumps({"src-tgt": tiny_prepared}))
        monkeypatch.setattr(reproduce, "load_data_locations", lambda: configs.load_data_locations(str(config_dir)))
        data = []
    else:
        data = ["--data", f"src-tgt={tiny_prepared}"]
    log_before = open(os.path.join(run_dir, "train.log")).read()
    results = tmp_path / "results"
    status, out, err = reproduce_main(["demo", "src-tgt", *data, "--rows", ROW, "--runs-dir", str(runs),
                                       "--results-dir", str(results)], capsys)
    assert status == 0, err
    assert "1 runs (1 pairs x 1 rows)" in out and f"[demo src-tgt | {ROW}] done: skipped" in out
    assert open(os.path.join(run_dir, "train.log")).read() == log_before
    (row,) = results_rows(results)
    scores = json.loads(open(os.path.join(run_dir, "scores.json")).read())
    assert row["row"] == ROW and row["pair"] == "src-tgt" and row["status"] == "ok"
    assert float(row["tokenized_bleu"]) == pytest.approx(scores["tokenized_bleu"], abs=0.01)
    assert int(row["selected_update"]) == scores["selected_update"]
    assert ROW in (results / "results.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["demo", "srctgt"], "bad language pair 'srctgt'; write it as SRC-TGT, e.g. src-tgt"),
    (["demo", "xx-yy"], "no data folder for xx-yy: pass --data xx-yy=DIR or add it to configs/data.json"),
    (["demo", "--data", "src-tgt"], "--data takes PAIR=DIR, got 'src-tgt'"),
    (["demo", "--rows", "No such row"], "demo: no row named 'No such row'"),
    (["table9"], "table9"),
])
def test_reproduce_main_refuses_bad_input_before_training(argv, message, tmp_path, capsys):
    status, _, _ = reproduce_main([*argv, "--runs-dir", str(tmp_path / "runs"), "--results-dir",
                                   str(tmp_path / "results")], capsys)
    assert str(status).startswith("reproduce.sh: error: ") and message in str(status) and "\n" not in str(status)
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "results")


@pytest.mark.slow
def test_reproduce_sh_reports_a_bad_pair_in_one_line(row_run):
    proc = row_run[4]
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "reproduce.sh: error: bad language pair 'src_tgt'; write it as SRC-TGT, e.g. src-tgt (language codes of "
        "2-3 lower-case letters)"]
    assert not os.path.exists(proc.runs_dir)
