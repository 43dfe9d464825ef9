"""fairseq's ``args`` after the plugin's resolution, and who writes it (issue 56).

The resolution leaves exactly the namespace that the code before models/args_writer.py left
(a snapshot taken with that code: tests/fixtures/resolved_args/snapshot.json, made by
tests/resolved_args_snapshot.py), so a checkpoint records the same flags; and no model-side
module but models/args_writer.py (and the ``--arch`` presets' defaults) writes ``args``."""
import json

import pytest

from resolved_args_snapshot import FLAG_SETS, NAMESPACES, SNAPSHOT, hand_made, parsed

with open(SNAPSHOT, encoding="utf-8") as f:
    EXPECTED = json.load(f)


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_parsed_and_resolved_args_are_unchanged(name):
    """fairseq-train's parsing (the presets resolve once) and build_model's second resolution."""
    assert parsed(name) == EXPECTED["parsed"][name]


@pytest.mark.parametrize("name", sorted(NAMESPACES))
def test_a_hand_made_namespace_gets_the_same_fields_in_the_same_order(name):
    assert hand_made(name) == EXPECTED["hand_made"][name]
