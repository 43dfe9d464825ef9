"""Issue 59's ``--norm-types-per-layer SPEC`` (models/norm_types_per_layer.py, built per slot by
the norm factory, models/norm_factory.py): built through fairseq's parser on the tiny preset, each norm of the type
(and scale init) the spec names, finite, incremental decoding equal to the full forward, every
parameter trained, every placement, recorded in the checkpoint and in the tables' labels, and a
malformed SPEC refused in one line naming the bad part, before any data is read."""
import argparse
import os
import shutil

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.tables import config_string, row_configuration
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.norm_types_per_layer import parse_norm_types_per_layer
from fairseq_normplug.models.placements import PLACEMENTS
from fairseq_normplug.modules.norm_registry import NORM_TYPES, norm_type_of
from model_helpers import (assert_every_parameter_trains, assert_incremental_equals_full, build,
                           incremental_and_full, one_backward, parse_args, randomized, toy_batch)

TINY = "transformer_normplug_tiny"
LAYERS = ("--encoder-layers", "4", "--decoder-layers", "3")


def types(model):
    return {name: norm_type_of(norm) for name, norm in named_norms(model).items()}


def test_the_issue_example_builds_the_types_it_names(tiny_bin):
    spec = "enc.0-1=layernorm,enc.2-3=dyt,dec.*=rmsnorm"
    model, task, args = build(tiny_bin, TINY, "--prenorm", *LAYERS, "--norm-types-per-layer", spec)
    assert args.norm_types_per_layer == spec
    found = types(model)
    for index in range(4):
        for site in ("attn", "ffn"):
            assert found[f"enc{index}.{site}"] == ("layernorm" if index < 2 else "dyt")
    for index in range(3):
        for site in ("attn", "cross", "ffn"):
            assert found[f"dec{index}.{site}"] == "rmsnorm"
    # the stacks' final norms are not layers: --norm-type's (layernorm), unless named
    assert found["enc.final"] == found["dec.final"] == "layernorm"
    assert type(model.encoder.layers[0].self_attn_layer_norm) is torch.nn.LayerNorm  # fairseq's own, kept
    assert_incremental_equals_full(model, task)
    assert_every_parameter_trains(model, task)


def test_sites_stack_norms_later_entries_and_the_default_type(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--norm-type", "rmsnorm", "--layernorm-embedding",
                        "--norm-types-per-layer",
                        "enc.*=dyt,enc.1=layernorm,dec.0-1.cross=scalenorm,dec.final=dyisru,enc.embed=derf")
    found = types(model)
    assert found["enc0.attn"] == found["enc0.ffn"] == "dyt"
    assert found["enc1.attn"] == found["enc1.ffn"] == "layernorm"  # the later entry wins
    assert found["dec0.cross"] == found["dec1.cross"] == "scalenorm"
    assert found["dec0.attn"] == found["dec1.ffn"] == "rmsnorm"  # --norm-type where the spec names nothing
    assert found["dec.final"] == "dyisru" and found["enc.final"] == "rmsnorm"
    assert found["enc.embed"] == "derf" and found["dec.embed"] == "rmsnorm"


def test_per_site_scale_inits(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--norm-type", "dyt", "--dyt-alpha-init", "0.3",
                        "--norm-types-per-layer",
                        "dec.*.attn=dyt:0.8,enc.0=derf:1.5,dec.*.ffn=dyisru:7,enc.1.ffn=dyt:auto")
    norms = named_norms(model)
    assert all(norms[f"dec{i}.attn"].alpha.item() == pytest.approx(0.8) for i in range(2))
    assert norms["dec0.cross"].alpha.item() == pytest.approx(0.3)  # --dyt-alpha-init where no init is named
    assert norms["enc0.attn"].alpha.item() == pytest.approx(1.5) and norm_type_of(norms["enc0.attn"]) == "derf"
    assert norms["dec0.ffn"].beta.item() == pytest.approx(7.0)
    assert getattr(norms["enc1.ffn"], "auto_init", False) and not getattr(norms["enc1.attn"], "auto_init", False)


def test_a_type_named_only_in_the_spec_takes_its_own_flags(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--dyt-squash", "hardtanh", "--taper-updates", "1", "2",
                        "--norm-types-per-layer", "enc.*=dyt,dec.0=tapernorm")
    found = types(model)
    assert found["enc0.attn"] == "dyt" and found["dec0.ffn"] == "tapernorm" and found["dec1.ffn"] == "layernorm"
    assert named_norms(model)["enc0.attn"].squash == "hardtanh"
    # ... and without the type anywhere its flag is still refused
    with pytest.raises(NormplugError, match="--dyt-squash needs --norm-type dyt"):
        parse_args(tiny_bin, TINY, "--dyt-squash", "hardtanh", "--norm-types-per-layer", "enc.*=rmsnorm")


def test_only_layernorm_named_is_the_plain_model(tiny_bin):
    plain, task, _ = build(tiny_bin, TINY, "--prenorm", seed=3)
    spec, _, _ = build(tiny_bin, TINY, "--prenorm", "--norm-types-per-layer", "enc.*=layernorm,dec.1=layernorm", seed=3)
    src, lengths, prev = toy_batch(task)
    plain.eval(), spec.eval()
    with torch.no_grad():
        assert torch.equal(plain(src, lengths, prev)[0], spec(src, lengths, prev)[0])


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_works_with_every_placement(tiny_bin, placement):
    model, task, _ = build(tiny_bin, TINY, "--norm-placement", placement, "--norm-types-per-layer",
                           "enc.0=dyt,enc.1=rmsnorm,dec.0=scalenorm,dec.1=dyt")
    found = types(model)
    assert {found[name] for name in found if name.startswith("enc0.")} == {"dyt"}
    assert {found[name] for name in found if name.startswith("dec0.")} == {"scalenorm"}
    assert_incremental_equals_full(model, task)
    assert_every_parameter_trains(model, task)


@pytest.mark.parametrize("norm_type", [name for name in NORM_TYPES if name != "tapernorm"])
def test_every_norm_type_in_a_layer(tiny_bin, norm_type):
    model, task, _ = build(tiny_bin, TINY, "--prenorm", "--norm-types-per-layer",
                           f"enc.1={norm_type},dec.0={norm_type}")
    found = types(model)
    assert found["enc1.ffn"] == found["dec0.cross"] == norm_type and found["enc0.ffn"] == "layernorm"
    assert_incremental_equals_full(model, task)
    grads = one_backward(model, task)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())


def test_placement_sites(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--norm-placement", "sandwich", "--norm-types-per-layer",
                        "enc.*.attn_out=dyt,dec.1.ffn_out=rmsnorm")
    found = types(model)
    assert found["enc0.attn_out"] == found["enc1.attn_out"] == "dyt" and found["enc0.attn"] == "layernorm"
    assert found["dec1.ffn_out"] == "rmsnorm" and found["dec0.ffn_out"] == "layernorm"


def test_checkpoint_activations_and_bf16(tiny_bin):
    flags = ("--prenorm", "--norm-types-per-layer", "enc.0=dyt,dec.*=rmsnorm,dec.1.cross=seednorm")
    plain, task, _ = build(tiny_bin, TINY, *flags, seed=7)
    expected = one_backward(plain, task)
    wrapped, _, _ = build(tiny_bin, TINY, *flags, "--checkpoint-activations", seed=7)
    grads = one_backward(wrapped, task)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-6), name
    randomized(plain).eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        full = plain(src, lengths, prev)[0]
        half = plain.to(torch.bfloat16)(src, lengths, prev)[0]
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    assert (half.float() - full).abs().max().item() < 0.05 * max(1.0, full.abs().max().item())


def test_recorded_in_the_checkpoint_config_and_in_the_tables_labels(tiny_bin):
    spec = "enc.0-1=layernorm,dec.*=dyt:0.7"
    args = parse_args(tiny_bin, TINY, "--prenorm", "--norm-types-per-layer", spec)
    stored = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    assert stored["model"].norm_types_per_layer == spec
    configuration = row_configuration(config_string(["--prenorm", "--norm-types-per-layer", spec], "inv_sqrt"))
    assert configuration["norm"] == f"layernorm+per-layer({spec})"
    other = row_configuration(config_string(["--prenorm", "--dyt", "--norm-types-per-layer", "enc.0=rmsnorm"], "x"))
    assert other["norm"] == "dyt+per-layer(enc.0=rmsnorm)"
    assert row_configuration(config_string(["--prenorm"], "inv_sqrt"))["norm"] == "layernorm"


def test_a_checkpoint_reloads_into_the_same_types_and_output(tiny_bin, tmp_path):
    model, task, args = build(tiny_bin, TINY, "--prenorm", "--norm-types-per-layer", "enc.1=dyt:0.9,dec.*.ffn=rmsnorm")
    randomized(model).eval()
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(tiny_bin):
        if name.startswith("dict"):
            shutil.copy(os.path.join(tiny_bin, name), bare / name)
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True),
                "model": model.state_dict(), "args": None, "extra_state": {},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {}, "num_updates": 1}]}, path)
    (reloaded,), _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": str(bare), "source_lang": "src", "target_lang": "tgt"})
    reloaded.eval()
    assert types(reloaded) == types(model) and types(model)["enc1.attn"] == "dyt"
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        assert torch.equal(model(src, lengths, prev)[0], reloaded(src, lengths, prev)[0])


BAD = [
    ("", "--norm-types-per-layer is empty"),
    ("enc.0=dyt,,dec.0=dyt", "has an empty entry"),
    ("enc.0", "entry 'enc.0': expected STACK.LAYERS[.SITE]=TYPE[:INIT]"),
    ("mid.0=dyt", "entry 'mid.0=dyt': unknown stack 'mid'; choose enc or dec"),
    ("enc=dyt", "entry 'enc=dyt': the selector 'enc' must be STACK.LAYERS"),
    ("enc.1-x=dyt", "entry 'enc.1-x=dyt': bad layer range '1-x'"),
    ("enc.3-1=dyt", "entry 'enc.3-1=dyt': bad layer range '3-1': 3 > 1"),
    ("enc.2=dyt", "entry 'enc.2=dyt': layer 2 is out of range: the encoder has layers 0-1 (--encoder-layers 2)"),
    ("dec.1-5=dyt", "entry 'dec.1-5=dyt': layer 5 is out of range: the decoder has layers 0-1"),
    ("enc.0=dyn", "entry 'enc.0=dyn': unknown norm type 'dyn'; choose from " + ", ".join(NORM_TYPES)),
    ("enc.0.cross=dyt", "entry 'enc.0.cross=dyt': unknown site 'cross' for encoder layers with --norm-placement "
                        "pre; choose from attn, ffn"),
    ("enc.final.attn=dyt", "entry 'enc.final.attn=dyt': enc.final is one norm of the stack; it takes no site"),
    ("enc.0=layernorm:0.5", "entry 'enc.0=layernorm:0.5': norm type layernorm has no scale init"),
    ("enc.0=dyt:-1", "entry 'enc.0=dyt:-1': the scale init must be > 0"),
    ("enc.0=dyt:nan", "entry 'enc.0=dyt:nan': the scale init must be a finite number"),
    ("enc.0=tapernorm", "entry 'enc.0=tapernorm': --norm-type tapernorm needs --taper-updates"),
]


@pytest.mark.parametrize("spec,message", BAD, ids=[spec or "empty" for spec, _ in BAD])
def test_a_malformed_spec_is_one_line_naming_the_bad_part(tiny_bin, spec, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, "--prenorm", "--norm-types-per-layer", spec)
    assert message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags,spec,message", [
    (["--ngpt"], "enc.0=dyt", "--norm-types-per-layer cannot be combined with --ngpt"),
    (["--norm-type", "identity", "--weight-init", "tfixup"], "enc.0=dyt",
     "entry 'enc.0=dyt': --weight-init tfixup is for models without norms"),
    (["--residual-scale", "deepnorm"], "enc.0=identity",
     "entry 'enc.0=identity': --residual-scale deepnorm needs a norm after each residual"),
    (["--zero-centered-gamma"], "enc.0=scalenorm",
     "entry 'enc.0=scalenorm': --zero-centered-gamma cannot be used with --norm-type scalenorm"),
])
def test_designs_that_constrain_the_norm_type_refuse_in_one_line(tiny_bin, flags, spec, message):
    task = "translation_normplug" if "--ngpt" in flags else "translation"
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags, "--norm-types-per-layer", spec, task=task)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_spec_selecting_no_norm_of_the_built_model_is_refused(tiny_bin):
    """HybridNorm removes fairseq's attention norms: enc.0.attn names a site it has not."""
    with pytest.raises(NormplugError) as error:
        build(tiny_bin, TINY, "--norm-placement", "hybrid", "--norm-types-per-layer", "enc.0.attn=dyt")
    assert "entry 'enc.0.attn=dyt' selects no norm of this model" in str(error.value)
    assert "\n" not in str(error.value)


def test_refused_when_args_are_resolved_before_data_is_read(tmp_path):
    """The refusal comes from the argument parsing (the architecture's resolve), with a data
    directory that does not exist."""
    with pytest.raises(NormplugError, match="unknown stack 'x'"):
        parse_args(str(tmp_path / "no-data"), TINY, "--norm-types-per-layer", "x.0=dyt")


def test_parse_gives_the_entries():
    (first, second) = parse_norm_types_per_layer("enc.0-2.attn=dyt:0.5, dec.final=rmsnorm")
    assert (first.stack, first.layers, first.site, first.norm_type, first.scale_init) == ("enc", (0, 2), "attn",
                                                                                          "dyt", 0.5)
    assert first.selects("enc2.attn") and not first.selects("enc3.attn") and not first.selects("enc0.ffn")
    assert (second.stack_site, second.layers) == ("final", None) and second.selects("dec.final")
    assert not second.selects("enc.final") and parse_norm_types_per_layer(None) == ()


def test_the_flag_is_in_the_help():
    from fairseq_normplug.models.normplug_args import add_normplug_args

    parser = argparse.ArgumentParser()
    add_normplug_args(parser)
    (action,) = [a for a in parser._actions if "--norm-types-per-layer" in a.option_strings]
    assert "enc.0-1=layernorm,enc.2-5=dyt,dec.*=rmsnorm" in action.help
