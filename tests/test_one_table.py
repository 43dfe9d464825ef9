"""A results table is never silently wrong (issue 50), without training: run folders written by
hand (status.json, scores.json, train.log as the runner writes them) collected in-process with
``reproduce.main([... "--collect"])`` and :func:`tables.write_results`. One table per results
folder, no stale figure beside a new table."""
import csv
import errno
import json
import os

import pytest

from conftest import write_configs
from fairseq_normplug.experiments import reproduce, tables
from fairseq_normplug.experiments.configs import load_table

ROWS = [{"name": "PreNorm", "model": ["--prenorm"], "schedule": "no_warmup"},
        {"name": "PreNorm + ScaleNorm", "model": ["--prenorm", "--scalenorm"], "schedule": "no_warmup"}]
TABLES = {"alpha": {"title": "Alpha", "recipe": "cpu_tiny", "pairs": ["src-tgt"], "rows": ROWS},
          "beta": {"title": "Beta", "recipe": "cpu_tiny", "pairs": ["src-tgt"], "rows": ROWS[:1]}}
SLUGS = {"PreNorm": "prenorm", "PreNorm + ScaleNorm": "prenorm-scalenorm"}
SCORES = {"tokenized_bleu": 12.5, "sacrebleu": 11.0, "sacrebleu_signature": "nrefs:1|tok:13a", "chrf": 40.0,
          "chrf++": 38.0, "chrf_signature": "nrefs:1|nc:6|nw:0", "selected_update": 10, "dev_bleu": 3.0}


def log_lines(updates=(5, 10)) -> str:
    """A --log-format json train.log: gradient norms and dev BLEU (figures 1 and 2)."""
    lines = []
    for update in updates:
        lines.append(f"2026-01-01 00:00:{update:02d} | INFO | train_inner | "
                     + json.dumps({"epoch": 1, "loss": "5.1", "gnorm": f"{1 + update / 10}", "num_updates": str(update)}))
        lines.append(f"2026-01-01 00:00:{update:02d} | INFO | valid | "
                     + json.dumps({"epoch": 1, "valid_loss": "5.0", "valid_bleu": f"{update / 4}",
                                   "valid_num_updates": str(update)}))
    return "\n".join(lines) + "\n"


def write_run(folder, status=None, scores=SCORES, log=None):
    """A run folder as the runner leaves a finished run (status done, scored, its log)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "status.json"), "w") as f:
        json.dump(status or {"status": "done", "updates": 10, "minutes": 1.5, "stopped_by": "--max-update 10"}, f)
    if scores is not None:
        with open(os.path.join(folder, "scores.json"), "w") as f:
            json.dump(scores, f)
    with open(os.path.join(folder, "train.log"), "w") as f:
        f.write(log_lines() if log is None else log)


@pytest.fixture
def collect(tmp_path, monkeypatch, capsys):
    """``collect(table, *args)``: reproduce.main of a table of ``TABLES`` over the hand-written run
    folders of ``tmp_path/runs`` into ``tmp_path/results`` (default); (exit code, stdout lines)."""
    configs = write_configs(tmp_path / "configs", tables=TABLES)
    monkeypatch.setattr(reproduce, "load_table", lambda name: load_table(name, configs))
    data = tmp_path / "data"
    for name in ("bin/dict.src.txt", "bin/dict.tgt.txt", "bin/train.src-tgt.src.bin", "ref/test.tok.tgt"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text("x 1\n")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    for table, spec in TABLES.items():
        for row in spec["rows"]:
            write_run(tmp_path / "runs" / table / "src-tgt" / SLUGS[row["name"]])

    def main(table, *args, results="results", mode="--collect"):
        argv = [table, mode, "--data", f"src-tgt={data}", "--runs-dir", str(tmp_path / "runs"),
                "--results-dir", str(tmp_path / results), *args]
        try:
            reproduce.main(argv)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        return code, capsys.readouterr().out.strip().splitlines()
    return main


def read_csv(path) -> list:
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_a_results_folder_belongs_to_one_table(collect, tmp_path):
    """Another table collected into a table's results folder is refused in one line naming the
    owner; its results and figures stay as they were. Its own folder takes it."""
    code, lines = collect("alpha")
    assert code == 0 and lines[-1] == "[reproduce] collected 2 of 2 runs with a result"
    results = tmp_path / "results"
    assert (results / "table.txt").read_text() == "alpha\n" and (results / "fig2_grad_norm.png").exists()
    before = {name: (results / name).read_bytes() for name in os.listdir(results)}
    code, lines = collect("beta")
    assert code == (f"reproduce.sh: error: the results folder {results} holds the results of table alpha, not beta: "
                    f"give beta its own --results-dir, or delete {results}")
    assert {name: (results / name).read_bytes() for name in os.listdir(results)} == before
    code, lines = collect("alpha")  # its own table again: rewritten
    assert code == 0 and [row["table"] for row in read_csv(results / "results.csv")] == ["alpha", "alpha"]
    code, lines = collect("beta", results="beta-results")
    assert code == 0 and [row["table"] for row in read_csv(tmp_path / "beta-results" / "results.csv")] == ["beta"]


def test_a_folder_written_before_the_owner_file_is_owned_by_its_results_csv(tmp_path):
    rows = [{"table": "alpha", "pair": "src-tgt", "row": "PreNorm", "config": "--prenorm", "status": "failed"}]
    tables.write_results(rows, str(tmp_path), paper={"tables": {}})
    os.remove(tmp_path / "table.txt")
    with pytest.raises(tables.NormplugError, match="holds the results of table alpha, not beta"):
        tables.write_results([{**rows[0], "table": "beta"}], str(tmp_path), paper={"tables": {}})
    assert read_csv(tmp_path / "results.csv")[0]["table"] == "alpha"
    tables.write_results(rows, str(tmp_path), paper={"tables": {}})
    assert (tmp_path / "table.txt").read_text() == "alpha\n"


def test_a_table_never_trains_into_another_tables_results_folder(collect, tmp_path):
    """Before anything trains (run_table) and in --preflight: one line."""
    code, _ = collect("alpha")
    os.remove(tmp_path / "runs" / "beta" / "src-tgt" / "prenorm" / "status.json")  # beta's run would train
    beta = load_table("beta", str(tmp_path / "configs"))
    with pytest.raises(tables.NormplugError) as error:
        reproduce.run_table(beta, ["src-tgt"], {"src-tgt": str(tmp_path / "data")}, str(tmp_path / "runs"),
                            str(tmp_path / "results"), echo=lambda m: None)
    assert str(error.value).endswith("holds the results of table alpha, not beta: give beta its own --results-dir, "
                                     f"or delete {tmp_path / 'results'}; nothing was run")
    assert not os.path.exists(tmp_path / "runs" / "beta" / "src-tgt" / "prenorm" / "status.json")


def test_no_stale_figure_is_left_beside_a_table(collect, tmp_path):
    """A figure drawn before (figures.py into the folder, or an earlier write whose logs held
    its keys) that this table does not draw is deleted when the table is written."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "dyt_alpha.png").write_bytes(b"\x89PNG old")
    (results / "fig1_dev_bleu.png").write_bytes(b"\x89PNG old")
    (results / "notes.txt").write_text("mine")
    code, lines = collect("alpha")
    assert code == 0 and f"[reproduce] removed the stale figure {results / 'dyt_alpha.png'}" in lines
    assert not (results / "dyt_alpha.png").exists() and (results / "notes.txt").read_text() == "mine"
    assert (results / "fig1_dev_bleu.png").read_bytes() != b"\x89PNG old"
    for slug in SLUGS.values():  # logs without dev BLEU now: figure 1 is not drawn, and not left
        (tmp_path / "runs" / "alpha" / "src-tgt" / slug / "train.log").write_text(
            "".join(line + "\n" for line in log_lines().splitlines() if "| valid |" not in line))
    code, lines = collect("alpha")
    assert code == 0 and not (results / "fig1_dev_bleu.png").exists() and (results / "fig2_grad_norm.png").exists()


# --------------------------------------------------------------------------- every run record is validated on read


def test_a_bad_status_or_scores_json_is_named_the_run_failed_and_the_table_written(collect, tmp_path):
    """``"minutes": "x"`` in a status.json used to stop --collect (``result field minutes='x' is
    not a number``) and leave the old results.csv; a scores.json field of the wrong type too."""
    results, folder = tmp_path / "results", tmp_path / "runs" / "alpha" / "src-tgt"
    code, _ = collect("alpha")
    assert code == 0 and [row["status"] for row in read_csv(results / "results.csv")] == ["ok", "ok"]
    status = json.loads((folder / "prenorm" / "status.json").read_text())
    (folder / "prenorm" / "status.json").write_text(json.dumps({**status, "minutes": "x"}))
    (folder / "prenorm-scalenorm" / "scores.json").write_text(json.dumps({**SCORES, "sacrebleu": "x"}))
    code, lines = collect("alpha")
    assert code == 0 and lines[-1] == "[reproduce] collected 0 of 2 runs with a result"
    assert (f"[reproduce] alpha src-tgt | PreNorm: {folder / 'prenorm' / 'status.json'}: minutes='x' is not a number; "
            f"the run is failed, a re-run resumes it from its checkpoints") in lines
    assert (f"[reproduce] alpha src-tgt | PreNorm + ScaleNorm: {folder / 'prenorm-scalenorm' / 'scores.json'}: "
            f"sacrebleu='x' is not a number; the run is failed, a re-run decodes its test set again") in lines
    rows = read_csv(results / "results.csv")
    assert [(row["status"], row["minutes"], row["tokenized_bleu"]) for row in rows] == [("failed", "", ""),
                                                                                       ("failed", "1.5", "")]


@pytest.mark.parametrize("field,value", [("updates", "61"), ("updates", 1.5), ("status", "finished"),
                                         ("command", "fairseq-train"), ("stopped_by", 3)])
def test_each_record_field_of_the_wrong_type_is_named_with_its_path(tmp_path, field, value):
    from fairseq_normplug.experiments.runner import record_problem

    path = str(tmp_path / "status.json")
    assert record_problem(path, {"status": "done", field: value}).startswith(f"{path}: {field}")
    assert record_problem(path, {"status": "done", "updates": 10, "minutes": 2, "stopped_by": None}) is None
    assert record_problem(str(tmp_path / "scores.json"), {}) == f"{tmp_path / 'scores.json'} has no test BLEU " \
                                                                 f"(tokenized_bleu)"


@pytest.mark.parametrize("log", [
    "\x00\x01 garbage \x7f" * 50 + "\nnot a log\n",
    "2026-01-01 00:00:00 | INFO | fairseq_cli.train | done training in 1.0 seconds\n",  # --log-format none
])
def test_a_garbage_train_log_is_named_and_no_figure_advises_flags_the_run_had(collect, tmp_path, log):
    """A log of a trained run without one training record is named in one line and left out of
    the figures; a figure it is missing from says so (it used to advise ``--norm-stats-interval``,
    or, for a --log-format none log, stop the table). The run's score stands."""
    folder = tmp_path / "runs" / "alpha" / "src-tgt" / "prenorm-scalenorm"
    (folder / "train.log").write_text(log)
    code, lines = collect("alpha")
    assert code == 0 and lines[-1] == "[reproduce] collected 2 of 2 runs with a result"
    path = folder / "train.log"
    named = [line for line in lines if line.startswith("[reproduce] alpha src-tgt | PreNorm + ScaleNorm: ")]
    assert len(named) == 1 and str(path) in named[0] and named[0].endswith("; left out of the figures")
    scalenorm_g = next(line for line in lines if line.startswith("[reproduce] figure scalenorm_g: "))
    assert scalenorm_g.endswith(f"; left out as unreadable: {path}")
    assert (tmp_path / "results" / "fig2_grad_norm.png").exists()  # drawn from the good log
    assert [row["status"] for row in read_csv(tmp_path / "results" / "results.csv")] == ["ok", "ok"]


# --------------------------------------------------------------------------- leftovers and causes


def full_disk_for(name):
    """An ``open`` that fails as a full disk does for files whose name holds ``name``: the file is
    created (0 bytes) and the write fails with ENOSPC."""
    import builtins

    def full_disk_open(path, *args, **kwargs):
        mode = args[0] if args else kwargs.get("mode", "r")
        if name in os.path.basename(str(path)) and "w" in mode:
            builtins.open(path, *args, **kwargs).close()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return builtins.open(path, *args, **kwargs)
    return full_disk_open


def test_a_full_disk_leaves_no_temporary_status_file_and_the_summary_names_enospc(collect, tmp_path, monkeypatch):
    """The disk fills up while a run's status.json is written: no 0-byte status.json temporary
    is left, and the table's last line names ENOSPC though status.json could not record it."""
    from fairseq_normplug import atomic_files
    from fairseq_normplug.experiments import launchers, runner

    folder = tmp_path / "runs" / "alpha" / "src-tgt" / "prenorm"
    for name in ("status.json", "scores.json"):
        os.remove(folder / name)

    def disk_full_training(run, extra, echo):
        run.set_status(status="running")

    for module in (atomic_files, runner):
        monkeypatch.setattr(module, "open", full_disk_for("status.json"), raising=False)
    monkeypatch.setattr(launchers, "train", disk_full_training)
    lines = []
    results = reproduce.run_table(load_table("alpha", str(tmp_path / "configs")), ["src-tgt"],
                                  {"src-tgt": str(tmp_path / "data")}, str(tmp_path / "runs"), str(tmp_path / "results"),
                                  echo=lines.append)
    assert [run.row.name for run, _, _ in results.failed] == ["PreNorm"]
    assert lines[-1].startswith("[reproduce] FAILED alpha src-tgt | PreNorm: not trained; OSError ENOSPC: "
                                "[Errno 28] No space left on device: ") and "ENOSPC: the disk is full" not in lines[-1]
    assert sorted(os.listdir(folder)) == ["train.log"]  # no status.json.tmp-PID, no .status.json.*.tmp
    assert reproduce.with_errno_names("training failed (exit 1): OSError: [Errno 28] No space left on device") == \
        "training failed (exit 1): OSError: [Errno 28] No space left on device (ENOSPC: the disk is full)"


def test_collect_without_any_result_names_each_runs_cause(collect, tmp_path):
    folder = tmp_path / "runs" / "alpha" / "src-tgt"
    os.remove(folder / "prenorm" / "status.json")
    (folder / "prenorm-scalenorm" / "scores.json").write_text("{}")
    code, lines = collect("alpha")
    assert code == 0 and lines[-3:] == [
        f"[reproduce] no result for alpha src-tgt | PreNorm: not trained; log: {folder / 'prenorm' / 'train.log'}",
        f"[reproduce] no result for alpha src-tgt | PreNorm + ScaleNorm: trained, not evaluated: "
        f"{folder / 'prenorm-scalenorm' / 'scores.json'} has no test BLEU (tokenized_bleu); "
        f"log: {folder / 'prenorm-scalenorm' / 'train.log'}",
        "[reproduce] collected 0 of 2 runs with a result"]


def test_a_full_disk_while_status_json_is_written_leaves_the_old_one_and_no_temporary(collect, tmp_path, monkeypatch):
    from fairseq_normplug import atomic_files
    from fairseq_normplug.experiments import runner

    run = reproduce.plan_runs(load_table("alpha", str(tmp_path / "configs")), ["src-tgt"],
                              {"src-tgt": str(tmp_path / "data")}, str(tmp_path / "runs"))[0]
    before = open(run.path("status.json")).read()
    for module in (atomic_files, runner):
        monkeypatch.setattr(module, "open", full_disk_for("status.json"), raising=False)
    with pytest.raises(OSError, match="No space left on device"):
        run.set_status(status="running")
    assert sorted(os.listdir(run.run_dir)) == ["scores.json", "status.json", "train.log"]
    assert open(run.path("status.json")).read() == before


def test_status_shows_a_run_with_a_bad_record_or_log_without_stopping(collect, tmp_path):
    """--status of runs whose status.json has ``"minutes": "x"`` and whose train.log was written
    with --log-format none: one line each, as not started / with empty columns."""
    folder = tmp_path / "runs" / "alpha" / "src-tgt"
    status = json.loads((folder / "prenorm" / "status.json").read_text())
    (folder / "prenorm" / "status.json").write_text(json.dumps({**status, "minutes": "x"}))
    (folder / "prenorm-scalenorm" / "train.log").write_text(
        "2026-01-01 00:00:00 | INFO | fairseq_cli.train | done training in 1.0 seconds\n")
    code, lines = collect("alpha", mode="--status")
    assert code == 0, code
    assert lines[1].split()[:6] == ["alpha", "src-tgt", "|", "PreNorm", "pending", "10"]
    assert lines[2].split()[:9] == ["alpha", "src-tgt", "|", "PreNorm", "+", "ScaleNorm", "tested", "-", "-"]


def test_preflight_names_a_results_folder_of_another_table(collect, tmp_path):
    code, _ = collect("alpha")
    code, lines = collect("beta", mode="--preflight")
    assert (f"[preflight] PROBLEM: the results folder {tmp_path / 'results'} holds the results of table alpha, "
            f"not beta: give beta its own --results-dir, or delete {tmp_path / 'results'}") in lines
    assert code.startswith("reproduce.sh: preflight: ")
