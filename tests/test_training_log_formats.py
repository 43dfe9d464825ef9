"""Training logs in every format fairseq writes, read by training_log.py (docs/experiments.md,
"Training logs"). The logs in tests/training_logs/ are real lines, captured once from the same
run (seed 1) with each format: their configuration dump, records and end-of-training lines.

    fairseq-train DATA --user-dir fairseq_normplug --arch transformer_normplug_tiny --prenorm --dyt
        --norm-stats-interval 2 --optimizer adam --lr 1e-3 --max-tokens 500 --max-update 6 --cpu
        --num-workers 0 --no-save --log-interval 2 --validate-interval-updates 3
        --required-batch-size-multiple 1 --log-format {json,simple,tqdm,none}

(tqdm under `script`, a terminal; DATA: 300 synthetic pairs), and fairseq-hydra-train's run
folder of the same data and model without the DyT flags (default log format, 6 updates).
"""
import os

import pytest

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import figures
from fairseq_normplug.experiments.training_log import parse_training_log

LOGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "training_logs")


def parsed(name: str):
    return parse_training_log(os.path.join(LOGS, name))


#: what differs between two runs of one training: speeds and clocks (and json's fractional epoch)
TIMING = {"wps", "ups", "wall", "train_wall", "update"}


def untimed(records: list) -> list:
    return [{key: value for key, value in record.items() if key.split("_", 1)[-1] not in TIMING
             and key not in TIMING} for record in records]


def test_json_simple_and_tqdm_logs_of_one_run_give_the_same_records():
    json_log, simple_log, tqdm_log = parsed("json.log"), parsed("simple.log"), parsed("tqdm.log")
    assert (json_log.log_format, simple_log.log_format, tqdm_log.log_format) == ("json", "simple", "tqdm")
    inner = json_log.kind("train_inner")
    assert [r["num_updates"] for r in inner] == [2.0, 4.0, 6.0]
    assert inner[-1]["alpha:enc0.attn"] == 0.5037 and len(inner[-1]) == 61
    assert "update" in inner[0] and "update" not in simple_log.kind("train_inner")[0]  # json's fractional epoch
    assert untimed(inner) == untimed(simple_log.kind("train_inner"))
    for kind in ("train", "valid"):
        assert untimed(json_log.kind(kind)) == untimed(simple_log.kind(kind)) == untimed(tqdm_log.kind(kind)) != []
    assert [r["valid_loss"] for r in tqdm_log.kind("valid")] == [6.755, 6.246]
    assert tqdm_log.kind("train")[0]["train_alpha:enc0.attn"] == 0.5019
    assert tqdm_log.kind("train_inner") == []  # tqdm shows them in its progress bar only
    for log in (json_log, simple_log, tqdm_log):
        assert (log.criterion, log.label_smoothing, log.skipped_lines, log.last_update) == ("cross_entropy", 0.0, 0, 6)


def test_the_hydra_run_folder_is_read_like_a_fairseq_train_log():
    log = parsed("hydra_run")  # the folder: its hydra_train.log
    assert log.path.endswith("hydra_run") and log.log_format == "tqdm"  # hydra's default, None in the dump
    inner = [(r["num_updates"], r["loss"]) for r in log.kind("train_inner")]
    assert inner == [(2.0, 7.424), (4.0, 6.437), (6.0, 5.846)]
    assert [(r["valid_num_updates"], r["valid_loss"]) for r in log.kind("valid")] == [(3.0, 6.071), (6.0, 5.508)]
    assert log.kind("train")[0]["train_loss"] == 6.631 and log.criterion == "cross_entropy"


def test_a_log_without_records_is_refused_naming_the_format_to_use(tmp_path):
    with pytest.raises(NormplugError) as refused:
        parsed("none.log")
    assert str(refused.value) == (f"{os.path.join(LOGS, 'none.log')}: training ran but the log holds no training "
                                  "records (written with --log-format none); train with --log-format json (or simple)")
    with pytest.raises(NormplugError, match="is a folder without hydra_train.log"):
        parse_training_log(str(tmp_path))
    started = tmp_path / "started.log"  # a run before its first record is no error
    started.write_text(open(os.path.join(LOGS, "none.log")).readline())
    assert parse_training_log(str(started)).records == {}


def test_figures_name_the_log_format_when_it_is_why_keys_are_missing(tmp_path):
    logs = {"DyT": parsed("tqdm.log")}
    with pytest.raises(figures.MissingLogData) as missing:
        figures.plot_dyt_alpha(logs, str(tmp_path / "alpha.png"))
    assert str(missing.value) == (
        "dyt_alpha: no log has alpha:<norm> keys (train with --dyt --norm-stats-interval N) (the logs hold no "
        "train_inner records: they were written with --log-format tqdm, which never logs them; train with "
        "--log-format json (or simple))")
    # the same run logged with simple draws it; a json log without DyT keys has no format to blame
    drawn = figures.plot_dyt_alpha({"DyT": parsed("simple.log")}, str(tmp_path / "a.png"))
    assert drawn["final_alpha"]["DyT"]["enc0.attn"] == 0.5037 and os.path.getsize(tmp_path / "a.png") > 0
    with pytest.raises(figures.MissingLogData) as missing:
        figures.plot_dyt_alpha({"LayerNorm": parsed("hydra_run")}, str(tmp_path / "b.png"))
    assert "--log-format" not in str(missing.value)


def test_the_json_lines_of_a_log_as_fairseq_wrote_them():
    """training_log.json_records: every reader of a streamed log (runner, preflight, the
    benchmarks) gets the JSON records of one kind, the broken and the other lines skipped."""
    from fairseq_normplug.experiments.training_log import json_records, last_num_updates

    path = os.path.join(LOGS, "json.log")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text += '2026-01-01 00:00:00 | INFO | train_inner | {"loss": "9.1", "num_upd\n'
    text += '2026-01-01 00:00:00 | INFO | train_inner | ["not", "a", "record"]\n'
    inner = json_records(text, "train_inner")
    assert [record["num_updates"] for record in inner] == ["2", "4", "6"]
    assert [record["valid_num_updates"] for record in json_records(text, "valid")] == ["3", "6"]
    assert last_num_updates(path) == 6
