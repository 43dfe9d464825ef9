"""Composition by capability (issue 55): a placement declares what its layers are
(``models/placements/base.py``, ``CAPABILITIES``), a modifier requires what its paper needs
(``Modifier.requires``), and what composes is decided from those, never from a placement's name.

A placement written outside the package, through the public interface only, that declares
PreNorm's capabilities takes NormFormer, LayerNorm Scaling and GPAS and trains; the same
placement without the declarations is refused in one line naming the missing capability and
the placements (from the registry) that have it.
"""
import ast
import os
from argparse import Namespace

import pytest
import torch

from conftest import REPO
from model_helpers import assert_training_steps_reach_every_parameter, build, toy_batch

from fairseq_normplug import Placement, register_placement
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.resolved_config import resolve
from fairseq_normplug.models.placements.base import PRENORM_LIKE, missing_capability, placements_with

TINY = "transformer_normplug_tiny"
DECLARED = "test-capabilities-prenorm"
UNDECLARED = "test-capabilities-undeclared"
MODIFIERS = ("--normformer", "--layernorm-scaling", "--gpas")


class OwnPreNorm(Placement):
    """PreNorm written as a researcher would, x <- x + Dropout(F(LN(x))) plus a final norm per
    stack, declaring what it is."""

    final_norm = True
    normalizes_sublayer_input = True
    residual_stream = "raw"

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            x = layer.residual_connection(layer.dropout_module(sublayer(layer.norm(kind)(x))), x)
        return x


class UndeclaredPreNorm(OwnPreNorm):
    """The same layers, declaring nothing (the interface's defaults)."""

    normalizes_sublayer_input = False
    residual_stream = None


@pytest.fixture(scope="module", autouse=True)
def own_placements():
    """Both placements registered in this process (conftest's ``registrations_undone`` takes
    them out of the registry when the module ends)."""
    register_placement(DECLARED)(OwnPreNorm)
    register_placement(UNDECLARED)(UndeclaredPreNorm)


def test_a_placement_declaring_prenorm_capabilities_takes_the_prenorm_modifiers_and_trains(tiny_bin):
    model, task, args = build(tiny_bin, TINY, "--norm-placement", DECLARED, *MODIFIERS)
    for layer in (*model.encoder.layers, *model.decoder.layers):
        assert hasattr(layer, "attn_ln") and hasattr(layer, "ffn_layernorm") and hasattr(layer, "gpas")
        assert layer.self_attn.out_proj.head_scale.numel() == layer.self_attn.num_heads
    assert_training_steps_reach_every_parameter(model, task, args)


def test_the_own_prenorm_with_the_modifiers_is_the_builtin_prenorm_with_them(tiny_bin):
    """Declared PreNorm-like and wired as PreNorm, it gives the built-in's model: same
    parameters, same outputs."""
    ours, task, _ = build(tiny_bin, TINY, "--norm-placement", DECLARED, *MODIFIERS)
    builtin, _, _ = build(tiny_bin, TINY, "--prenorm", *MODIFIERS)
    theirs = dict(builtin.named_parameters())
    assert [name for name, _ in ours.named_parameters()] == list(theirs)
    with torch.no_grad():
        for name, p in ours.named_parameters():  # random values, so every module counts
            p.copy_(torch.randn_like(p))
            theirs[name].copy_(p)
    ours.eval(), builtin.eval()
    src, lengths, prev = toy_batch(task)
    assert torch.allclose(ours(src, lengths, prev)[0], builtin(src, lengths, prev)[0], atol=1e-6)


@pytest.mark.parametrize("modifier", MODIFIERS)
def test_without_the_declarations_each_modifier_is_refused_in_one_line(tiny_bin, modifier):
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--norm-placement", UNDECLARED, modifier)
    message = str(error.value)
    assert "\n" not in message and f"--norm-placement {UNDECLARED}" in message
    assert "it has normalizes_sublayer_input=False, not True" in message
    # the placements that have it come from the registry: the researcher's own is among them
    assert message.endswith(f": pre, {DECLARED}") or message.endswith(f": pre, sandwich, {DECLARED}")


def test_the_placements_with_a_capability_come_from_the_registry():
    assert placements_with(PRENORM_LIKE) == ["pre", DECLARED]
    assert placements_with({"single_stream": False}) == ["resi-dual", "siamese", "hyper-connections",
                                                        "attention-residuals"]
    assert missing_capability(UndeclaredPreNorm, PRENORM_LIKE) == "normalizes_sublayer_input"
    with pytest.raises(NormplugError, match="^unknown placement capability 'prenorm'; choose from "):
        missing_capability(OwnPreNorm, {"prenorm": True})


@pytest.mark.parametrize("config,name,prenorm_like", [
    ({"norm_placement": None}, "post", False),  # an old checkpoint: the default, PostNorm (not pre)
    ({"norm_placement": None, "encoder_normalize_before": True, "decoder_normalize_before": True}, "pre", True),
    ({"norm_placement": None, "encoder_normalize_before": True}, "post", False),  # fairseq's mixed model
    ({"norm_placement": "sandwich"}, "sandwich", False),
    ({"norm_placement": DECLARED}, DECLARED, True),
])
def test_the_placement_of_a_built_model_is_read_from_its_resolved_config(config, name, prenorm_like):
    """A checkpoint's model config (an old one without norm_placement, fairseq's mixed model),
    resolved as the model is built (resolve): its placement, with its capabilities."""
    placement = resolve(Namespace(**config)).placement_design
    assert placement.name == name and (missing_capability(placement, PRENORM_LIKE) is None) == prenorm_like
    assert config["norm_placement"] in (None, name)  # the config itself is not changed


# ---- no module decides a composition by a placement's name ---------------------------------

#: (file, function) where names are what is resolved: the flags -> the placement they name
#: (``--prenorm`` and fairseq's normalize-before flags are ``--norm-placement pre``)
NAME_RESOLVERS = {("models/placement_args.py", "_chosen_placement")}


def _mentions_placement(node) -> bool:
    """``placement``, ``norm_placement``, ``x.norm_placement``, ``placement.name``, ..."""
    if isinstance(node, ast.Attribute) and node.attr == "name":
        return _mentions_placement(node.value)
    if isinstance(node, ast.Attribute):
        return "placement" in node.attr
    if isinstance(node, ast.Name):
        return "placement" in node.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        return any(isinstance(a, ast.Constant) and a.value == "norm_placement" for a in node.args)
    return False


def _is_names(node) -> bool:
    """A string, or a tuple/list/set of strings (None allowed among them)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def _enclosing_function(node, parents) -> str:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return "<module>"


def name_comparisons(package_dir: str):
    """``file:line function`` of every comparison of a placement (or its name) with names, and
    every use of a hand-written list of placements (``MULTI_STREAM_PLACEMENTS``)."""
    found = []
    for root, _, files in sorted(os.walk(package_dir)):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, file)
            relative = os.path.relpath(path, package_dir)
            tree = ast.parse(open(path).read(), path)
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                compares_names = isinstance(node, ast.Compare) and any(
                    map(_mentions_placement, [node.left, *node.comparators])) and any(
                    map(_is_names, [node.left, *node.comparators]))
                if compares_names or (isinstance(node, ast.Name) and node.id == "MULTI_STREAM_PLACEMENTS"):
                    function = _enclosing_function(node, parents)
                    if (relative, function) not in NAME_RESOLVERS:
                        found.append(f"{relative}:{node.lineno} {function}")
    return sorted(set(found))


def test_no_module_compares_a_placements_name():
    assert name_comparisons(os.path.join(REPO, "fairseq_normplug")) == []


def test_the_check_finds_a_name_comparison(tmp_path):
    (tmp_path / "modifier.py").write_text("def __init__(self, args, placement):\n"
                                          "    if placement.name not in ('pre', 'sandwich'):\n"
                                          "        pass\n"
                                          "def fold(cfg):\n"
                                          "    return getattr(cfg, 'norm_placement', None) == 'pre'\n")
    assert name_comparisons(str(tmp_path)) == ["modifier.py:2 __init__", "modifier.py:5 fold"]


@pytest.mark.parametrize("flags,label", [
    ("--prenorm", "prenorm"), ("--encoder-normalize-before --decoder-normalize-before", "prenorm"),
    ("--encoder-normalize-before", "postnorm"),  # fairseq's mixed model: the resolver's post
    ("", "postnorm"), ("--norm-placement sandwich --gpas", "sandwich+gpas"),
])
def test_a_results_rows_placement_is_the_resolvers(flags, label):
    from fairseq_normplug.experiments import tables

    assert tables.row_configuration(f"{flags} schedule=s")["placement"] == label


def test_a_results_row_with_contradicting_placement_flags_matches_no_configuration():
    from fairseq_normplug.experiments import tables

    assert tables.row_configuration("--postnorm --encoder-normalize-before schedule=s") is None


def test_a_results_row_of_a_placement_no_loaded_module_defines_has_no_configuration():
    """A row's configuration is what its model would be built with (resolve_flags): a placement
    that no module loaded here defines cannot be built, so the row matches no published number."""
    from fairseq_normplug.experiments import tables

    assert tables.row_configuration("--norm-placement not-loaded-here schedule=s") is None


def test_ngpt_needs_fairseqs_own_postnorm_not_the_mixed_model(tiny_bin):
    """nGPT requires ``pure_postnorm``: fairseq's mixed model (one stack PreNorm) lacks it."""
    from model_helpers import parse_args

    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, "--ngpt", "--encoder-normalize-before", task="translation_normplug")
    assert str(error.value).startswith("--ngpt cannot be combined with --encoder-normalize-before (fairseq's "
                                       "PreNorm in one stack): nGPT replaces the residual placement")
    assert str(error.value).endswith("it has pure_postnorm=False, not True (x <- LN(x + F(x)) after every residual "
                                     "addition of both stacks, the residual branch scalable as DeepNorm and Admin "
                                     "scale it); placements with stock_model=True, pure_postnorm=True: post")
