"""A row name is one line of text (issue 53): a control character (newline, tab, ...) or a line
separator in a table config's row, ``--add-row NAME=FLAGS`` or ``--rows`` is refused in one line
before any work (a newline used to split the row of results.md)."""
import pytest

from conftest import write_configs
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import reproduce
from fairseq_normplug.experiments.configs import check_row_name, load_table

BAD_NAMES = [("PreNorm\n+ DyT", "'\\n'"), ("PreNorm\t+ DyT", "'\\t'"), ("PreNorm\r", "'\\r'"),
             ("Pre\x1bNorm", "'\\x1b'"), ("PreNorm\u2028DyT", "'\\u2028'")]


@pytest.mark.parametrize("name,shown", BAD_NAMES, ids=[repr(n) for n, _ in BAD_NAMES])
def test_a_table_row_with_a_control_character_is_refused(tmp_path, name, shown):
    table = {"title": "t", "recipe": "cpu_tiny", "pairs": ["src-tgt"],
             "rows": [{"name": "PostNorm", "model": [], "schedule": "inv_sqrt_decay"},
                      {"name": name, "model": ["--prenorm"], "schedule": "inv_sqrt_decay"}]}
    config_dir = write_configs(tmp_path / "configs", tables={"own": table})
    with pytest.raises(NormplugError) as error:
        load_table("own", config_dir)
    message = str(error.value)
    assert message.endswith(f"own.json: row 2: row name {name!r} holds the control character {shown}; "
                            f"a row name is one line of text (it is a row of results.md)")
    assert "\n" not in message and "\t" not in message


@pytest.mark.parametrize("name,shown", BAD_NAMES[:2], ids=[repr(n) for n, _ in BAD_NAMES[:2]])
def test_add_row_and_rows_refuse_it_before_any_work(tmp_path, name, shown):
    runs = tmp_path / "runs"
    for argv, where in ((["--add-row", f"{name}=--prenorm"], "--add-row"), (["--rows", name], "--rows")):
        with pytest.raises(SystemExit) as exit_:
            reproduce.main(["table3", "gl-en", "--runs-dir", str(runs), "--print-commands", *argv])
        assert exit_.value.code == (f"reproduce.sh: error: {where}: row name {name!r} holds the control character "
                                    f"{shown}; a row name is one line of text (it is a row of results.md)")
    assert not runs.exists()


def test_single_line_names_pass():
    for name in ("PreNorm + DyT (α=0.5)", "Post-LN, ×2 warmup", "FixNorm + ScaleNorm ‡"):
        assert check_row_name(name, "--add-row") == name
    with pytest.raises(NormplugError, match=r"^own.json: row 2: row name '\+\+' needs letters or digits"):
        check_row_name("++", "own.json: row 2")
