"""A placement written outside the package, only through the public interface
(``register_placement``, ``Placement``, ``new_norm``): its choice and its own flag appear, its
refusals are one line, its norm slots take every --norm-type and are named, its forward is
the layer's, incremental decoding, gradients and --checkpoint-activations work; and the
registry refuses a second placement of the same name."""
import pytest
import torch

from conftest import registrations_restored
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placements import PLACEMENTS, SUBLAYER_NORMS, Placement, new_norm, register_placement
from fairseq_normplug.modules.norm_registry import ATTENTION, FFN
from fairseq_normplug.modules.rms_norm import RMSNorm
from model_helpers import assert_incremental_matches_full, build, parse_args, randomized
from test_placements import TINY, one_backward

BRANCH_NORMS = {"attn": "attn_branch_norm", "cross": "cross_branch_norm", "ffn": "ffn_branch_norm"}


class BranchNorm(Placement):
    """A toy placement: every sublayer output normalised by its own new norm (fairseq's are
    removed) and scaled by g, x <- x + g * Dropout(LN_b(F(x))), g = --branch-gain (default 1)."""

    defaults = {"branch_gain": None}
    norm_slots = (("attn_branch_norm", ATTENTION, "attn_branch"), ("cross_branch_norm", ATTENTION, "cross_branch"),
                  ("ffn_branch_norm", FFN, "ffn_branch"))

    @classmethod
    def add_args(cls, parser):
        parser.add_argument("--branch-gain", type=float, metavar="G", help="g of the toy placement")

    def __init__(self, args):
        super().__init__(args)
        self.gain = 1.0 if args.branch_gain is None else args.branch_gain
        if self.gain <= 0:
            self.refuse(f"--branch-gain must be > 0, got {self.gain}")

    def build_layer(self, layer, index, num_layers):
        for kind, attr in BRANCH_NORMS.items():
            if kind != "cross" or getattr(layer, "encoder_attn", None) is not None:
                setattr(layer, attr, new_norm(layer.embed_dim, ATTENTION if kind != "ffn" else FFN))
                setattr(layer, SUBLAYER_NORMS[kind], None)

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            x = x + self.gain * layer.dropout_module(getattr(layer, BRANCH_NORMS[kind])(sublayer(x)))
        return x


@pytest.fixture
def branch_norm():
    with registrations_restored():
        register_placement("branch-norm")(BranchNorm)
        yield


def test_an_outside_placement_gets_its_flag_slots_and_every_norm_type(tiny_bin, branch_norm):
    model, task, args = build(tiny_bin, TINY, "--norm-placement", "branch-norm", "--branch-gain", "0.5", "--rmsnorm")
    layer = model.encoder.layers[1]
    assert layer.placement.gain == 0.5
    norms = named_norms(model)
    assert {"enc1.attn_branch", "enc1.ffn_branch", "dec0.cross_branch"} <= set(norms)
    assert "enc0.cross_branch" not in norms and all(isinstance(norm, RMSNorm) for norm in norms.values())
    randomized(model, seed=3).eval()
    x = torch.randn(5, 2, 64)
    with torch.no_grad():
        h = x + 0.5 * layer.attn_branch_norm(layer.self_attn(x, x, x, need_weights=False)[0])
        expected = h + 0.5 * layer.ffn_branch_norm(layer.fc2(torch.relu(layer.fc1(h))))
        assert torch.allclose(layer(x, None), expected, atol=1e-5)
    assert_incremental_matches_full(model, task)
    plain = one_backward(build(tiny_bin, TINY, "--norm-placement", "branch-norm", seed=4)[0], task)
    assert all(grad is not None for grad in plain.values()), [name for name, grad in plain.items() if grad is None]
    checkpointed = one_backward(build(tiny_bin, TINY, "--norm-placement", "branch-norm", "--checkpoint-activations",
                                      seed=4)[0], task)
    assert all(torch.allclose(checkpointed[name], grad, atol=1e-6) for name, grad in plain.items())


@pytest.mark.parametrize("flags,message", [
    (["--norm-placement", "branch-norm", "--branch-gain", "0"], "--branch-gain must be > 0, got 0.0"),
    (["--branch-gain", "2"], "--branch-gain needs --norm-placement branch-norm, got --norm-placement post"),
])
def test_an_outside_placement_refuses_in_one_line(tiny_bin, branch_norm, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert str(error.value) == message


def test_the_registry_refuses_a_taken_name_and_a_non_placement(branch_norm):
    with pytest.raises(NormplugError, match="placement 'branch-norm' is already registered"):
        register_placement("branch-norm")(type("Other", (Placement,), {}))
    with pytest.raises(NormplugError, match="is not a subclass of fairseq_normplug.models.placements.Placement"):
        register_placement("plain")(object)
    assert "plain" not in PLACEMENTS


#: issue 36's designs, the proof that the public interface carries real research code
DESIGNS_OF_2024_2026 = ("models/placements/siamese.py", "models/placements/output_norm.py",
                        "models/placements/hyper_connections.py", "models/placements/gpas.py",
                        "models/placements/ngpt.py", "modules/taper_norm.py", "modules/seed_norm.py",
                        "modules/fixed_std_layer_norm.py")


@pytest.mark.parametrize("path", DESIGNS_OF_2024_2026)
def test_the_2024_2026_designs_import_only_the_public_interface(path):
    """Each design file takes from the package only what ``fairseq_normplug`` exports (or
    another registered design it builds on, as an extension may): it could live outside."""
    import ast
    import os
    import fairseq_normplug
    from fairseq_normplug.models.placements import MODIFIERS

    package = os.path.dirname(fairseq_normplug.__file__)
    design_modules = {cls.__module__ for cls in (*PLACEMENTS.values(), *MODIFIERS.values())}
    tree = ast.parse(open(os.path.join(package, path)).read())
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("fairseq_normplug") for alias in node.names]
    assert imported, path
    for module, name in imported:
        assert name in fairseq_normplug.__all__ or module in design_modules, (path, module, name)
