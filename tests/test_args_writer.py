"""fairseq's ``args`` after the plugin's resolution, and who writes it (issue 56).

The resolution leaves exactly the namespace that the code before models/args_writer.py left
(a snapshot taken with that code: tests/fixtures/resolved_args/snapshot.json, made by
tests/resolved_args_snapshot.py), so a checkpoint records the same flags; and no model-side
module but models/args_writer.py (and the ``--arch`` presets' defaults) writes ``args``."""
import argparse
import ast
import json
import os

import pytest

from conftest import REPO
from resolved_args_snapshot import FLAG_SETS, NAMESPACES, NORM_ARGS, SNAPSHOT, hand_made, norm_args_fields, parsed

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.args_writer import FAIRSEQ_FIELDS, PLUGIN_FIELDS, write_design_fields, write_resolved
from fairseq_normplug.models.placements.hyper_connections import HyperConnections

with open(SNAPSHOT, encoding="utf-8") as f:
    EXPECTED = json.load(f)


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_parsed_and_resolved_args_are_unchanged(name):
    """fairseq-train's parsing (the presets resolve once) and build_model's second resolution."""
    assert parsed(name) == EXPECTED["parsed"][name]


@pytest.mark.parametrize("name", sorted(NAMESPACES))
def test_a_hand_made_namespace_gets_the_same_fields_in_the_same_order(name):
    assert hand_made(name) == EXPECTED["hand_made"][name]


@pytest.mark.parametrize("name", sorted(NORM_ARGS))
def test_norm_args_gives_the_same_namespace(name):
    assert norm_args_fields(name) == EXPECTED["norm_args"][name]


# ---- who writes fairseq's args ------------------------------------------------------------------

#: the model side of the package: what builds and resolves a model
MODEL_SIDE = ("models", "modules")
#: the one writer, and the --arch presets (fairseq's defaults only)
WRITERS = {"models/args_writer.py", "models/architectures.py"}
#: the names fairseq's namespace goes by in the package
ARGS_NAMES = {"args", "cfg", "model_cfg", "namespace", "config"}
#: fairseq's own build_model, replicated line for line (its writes are fairseq's, not the plugin's;
#: tests/test_model_build.py fails when fairseq's changes)
REPLICATED_FAIRSEQ = {("models/transformer_normplug.py", "build_fairseq_model")}


def _replicated_lines(tree: ast.AST, relative: str) -> set:
    return {line for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and (relative, node.name) in REPLICATED_FAIRSEQ for line in range(node.lineno, node.end_lineno + 1)}


def _is_args(node) -> bool:
    return isinstance(node, ast.Name) and node.id in ARGS_NAMES


def args_writes(tree: ast.AST):
    """``(line, what)`` of every write to ``args``: ``args.x = ...`` (also chained or augmented),
    ``setattr(args, ...)``, ``delattr(args, ...)``, ``vars(args)[...] = ...``, ``args.__dict__``."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and _is_args(target.value):
                yield node.lineno, f"args.{target.attr} ="
            if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Call)
                    and getattr(target.value.func, "id", None) == "vars" and target.value.args
                    and _is_args(target.value.args[0])):
                yield node.lineno, "vars(args)[...] ="
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr")
                and node.args and _is_args(node.args[0])):
            yield node.lineno, f"{node.func.id}(args, ...)"
        if isinstance(node, ast.Attribute) and node.attr == "__dict__" and _is_args(node.value):
            yield node.lineno, "args.__dict__"


def model_side_writers(package_dir: str):
    """``file:line what`` of every write to ``args`` in a model-side module but the writers."""
    found = []
    for part in MODEL_SIDE:
        for root, _, files in sorted(os.walk(os.path.join(package_dir, part))):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                relative = os.path.relpath(path, package_dir).replace(os.sep, "/")
                if relative in WRITERS:
                    continue
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), relative)
                replicated = _replicated_lines(tree, relative)
                found += [f"{relative}:{line} {what}" for line, what in args_writes(tree) if line not in replicated]
    return found


def test_only_the_args_writer_writes_args():
    """Issue 56: fairseq's args is written on the model side by models/args_writer.py only
    (besides the --arch presets' defaults)."""
    assert model_side_writers(os.path.join(REPO, "fairseq_normplug")) == []


def test_the_check_finds_every_form_of_write(tmp_path):
    package = tmp_path / "fairseq_normplug"
    (package / "models" / "placements").mkdir(parents=True)
    (package / "modules").mkdir()
    (package / "models" / "args_writer.py").write_text("def w(args):\n    args.x = 1\n")
    (package / "models" / "placements" / "p.py").write_text(
        "def f(args, cfg):\n    self.a = args.b = 1\n    setattr(args, 'c', 2)\n    cfg.d += 1\n")
    (package / "modules" / "m.py").write_text(
        "def g(args):\n    vars(args)['e'] = 1\n    args.__dict__.update({})\n    delattr(args, 'f')\n"
        "    other.x = args.y\n    setattr(model, 'z', args)\n")
    assert sorted(model_side_writers(str(package))) == [
        "models/placements/p.py:2 args.b =",
        "models/placements/p.py:3 setattr(args, ...)",
        "models/placements/p.py:4 args.d =",
        "modules/m.py:2 vars(args)[...] =",
        "modules/m.py:3 args.__dict__",
        "modules/m.py:4 delattr(args, ...)",
    ]


# ---- the writer's own rules -----------------------------------------------------------------------

def test_every_written_field_has_a_one_line_reason():
    for name, reason in {**FAIRSEQ_FIELDS, **PLUGIN_FIELDS}.items():
        assert reason.strip() and "\n" not in reason, name
    assert set(FAIRSEQ_FIELDS) == {"encoder_normalize_before", "decoder_normalize_before",
                                   "share_decoder_input_output_embed", "tpu"}


def test_a_field_without_a_reason_is_refused():
    args = argparse.Namespace(dropout=0.1)
    with pytest.raises(NormplugError) as error:
        write_resolved(args, {"norm_type": "rmsnorm", "dropout": 0.3})
    assert "args.dropout" in str(error.value) and "\n" not in str(error.value)
    assert args == argparse.Namespace(dropout=0.1)  # nothing written


def test_a_design_writes_only_its_own_flags():
    class Wrong(HyperConnections):
        def resolved_fields(self):
            return {**super().resolved_fields(), "dropout": 0.0}

    fields = dict(hc_streams=2, hc_manifold=None, residual_scale=None, weight_init=None)
    args = argparse.Namespace(**fields)
    write_design_fields(args, HyperConnections(args))
    assert (args.hc_streams, args.hc_manifold) == (2, False)
    args = argparse.Namespace(**fields)
    with pytest.raises(NormplugError, match=r"resolves args\.dropout, which is not one of its flags"):
        write_design_fields(args, Wrong(args))
    assert args == argparse.Namespace(**fields)
