"""Issue 43: portable run records, and ``--print-commands`` / ``--preflight`` that say what a real
run would do.

* no file under docs/ names a path of a machine, and a freshly written ``status.json`` holds
  none (experiments/portable_paths.py: ``$RUN``, ``$DATA``, ``$PLUGIN``, ``$CHECKOUT``...);
* an old record, with the absolute paths of another machine, still matches the command (skipped,
  not "trained with other flags"), and a changed flag is still found;
* a runs folder copied to another path collects to the same results.md, byte for byte;
* ``--print-commands`` marks each run done (skipped), to resume (from the last checkpoint's
  update) or to train, with the runner's own rule, and counts them; its cost estimate and the
  preflight's hours cover only the runs to train or resume."""
import json
import os
import re
import shutil

import pytest
import torch

from conftest import REPO, write_configs
from fairseq_normplug.experiments import launchers, portable_paths, preflight, reproduce, runner
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.portable_paths import from_portable, recorded_form, to_portable

#: (the leading "/" first, the look-behind only there: see portable_paths.ABSOLUTE_PATH)
MACHINE_PATH = re.compile(r"/(?<![\w.$-]/)(?:work|root|home|tmp|Users)/")
#: fairseq's own default of --plasma-path, in the config dump of every train.log: not a machine's
LIBRARY_DEFAULTS = ("/tmp/plasma",)

TABLE = {"title": "Portable", "recipe": "test_portable", "pairs": ["src-tgt"],
         "rows": [{"name": "PostNorm", "model": [], "schedule": "inv_sqrt_decay"},
                  {"name": "PreNorm + pRMSNorm", "model": ["--prenorm", "--norm-type", "prmsnorm"],
                   "schedule": "inv_sqrt_decay",
                   "normplug_modules": ["examples/normplug_extension/normplug_extension_example"]}]}
RECIPE = {"base": "cpu_tiny", "decoding": {"beam": 2}, "train": {"--max-update": "20"}}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config_dir = write_configs(tmp_path_factory.mktemp("configs") / "configs", {"test_portable": RECIPE},
                               {"portable": TABLE})
    return load_table("portable", config_dir)


@pytest.fixture
def fake_data(tmp_path):
    """A folder that passes the runner's checks (nothing trains on it)."""
    data = tmp_path / "data" / "src-tgt"
    for path in ("bin/dict.src.txt", "bin/dict.tgt.txt", "bin/train.src-tgt.src.bin", "ref/test.tok.tgt"):
        (data / path).parent.mkdir(parents=True, exist_ok=True)
        (data / path).write_text("")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return str(data)


def plan(table, data, runs_dir, seeds=(1, 2)):
    return reproduce.plan_runs(table, ["src-tgt"], {"src-tgt": data}, runs_dir, seeds=seeds)


def finish(run, command=None, bleu=30.0):
    """A kept finished run: status.json (its command as given, default the portable one) and scores."""
    os.makedirs(run.path("checkpoints"), exist_ok=True)
    command = command or to_portable(run.train_command(), run.roots())
    runner.write_json_atomic(run.path("status.json"), {"status": "done", "command": command, "minutes": 1.5,
                                                       "updates": 20, "stopped_by": "--max-update 20"})
    runner.write_json_atomic(run.path("scores.json"), {"tokenized_bleu": bleu, "sacrebleu": bleu - 1,
                                                       "selected_update": 20, "dev_bleu": bleu + 1})


def checkpoint_at(run, updates):
    """A last checkpoint of ``updates`` updates, as fairseq writes it (what the runner reads)."""
    os.makedirs(run.path("checkpoints"), exist_ok=True)
    torch.save({"model": {}, "optimizer_history": [{"num_updates": updates}]},
               run.path("checkpoints", "checkpoint_last.pt"))


def elsewhere(command, run):
    """``command`` as another machine's checkout, environment, data and runs folder wrote it."""
    roots = {**portable_paths.run_roots(run.run_dir, run.data_dir)}
    other = {"RUN": "/elsewhere/runs/portable/src-tgt/x", "DATA": "/elsewhere/data/src-tgt",
             "PLUGIN": "/elsewhere/checkout/fairseq_normplug", "CHECKOUT": "/elsewhere/checkout",
             "VENV": "/elsewhere/venv", "HOME": "/elsewhere/home", portable_paths.BIN: "/elsewhere/venv/bin"}
    return from_portable(to_portable(command, roots), other)


# --------------------------------------------------------------------------- no machine paths


def test_no_file_under_docs_names_a_machine_path():
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "docs")):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                data = f.read()
            if b"\0" in data:
                continue  # a figure
            text = data.decode("utf-8", errors="replace")
            for default in LIBRARY_DEFAULTS:
                text = text.replace(default, "")
            hits = portable_paths.absolute_paths(text, [REPO + os.sep]) + MACHINE_PATH.findall(text)
            if hits:
                found.append(f"{os.path.relpath(path, REPO)}: {hits[0]}")
    assert not found, found[:10]


def test_a_fresh_status_json_holds_no_absolute_path(table, fake_data, tmp_path, monkeypatch):
    """runner.train records the portable command (fairseq-train replaced by a process that ends at once)."""
    printed = []

    class Done:
        pid = os.getpid()  # the runner records its processes' pids

        def __init__(self, command, **kwargs):
            self.stdout = iter(printed)

        def wait(self):
            return 0

        def terminate(self):
            pass

    monkeypatch.setattr(runner.subprocess, "Popen", Done)
    run = plan(table, fake_data, str(tmp_path / "runs"), seeds=(1,))[1]
    printed.append(f"| INFO | loaded 12 examples from: {run.data_dir}/bin/valid.src-tgt.src; "
                   f"save to {run.path('checkpoints', 'checkpoint_last.pt')}\n")
    status = runner.train(run, echo=lambda message: None)
    assert status["status"] == "done"
    assert open(run.path("train.log"), encoding="utf-8").read() == (
        "| INFO | loaded 12 examples from: $DATA/bin/valid.src-tgt.src; save to $RUN/checkpoints/checkpoint_last.pt\n")
    text = open(run.path("status.json"), encoding="utf-8").read()
    assert not portable_paths.absolute_paths(text, [REPO, str(tmp_path), os.path.dirname(REPO)]), text
    command = json.loads(text)["command"]
    assert command[:4] == ["fairseq-train", "$DATA/bin", "--user-dir", "$PLUGIN"]
    assert "$RUN/checkpoints" in command
    assert "$CHECKOUT/examples/normplug_extension/normplug_extension_example" in command
    assert from_portable(command, run.roots()) == run.train_command()
    messages = []
    runner.train(run, echo=messages.append)
    assert messages == [f"[{run.label}] done: skipped"]


def test_an_old_record_of_another_machine_still_matches(table, fake_data, tmp_path):
    run = plan(table, fake_data, str(tmp_path / "runs"), seeds=(1,))[1]
    command = run.train_command()
    old = elsewhere(command, run)
    assert old[0] == "/elsewhere/venv/bin/fairseq-train" and "/elsewhere/checkout/fairseq_normplug" in old
    assert recorded_form(old) == recorded_form(command)
    finish(run, old)
    assert runner.training_plan(run, command).action == "done" and not runner.training_plan(run, command).changes
    patience = [*old, "--stop-patience", "7"]
    finish(run, patience)
    assert runner.training_plan(run, command).changes == ["--stop-patience 7 -> (none)"]


def test_a_copied_runs_folder_collects_the_same_results(table, fake_data, tmp_path):
    first = str(tmp_path / "a" / "runs")
    for i, run in enumerate(plan(table, fake_data, first)):
        # half of them old records of another machine, half portable ones
        finish(run, elsewhere(run.train_command(), run) if i % 2 else None, bleu=20.0 + i)
    copy = str(tmp_path / "b" / "deeper" / "other-runs")
    shutil.copytree(first, copy)
    shutil.rmtree(first)  # nothing is read from the old place
    moved_data = str(tmp_path / "b" / "data" / "src-tgt")
    shutil.copytree(fake_data, moved_data)
    results = {}
    for name, runs_dir, data in (("first", copy, fake_data), ("moved", copy, moved_data)):
        runs = plan(table, data, runs_dir)
        for run in runs:
            assert runner.training_plan(run, run.train_command()).action == "done"
        reproduce.write_table(table, runs, str(tmp_path / name), echo=lambda message: None)
        results[name] = [(tmp_path / name / file).read_bytes() for file in ("results.md", "results.csv")]
    assert results["first"] == results["moved"]
    md = results["first"][0].decode()
    assert "$CHECKOUT/examples/normplug_extension/normplug_extension_example" in md
    assert not portable_paths.absolute_paths(md, [REPO, str(tmp_path)]), md


def test_the_same_runs_folder_at_two_places_collects_byte_equal(table, fake_data, tmp_path):
    """(b) of issue 43: a runs folder made here, copied to another path, collects to the same results.md."""
    here = str(tmp_path / "here" / "runs")
    for i, run in enumerate(plan(table, fake_data, here)):
        finish(run, bleu=25.0 + i)
    there = str(tmp_path / "there" / "x" / "runs")
    shutil.copytree(here, there)
    for name, runs_dir in (("here_results", here), ("there_results", there)):
        reproduce.write_table(table, plan(table, fake_data, runs_dir), str(tmp_path / name), echo=lambda m: None)
    for file in ("results.md", "results.csv"):
        assert (tmp_path / "here_results" / file).read_bytes() == (tmp_path / "there_results" / file).read_bytes()


# --------------------------------------------------------------------------- what would run


@pytest.fixture
def kept_table(table, fake_data, tmp_path):
    """4 runs: seed 1 of both rows done (one an old absolute record), seed 2 of PostNorm killed at
    update 7 (to resume), seed 2 of the pRMSNorm row never started (to train)."""
    runs = plan(table, fake_data, str(tmp_path / "runs"))
    by_name = {(run.row.name, run.seed): run for run in runs}
    finish(by_name["PostNorm", 1])
    finish(by_name["PreNorm + pRMSNorm", 1], elsewhere(by_name["PreNorm + pRMSNorm", 1].train_command(),
                                                       by_name["PreNorm + pRMSNorm", 1]))
    checkpoint_at(by_name["PostNorm", 2], 7)
    runner.write_json_atomic(by_name["PostNorm", 2].path("status.json"), {"status": "running", "command": []})
    return runs, by_name


def test_print_commands_marks_each_run_and_counts_them(kept_table, monkeypatch):
    runs, by_name = kept_table
    arch = runs[0].recipe.arch
    monkeypatch.setattr(reproduce, "load_speeds",
                        lambda: {arch: {"cpu": {"target_tokens_per_second": 100.0, "measured": "a test"}}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = []
    reproduce.print_commands(runs, launchers.LocalLauncher(), [], echo=lines.append)
    heads = [line for line in lines if line.startswith("[portable")]
    assert heads == [f"[{by_name['PostNorm', 1].label}] done (skipped)",
                     f"[{by_name['PostNorm', 2].label}] to resume from update 7",
                     f"[{by_name['PreNorm + pRMSNorm', 1].label}] done (skipped)",
                     f"[{by_name['PreNorm + pRMSNorm', 2].label}] to train"]
    costs = [line for line in lines if line.startswith("  cost: ")]
    assert len(costs) == 2 and costs[0].startswith("  cost: at most 13 updates (of 20) x ")
    assert costs[1].startswith("  cost: at most 20 updates x ")
    tokens = runs[0].batching().tokens_per_update
    hours = (13 + 20) * tokens / 100.0 / 3600
    assert lines[-1] == (f"[print-commands] 4 runs: 2 done (skipped), 1 to resume, 1 to train; nothing was run; "
                         f"estimated training time of the 2 run(s) to train with a measured speed: {hours:.2f} "
                         f"hours one after another (less with --jobs; decoding not included)")


def test_print_commands_and_train_share_one_rule(kept_table):
    """The mark is runner.training_plan's, which runner.train follows (a done run: skipped)."""
    runs, by_name = kept_table
    messages = []
    runner.train(by_name["PreNorm + pRMSNorm", 1], echo=messages.append)
    assert messages == [f"[{by_name['PreNorm + pRMSNorm', 1].label}] done: skipped"]
    assert [runner.training_plan(run, run.train_command()).action for run in runs] == ["done", "resume", "done",
                                                                                       "train"]


def test_preflight_estimates_only_the_runs_to_train(kept_table, tmp_path, monkeypatch):
    runs, by_name = kept_table
    measured = []

    def short_training(run, command, folder, updates):
        measured.append(run.row.name)
        return {"updates_per_second": 0.01, "tokens_per_second": 1000.0, "peak_memory_gb": 0.1,
                "memory_kind": "CPU resident", "checkpoint_bytes": 1000}

    monkeypatch.setattr(preflight, "short_training", short_training)
    monkeypatch.setattr(preflight, "data_problems", lambda data_dir, pair: [])
    monkeypatch.setattr(preflight, "positions_problems", lambda run, args: [])
    lines = []
    report = preflight.check_table(runs, [], str(tmp_path / "runs"), str(tmp_path / "results"), echo=lines.append)
    assert report["problems"] == [], lines
    assert measured == ["PostNorm", "PreNorm + pRMSNorm"]  # one configuration per row (its seeds share it)
    # PostNorm: seed 2 resumes at 7 of 20 updates; pRMSNorm: seed 2 trains 20; at 0.01 updates/s
    assert [config["runs"] for config in report["configurations"]] == [1, 1]
    assert report["hours"] == pytest.approx((13 + 20) / 0.01 / 3600)
    assert "[preflight] 4 runs: 2 done (skipped), 1 to resume, 1 to train" in lines
    assert lines[-1].startswith(f"[preflight] 2 configuration(s), 4 run(s), 2 to train or resume: at most "
                                f"{(13 + 20) / 0.01 / 3600:.2f} hours")


def test_preflight_measures_no_configuration_whose_runs_are_done(kept_table, tmp_path, monkeypatch):
    runs, by_name = kept_table
    finish(by_name["PostNorm", 2])
    measured = []
    monkeypatch.setattr(preflight, "short_training", lambda run, *args: measured.append(run.row.name) or {
        "updates_per_second": 1.0, "tokens_per_second": 1.0, "peak_memory_gb": 0.1, "memory_kind": "CPU resident",
        "checkpoint_bytes": 1})
    monkeypatch.setattr(preflight, "data_problems", lambda data_dir, pair: [])
    monkeypatch.setattr(preflight, "positions_problems", lambda run, args: [])
    lines = []
    report = preflight.check_table(runs, [], str(tmp_path / "runs"), str(tmp_path / "results"), echo=lines.append)
    assert measured == ["PreNorm + pRMSNorm"]
    assert any(line.endswith("PostNorm: its 2 run(s) are done (skipped): not measured") for line in lines)
    assert report["hours"] == pytest.approx(20 / 3600)


def test_a_conversion_report_names_its_checkpoint_in_the_runs_folder(tmp_path):
    """convert_norms.sh's report.md: a checkpoint of a run as $RUNS/TABLE/PAIR/ROW/..., the data under the checkout."""
    from fairseq_normplug.diagnostics import convert

    run = tmp_path / "runs" / "beyond.cpu_short" / "de-en" / "ngpt"
    (run / "checkpoints").mkdir(parents=True)
    (run / "status.json").write_text("{}")
    checkpoint = str(run / "checkpoints" / "checkpoint_best.pt")
    assert convert.shown_path(checkpoint) == "$RUNS/beyond.cpu_short/de-en/ngpt/checkpoints/checkpoint_best.pt"
    assert convert.shown_path(os.path.join(REPO, "data", "de-en")) == "$CHECKOUT/data/de-en"
    assert convert.shown_path("/opt/elsewhere/x.pt") == "/opt/elsewhere/x.pt"
