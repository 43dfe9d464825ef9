"""fairseq_normplug.flag_lists: every reader of a flag list (the runner, the tables, the
placements) follows argparse's rules: the last occurrence wins, ``--x=v`` is ``--x v``, and
text splits as a shell splits it."""
import pytest

from fairseq_normplug.experiments.runner import changed_flags
from fairseq_normplug.experiments.tables import row_configuration
from fairseq_normplug.flag_lists import command_flags, flag, last_flag_value, parse_flag_list, split_flags
from fairseq_normplug.models.placements import training_task


def test_the_last_occurrence_wins_and_equals_is_a_space():
    tokens = ["--max-update", "10", "--fp16", "--max-update=20", "--adam-betas", "(0.9,", "0.98)"]
    assert parse_flag_list(tokens) == {"--max-update": ["20"], "--fp16": [], "--adam-betas": ["(0.9,", "0.98)"]}
    assert last_flag_value(tokens, "--max-update") == "20"
    assert last_flag_value(tokens, "--fp16") is None and last_flag_value(tokens, "--lr") is None
    assert last_flag_value(["--lr", "-1"], "--lr") == "-1"  # a negative number is a value


def test_a_command_s_flags_skip_the_program_and_its_data_folder():
    command = ["fairseq-train", "data-bin", "--lr=1", "--fp16", "--lr", "2", "--adam-betas", "(0.9,", "0.98)"]
    assert command_flags(command) == {"--lr": "2", "--fp16": "", "--adam-betas": "(0.9, 0.98)"}
    assert changed_flags(["fairseq-train", "d", "--lr", "1"], ["fairseq-train", "d", "--lr=2"]) == ["--lr 1 -> 2"]


def test_text_splits_as_a_shell_splits_it():
    assert split_flags("--adam-betas '(0.9, 0.98)' --lr=5e-4") == ["--adam-betas", "(0.9, 0.98)", "--lr=5e-4"]
    with pytest.raises(ValueError):
        split_flags("--adam-betas '(0.9, 0.98)")


def test_flag_of_a_dest():
    assert flag("dyt_alpha_init") == "--dyt-alpha-init"


def test_the_placements_and_the_tables_read_flags_by_the_same_rules():
    # the first --norm-placement (no such placement) is overridden, as argparse overrides it
    assert training_task(["--norm-placement", "nosuch", "--norm-placement=pre", "--ngpt"]) == "translation_normplug"
    assert training_task(["--norm-placement=pre"]) is None
    assert row_configuration("--norm-placement=pre --norm-type scalenorm --norm-type=rmsnorm schedule=s")[
        "norm"] == "rmsnorm"
