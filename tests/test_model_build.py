"""How the plugin's model is built (fairseq_normplug/models/transformer_normplug.py): fairseq's
``build_model`` replicated with the layer plan passed explicitly to ``build_encoder`` /
``build_decoder`` (no build state outside the call), and the replica still fairseq's code; a model
that still holds a placeholder LayerNorm after the build is refused in one line."""
import contextvars
import importlib

import fairseq
import pytest
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from torch import nn

from conftest import registrations_restored
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.fairseq_patches import source_digest
from fairseq_normplug.models import norm_factory, transformer_normplug
from fairseq_normplug.models.norm_factory import NormFactory
from fairseq_normplug.models.norm_placement import PLACEHOLDER_CLASSES
from fairseq_normplug.models.placements import Placement, new_norm, register_placement
from fairseq_normplug.models.placements.layers import PlacedDecoder, PlacedEncoder
from fairseq_normplug.models.transformer_normplug import REPLICATED_FAIRSEQ_BUILD
from fairseq_normplug.modules.norm_registry import FFN
from model_helpers import assert_same_model, build

TINY = "transformer_normplug_tiny"


def fairseq_function(dotted):
    """``module.Class.method`` of fairseq, as fairseq defines it."""
    module, owner, name = dotted.rsplit(".", 2)
    return getattr(getattr(importlib.import_module(module), owner), name)


def test_replicated_fairseq_build_is_unchanged():
    """fails when fairseq changes: a fairseq release whose build_model (either level) differs from
    the one TransformerNormplugModel.build_fairseq_model replicates; compare the replica with the
    new code, then record the new digests in REPLICATED_FAIRSEQ_BUILD."""
    assert fairseq.__version__ in REPLICATED_FAIRSEQ_BUILD, (
        f"fairseq {fairseq.__version__}: build_model not compared with the replica for this release "
        f"(compared: {', '.join(REPLICATED_FAIRSEQ_BUILD)})")
    recorded = REPLICATED_FAIRSEQ_BUILD[fairseq.__version__]
    assert {name: source_digest(fairseq_function(name)) for name in recorded} == recorded


SMALL = ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48", "--encoder-layers", "3",
         "--decoder-layers", "2", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


@pytest.mark.parametrize("flags", [
    [],
    ["--merge-src-tgt-embed"],
    ["--checkpoint-activations"],
    ["--offload-activations", "--share-decoder-input-output-embed"],
], ids=["plain", "merge-src-tgt-embed", "checkpoint-activations", "offload-activations"])
def test_the_replica_builds_what_fairseqs_build_model_builds(tiny_bin, flags):
    """Every branch of fairseq's build_model that the replica copies, flags off: the same model
    as fairseq's own ``transformer`` (parameters, module types, output)."""
    ours, task, _ = build(tiny_bin, "transformer_normplug", *SMALL, *flags, seed=3)
    stock, _, _ = build(tiny_bin, "transformer", *SMALL, *flags, seed=3)
    assert_same_model(ours, stock, task)
    assert built_settings(ours) == built_settings(stock)
    assert layer_wrapping(ours) == layer_wrapping(stock)
    if flags[:1] == ["--offload-activations"]:
        assert set(layer_wrapping(ours)) == {True}  # offloaded: every layer's forward checkpointed, to the CPU


def built_settings(model):
    """The settings fairseq's build_model decides on the model's TransformerConfig."""
    cfg = model.cfg
    return (cfg.checkpoint_activations, cfg.offload_activations, cfg.min_params_to_wrap,
            cfg.share_decoder_input_output_embed, cfg.encoder.layers, cfg.decoder.layers)


def layer_wrapping(model):
    """Per layer, fairseq's checkpoint_wrapper: None (not wrapped) or its offload_to_cpu."""
    return [layer.forward.args[1] if hasattr(layer, "precheckpoint_forward") else None
            for stack in (model.encoder, model.decoder) for layer in stack.layers]


def test_layers_to_keep_fails_as_in_fairseq(tiny_bin):
    """fairseq's parser makes ``--encoder-layers-to-keep`` a list, which its build_model then
    ``split``s: the stock model fails, and the replica fails the same way."""
    for arch in ("transformer", "transformer_normplug"):
        with pytest.raises(AttributeError, match="'list' object has no attribute 'split'"):
            build(tiny_bin, arch, *SMALL, "--encoder-layers-to-keep", "0,2")


def test_no_build_state_outside_the_call():
    assert not [name for name, value in vars(transformer_normplug).items()
                if isinstance(value, contextvars.ContextVar)]


def test_the_layer_plan_reaches_both_stacks(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--norm-placement", "sandwich")
    plan = model.normplug_config.settings.layer_plan
    assert type(model.encoder) is PlacedEncoder and type(model.decoder) is PlacedDecoder
    assert model.encoder.layer_plan is plan and model.decoder.layer_plan is plan


def test_flags_off_builds_fairseqs_own_stacks(tiny_bin):
    model, _, _ = build(tiny_bin, TINY)
    assert type(model.encoder) is TransformerEncoderBase and type(model.decoder) is TransformerDecoderBase


class LateSlot(Placement):
    """A faulty design: it lists the slot ``late_norm`` but fills it only in ``finish_model``,
    after its layer was built, so the slot keeps its placeholder LayerNorm."""

    stock_forward = True
    norm_slots = (("late_norm", FFN, "late"),)

    def finish_model(self, model):
        layer = model.decoder.layers[1]
        layer.late_norm = new_norm(layer.embed_dim, FFN)


@pytest.fixture
def late_slot():
    with registrations_restored():
        register_placement("late-slot")(LateSlot)
        yield


def test_a_design_that_leaves_a_placeholder_is_refused_in_one_line(tiny_bin, late_slot):
    with pytest.raises(NormplugError) as refused:
        build(tiny_bin, TINY, "--norm-placement", "late-slot", "--rmsnorm")
    message = str(refused.value)
    assert "\n" not in message
    assert "placeholder LayerNorm at decoder.layers.1.late_norm (dec1.late)" in message
    assert "norm type rmsnorm" in message


def test_a_slot_the_norm_factory_skipped_is_refused_in_one_line(tiny_bin, monkeypatch):
    """The norm factory leaving fairseq's own encoder FFN norm of layer 0 as built."""
    fill = NormFactory.fill

    def skipping_one_slot(self, owner, attr, name, role, feeds_output):
        if name != "enc0.ffn":
            fill(self, owner, attr, name, role, feeds_output)

    monkeypatch.setattr(NormFactory, "fill", skipping_one_slot)
    with pytest.raises(NormplugError, match=r"^the built model still holds a placeholder LayerNorm at "
                                            r"encoder\.layers\.0\.final_layer_norm \(enc0\.ffn\)[^\n]*$"):
        build(tiny_bin, TINY, "--scalenorm")


def test_fairseqs_layernorm_is_no_placeholder_where_layernorm_is_asked(tiny_bin):
    """The LayerNorms a slot is built with are the norms themselves with the layernorm type,
    everywhere or at the sites --norm-types-per-layer gives it."""
    model, _, _ = build(tiny_bin, TINY)
    assert type(model.encoder.layers[0].final_layer_norm) in PLACEHOLDER_CLASSES
    model, _, _ = build(tiny_bin, TINY, "--rmsnorm", "--norm-types-per-layer", "enc.0.ffn=layernorm")
    assert type(model.encoder.layers[0].final_layer_norm) in PLACEHOLDER_CLASSES
    assert type(model.encoder.layers[1].final_layer_norm) not in PLACEHOLDER_CLASSES


def test_a_norm_type_that_builds_a_plain_layernorm_is_no_placeholder(tiny_bin, monkeypatch):
    """A norm the norm factory built is never refused, whatever its class (an extension's norm
    type may build torch's LayerNorm)."""
    monkeypatch.setattr(norm_factory, "build_norm", lambda site, dim, slot: nn.LayerNorm(dim))
    model, _, _ = build(tiny_bin, TINY, "--rmsnorm")
    assert type(model.decoder.layers[1].final_layer_norm) is nn.LayerNorm
