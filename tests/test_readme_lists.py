"""The README's and the docs' lists of norm types, placements and modifiers are the registries'
(issue 43): every built-in norm type (``modules/norm_registry.py``), placement and modifier
(``models/placements/``) is named where a reader looks for it, nothing unregistered is, the
``--zero-centered-gamma`` help names the norm types with a per-channel gain, and the README's
fairseq-train example parses."""
import argparse
import os
import re
import shlex

import pytest

from conftest import REPO
import fairseq_normplug  # noqa: F401  (registers the built-ins)
from fairseq_normplug.models.placements import MODIFIERS, PLACEMENTS
from fairseq_normplug.modules.norm_registry import NORM_TYPES


def builtin(names_to_sources):
    """The names registered by the package itself (another test may have loaded an extension)."""
    return [name for name, source in names_to_sources if source.startswith("fairseq_normplug.")]


NORMS = builtin((name, norm.source) for name, norm in NORM_TYPES.items())
GAIN_NORMS = [name for name in NORMS if NORM_TYPES[name].per_channel_gain]
PLACEMENT_NAMES = builtin((name, cls.__module__) for name, cls in PLACEMENTS.items())
MODIFIER_NAMES = builtin((name, cls.__module__) for name, cls in MODIFIERS.items())


def read(*path):
    with open(os.path.join(REPO, *path), encoding="utf-8") as f:
        return f.read()


def section(text, heading):
    """The text under the markdown heading ``heading`` (any level) up to the next heading of that level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, flags=re.M)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def table_row(text, flag):
    """The one table row whose first cell starts with `flag`."""
    rows = [line for line in text.splitlines() if line.startswith(f"| `{flag}`")]
    assert len(rows) == 1, f"{flag}: {rows}"
    return rows[0]


def one_of(row):
    """The backticked names after 'one of:' in a table row, up to the next '(' or '|'."""
    match = re.search(r"one of: ((?:`[^`]+`(?:, )?)+)", row)
    assert match, row
    return re.findall(r"`([^`]+)`", match.group(1))


def first_column(table_text):
    return [line.split("|")[1].strip() for line in table_text.splitlines() if line.startswith("| `")]


# ---- the README ---------------------------------------------------------------------------

HEADLINE = section(read("README.md"), "Headline flags")


def test_readme_headline_flags_list_exactly_the_registered_norm_types():
    assert one_of(table_row(HEADLINE, "--norm-type")) == NORMS


def test_readme_headline_flags_list_exactly_the_registered_placements():
    assert one_of(table_row(HEADLINE, "--norm-placement")) == PLACEMENT_NAMES


def test_readme_names_every_modifier_and_nothing_unregistered():
    readme = read("README.md")
    for name in MODIFIER_NAMES:
        assert f"`--{name}`" in HEADLINE, name
    # every --norm-type X / --norm-placement X written anywhere in the README is registered
    for flag, names in (("--norm-type", NORMS), ("--norm-placement", PLACEMENT_NAMES)):
        for value in re.findall(rf"{flag} ([a-z][a-z0-9_-]*)", readme):
            assert value in names, f"README: {flag} {value}"
        for choices in re.findall(rf"{flag} \{{([^}}]*)\}}", readme):
            assert choices.split(",") == names, f"README: {flag} {{{choices}}}"


def test_readme_fairseq_train_example_parses_and_resolves():
    """The README's first fairseq-train command is a valid command line of fairseq and the plugin."""
    from fairseq import options, utils
    from fairseq_normplug.models.normplug_args import resolve_normplug_args

    blocks = re.findall(r"```bash\n(.*?)```", read("README.md"), flags=re.S)
    command = next(b for b in blocks if b.lstrip().startswith("fairseq-train"))
    command = command.replace("\\\n", " ").replace('"$(fairseq-normplug-path)"',
                                                   os.path.join(REPO, "fairseq_normplug"))
    argv = shlex.split(command)
    assert argv[0] == "fairseq-train"
    for flag in ("--user-dir", "--prenorm", "--scalenorm", "--fixnorm"):
        assert flag in argv, flag
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv[1:])
    utils.import_user_module(args)
    settings = resolve_normplug_args(args)
    assert args.arch.startswith("transformer_normplug") and settings.prenorm and settings.fixnorm
    assert settings.norm.name == "scalenorm"


# ---- docs/norms.md, docs/placements.md, docs/usage.md --------------------------------------

def test_norms_doc_has_a_row_for_every_registered_norm_type_and_no_other():
    names = [cell.split("`")[1] for cell in first_column(read("docs", "norms.md"))
             if cell.split("`")[1] != "--norm-type"]
    assert sorted(set(names)) == sorted(NORMS), names


def test_placements_doc_has_a_row_for_every_registered_placement_and_no_other():
    placements = read("docs", "placements.md")
    overview = placements.split("\n## ")[0]  # the table before the first section
    assert sorted(cell.strip("`") for cell in first_column(overview)) == sorted(PLACEMENT_NAMES)
    composes = section(placements, "What composes")
    rows = {cell.split("`")[1] for cell in first_column(composes)}
    assert rows == set(PLACEMENT_NAMES)


def test_placements_composition_table_has_a_column_for_every_registered_modifier():
    composes = section(read("docs", "placements.md"), "What composes")
    table = [line for line in composes.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in re.split(r"(?<!\\)\|", table[0].strip().strip("|"))]
    for name in MODIFIER_NAMES:
        assert f"`--{name}`" in header, f"docs/placements.md 'What composes' has no --{name} column: {header}"
    widths = {len(re.split(r"(?<!\\)\|", line.strip().strip("|"))) for line in table}
    assert widths == {len(header)}, "every row of the composition table fills every column"


def test_usage_doc_choice_lists_and_error_example_are_the_registries():
    usage = read("docs", "usage.md")
    for flag, names in (("--norm-type", NORMS), ("--norm-placement", PLACEMENT_NAMES)):
        lists = re.findall(rf"`{flag} \{{([^}}]*)\}}", usage)
        assert lists, flag
        for choices in lists:
            assert choices.split(",") == names, f"docs/usage.md: {flag} {{{choices}}}"
    (choose,) = re.findall(r"choose one of ([a-z0-9, -]+)`", usage)
    assert choose.split(", ") == NORMS
    (applies,) = re.findall(r"`--zero-centered-gamma` \|[^|]*applies to ([a-z0-9, -]+) \(", usage)
    assert applies.split(", ") == GAIN_NORMS


# ---- --zero-centered-gamma's help ------------------------------------------------------------

def test_zero_centered_gamma_help_names_every_norm_type_with_a_per_channel_gain():
    from fairseq_normplug.models.normplug_args import add_normplug_args

    parser = argparse.ArgumentParser()
    add_normplug_args(parser)
    (action,) = [a for a in parser._actions if "--zero-centered-gamma" in a.option_strings]
    applies = action.help.split("applies to ")[-1].split(", ")
    assert GAIN_NORMS and set(GAIN_NORMS) <= set(applies)
    assert [name for name in applies if name in NORM_TYPES and not NORM_TYPES[name].per_channel_gain] == []


@pytest.mark.parametrize("name", GAIN_NORMS)
def test_every_gain_norm_type_is_listed_for_zero_centered_gamma_in_the_docs(name):
    assert name in re.search(r"--zero-centered-gamma.*", read("docs", "usage.md")).group(0)
