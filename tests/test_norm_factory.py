"""Issue 56, "built, not patched" (fairseq_normplug/models/norm_factory.py): every norm slot holds
its final module when its layer leaves the build hook (a stack's own norms when the stack is
built), for the built-in designs, a placement from outside the package, fairseq's own stacks and
FixNorm's decoder; nothing replaces them afterwards; the norm that feeds the output layer is
decided as it is built; a slot left with a placeholder, or a design that changes which norm feeds
the output layer after it was built, is refused in one line."""
import pytest

from conftest import registrations_restored
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import (PLACEHOLDER_CLASSES, STACK_NORM_SLOTS, layer_norms,
                                                    named_norms, output_norm)
from fairseq_normplug.models.placements import (SUBLAYER_NORMS, Placement, new_norm, register_placement,
                                                set_final_norm, slot_norm)
from fairseq_normplug.models.placements.layers import PlacedDecoder, PlacedEncoder
from fairseq_normplug.models.transformer_normplug import TransformerNormplugModel
from fairseq_normplug.modules.norm_registry import ATTENTION, FFN, FINAL, norm_type_of
from model_helpers import build

TINY = "transformer_normplug_tiny"
BRANCH_NORMS = {"attn": "attn_branch_norm", "cross": "cross_branch_norm", "ffn": "ffn_branch_norm"}


class BuiltBranchNorm(Placement):
    """An outside placement that builds its norms through the factory: x <- x + Dropout(LN_b(F(x)))."""

    norm_slots = (("attn_branch_norm", ATTENTION, "attn_branch"), ("cross_branch_norm", ATTENTION, "cross_branch"),
                  ("ffn_branch_norm", FFN, "ffn_branch"))

    def build_layer(self, layer, index, num_layers):
        for kind, attr in BRANCH_NORMS.items():
            if getattr(layer, SUBLAYER_NORMS[kind], None) is not None:
                setattr(layer, attr, slot_norm(layer, attr))

    def sublayers(self, layer, x, sublayers):
        for kind, sublayer in sublayers:
            x = layer.norm(kind)(x + layer.dropout_module(getattr(layer, BRANCH_NORMS[kind])(sublayer(x))))
        return x


class PlaceholderBranchNorm(BuiltBranchNorm):
    """The same, written against ``new_norm(dim, role)`` (a LayerNorm the factory fills)."""

    def build_layer(self, layer, index, num_layers):
        for kind, attr in BRANCH_NORMS.items():
            if getattr(layer, SUBLAYER_NORMS[kind], None) is not None:
                setattr(layer, attr, new_norm(layer.embed_dim, FFN))


class StackFilledBranchNorm(BuiltBranchNorm):
    """A faulty design: it fills its layer slots in ``build_stack``, after the layers were built."""

    def build_layer(self, layer, index, num_layers):
        pass

    def build_stack(self, stack):
        for layer in stack.layers:
            for kind, attr in BRANCH_NORMS.items():
                if getattr(layer, SUBLAYER_NORMS[kind], None) is not None:
                    setattr(layer, attr, new_norm(layer.embed_dim, FFN))


class UndeclaredFinalNorm(Placement):
    """A faulty design: PostNorm layers whose ``build_stack`` adds a final norm it does not declare
    (``final_norm``), so the decoder's last FFN norm was built as the one feeding the output layer."""

    stock_forward = True

    def build_stack(self, stack):
        set_final_norm(stack, new_norm(stack.layers[0].embed_dim, FINAL))


@pytest.fixture
def outside_placements():
    designs = {"built-branch": BuiltBranchNorm, "placeholder-branch": PlaceholderBranchNorm,
               "stack-filled-branch": StackFilledBranchNorm, "undeclared-final": UndeclaredFinalNorm}
    with registrations_restored():
        for name, design in designs.items():
            register_placement(name)(design)
        yield


def norms_of_stack(stack, prefix):
    """{short name: norm} of one built stack (layers and the stack's own norms)."""
    norms = {}
    for index, layer in enumerate(stack.layers):
        norms.update({f"{prefix}{index}.{short}": getattr(owner, attr) for owner, attr, _, short in layer_norms(layer)})
    norms.update({f"{prefix}.{short}": getattr(stack, attr) for attr, _, short in STACK_NORM_SLOTS
                  if getattr(stack, attr, None) is not None})
    return norms


@pytest.fixture
def build_spy(monkeypatch):
    """What each layer holds as it leaves its build hook, and each stack as build_encoder /
    build_decoder return it: {short name: norm}."""
    seen = {"layers": {}, "stacks": {}}
    built = {"enc": 0, "dec": 0}  # fairseq builds a stack's layers in order

    def spying_layer_hook(hook, prefix):
        def spy(self, *args, **kwargs):
            layer = hook(self, *args, **kwargs)
            index, built[prefix] = built[prefix], built[prefix] + 1
            for owner, attr, _, short in layer_norms(layer):
                seen["layers"][f"{prefix}{index}.{short}"] = getattr(owner, attr)
            return layer
        return spy

    def spying_stack_hook(hook, prefix):
        def spy(cls, *args, **kwargs):
            stack = hook(*args, **kwargs)
            seen["stacks"].update(norms_of_stack(stack, prefix))
            return stack
        return classmethod(spy)

    monkeypatch.setattr(PlacedEncoder, "build_encoder_layer", spying_layer_hook(PlacedEncoder.build_encoder_layer, "enc"))
    monkeypatch.setattr(PlacedDecoder, "build_decoder_layer", spying_layer_hook(PlacedDecoder.build_decoder_layer, "dec"))
    monkeypatch.setattr(TransformerNormplugModel, "build_encoder",
                        spying_stack_hook(TransformerNormplugModel.build_encoder, "enc"))
    monkeypatch.setattr(TransformerNormplugModel, "build_decoder",
                        spying_stack_hook(TransformerNormplugModel.build_decoder, "dec"))
    return seen


@pytest.mark.parametrize("flags, layer_hooks", [
    (["--norm-placement", "built-branch", "--rmsnorm"], True),
    (["--norm-placement", "placeholder-branch", "--dyt"], True),
    (["--norm-placement", "sandwich", "--dyt"], True),
    (["--prenorm", "--normformer", "--rmsnorm", "--layernorm-embedding"], True),
    (["--norm-placement", "hybrid", "--rmsnorm"], True),
    (["--norm-placement", "hyper-connections", "--hc-streams", "2", "--rmsnorm"], True),
    (["--norm-placement", "resi-dual", "--scalenorm"], True),
    (["--dyt"], False),  # fairseq's own stacks: filled as each stack is built
    (["--prenorm", "--fixnorm", "--rmsnorm"], False),  # fairseq's encoder; FixNorm's decoder builds fairseq's layers
], ids=["outside-slot-norm", "outside-new-norm", "sandwich", "normformer", "hybrid", "hyper-connections",
        "resi-dual", "stock-postnorm", "fixnorm"])
def test_each_slot_holds_its_final_norm_when_its_layer_leaves_the_build_hook(
        tiny_bin, outside_placements, build_spy, flags, layer_hooks):
    model, _, args = build(tiny_bin, TINY, *flags)
    final = named_norms(model)
    asked = args.norm_type
    assert {name: norm_type_of(norm) for name, norm in final.items()} == {name: asked for name in final}
    assert not [name for name, norm in final.items() if type(norm) in PLACEHOLDER_CLASSES]
    assert set(build_spy["stacks"]) == set(final)
    assert [name for name, norm in final.items() if build_spy["stacks"][name] is not norm] == []
    if layer_hooks:
        built_by_hook = build_spy["layers"]
        assert set(built_by_hook) == {name for name in final if name.split(".")[0][-1].isdigit()}
        assert [name for name, norm in built_by_hook.items() if final[name] is not norm] == []
    if "--fixnorm" in flags:
        assert {name.split(".")[0] for name in build_spy["layers"]} == {f"dec{i}" for i in range(len(model.decoder.layers))}
        assert [name for name, norm in build_spy["layers"].items() if final[name] is not norm] == []


@pytest.mark.parametrize("flags, feeding", [
    (["--postnorm"], "dec1.ffn"),
    (["--prenorm"], "dec.final"),
    (["--prenorm", "--no-decoder-final-norm"], "dec1.ffn"),
    (["--norm-placement", "mix"], "dec.final"),
    (["--norm-placement", "mix", "--mix-ln-ratio", "1"], "dec1.ffn"),
    (["--norm-placement", "resi-dual"], "dec1.resi_final"),
    (["--norm-placement", "sandwich"], "dec.final"),
    (["--fixnorm"], "dec1.ffn"),
], ids=["postnorm", "prenorm", "prenorm-no-final", "mix", "mix-all-post", "resi-dual", "sandwich", "fixnorm"])
def test_the_norm_feeding_the_output_layer_is_decided_as_it_is_built(tiny_bin, flags, feeding):
    """ScaleNorm's fixed g: every g frozen but the output norm's, which the build decided."""
    model, _, _ = build(tiny_bin, TINY, *flags, "--scalenorm", "--scalenorm-fixed-g")
    norms = named_norms(model)
    assert [name for name, norm in norms.items() if norm.g.requires_grad] == [feeding]
    assert output_norm(model) is norms[feeding]


def test_a_layer_slot_filled_after_its_layer_was_built_is_refused_in_one_line(tiny_bin, outside_placements):
    with pytest.raises(NormplugError) as refused:
        build(tiny_bin, TINY, "--norm-placement", "stack-filled-branch", "--rmsnorm")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the built model still holds a placeholder LayerNorm at "
                              "encoder.layers.0.attn_branch_norm (enc0.attn_branch)")
    # the layernorm type keeps the LayerNorms as built: nothing to refuse
    model, _, _ = build(tiny_bin, TINY, "--norm-placement", "stack-filled-branch")
    assert type(model.encoder.layers[0].attn_branch_norm) in PLACEHOLDER_CLASSES


def test_a_final_norm_added_behind_the_factorys_back_is_refused_in_one_line(tiny_bin, outside_placements):
    with pytest.raises(NormplugError) as refused:
        build(tiny_bin, TINY, "--norm-placement", "undeclared-final", "--scalenorm", "--scalenorm-fixed-g")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the norm feeding the output layer is dec.final, but the norms built as that norm "
                              "are dec1.ffn, dec.final")
    model, _, _ = build(tiny_bin, TINY, "--norm-placement", "undeclared-final")  # fairseq's LayerNorms: no matter
    assert output_norm(model) is model.decoder.layer_norm


def test_slot_norm_names_the_slots_it_knows(tiny_bin, outside_placements, monkeypatch):
    def unlisted(self, layer, index, num_layers):
        layer.unlisted_norm = slot_norm(layer, "unlisted_norm")

    monkeypatch.setattr(BuiltBranchNorm, "build_layer", unlisted)
    with pytest.raises(NormplugError, match=r"^no registered design lists the norm slot 'unlisted_norm'; "
                                            r"list it in the design's norm_slots \(known slots: [^\n]*\)$"):
        build(tiny_bin, TINY, "--norm-placement", "built-branch", "--rmsnorm")
