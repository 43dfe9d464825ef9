"""How the plugin's model is built (fairseq_normplug/models/transformer_normplug.py): fairseq's
``build_model`` replicated with the layer plan passed explicitly to ``build_encoder`` /
``build_decoder`` (no build state outside the call), and the replica still fairseq's code."""
import contextvars
import importlib

import fairseq
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase

from fairseq_normplug.fairseq_patches import source_digest
from fairseq_normplug.models import transformer_normplug
from fairseq_normplug.models.placements.layers import PlacedDecoder, PlacedEncoder
from fairseq_normplug.models.transformer_normplug import REPLICATED_FAIRSEQ_BUILD
from model_helpers import build

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
