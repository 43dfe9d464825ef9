"""Checkpoints written by older code load and decode identically (issue 56).

Each fixture of ``tests/fixtures/checkpoints/`` (made by its ``make_fixtures.py``, only rerun
on purpose) is loaded through fairseq's own ``checkpoint_utils.load_model_ensemble_and_task``,
as fairseq-generate and the hub load a checkpoint, and must give the log-probabilities and
the greedy and beam-2 decodes it gave when it was saved.
"""
import dataclasses
import importlib.util
import json
import os
import tempfile
import textwrap
from argparse import Namespace

import pytest
import torch
from fairseq import checkpoint_utils, utils

from conftest import REPO
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.resolved_config import built_config, resolve

FIXTURE_DIR = os.path.join(REPO, "tests", "fixtures", "checkpoints")
_spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURE_DIR, "make_fixtures.py"))
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)

#: log-probabilities and scores agree within this (a fraction of their scale, at least 1):
#: float32 kernels sum in a different order on another CPU (the fixtures' log-probabilities
#: differed by up to 1.9e-6 on an AMD EPYC with AVX2 only, Dec 7), while a changed model moves
#: them by far more
TOLERANCE = 1e-5


def load_fixture(name):
    """(model, task, recorded outputs) of fixture ``name``, the model loaded as fairseq loads it
    (from the .pt file its text form writes back)."""
    utils.import_user_module(Namespace(user_dir=os.path.join(REPO, "fairseq_normplug")))
    with tempfile.TemporaryDirectory() as folder:
        path = make_fixtures.text_to_checkpoint(os.path.join(FIXTURE_DIR, name + ".checkpoint.json"),
                                                os.path.join(folder, name + ".pt"))
        (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides={"data": FIXTURE_DIR, "source_lang": "src", "target_lang": "tgt"})
    with open(os.path.join(FIXTURE_DIR, name + ".json")) as f:
        return model, task, json.load(f)


def assert_close(actual, expected, what):
    actual, expected = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, what
    worst = ((actual - expected).abs() / expected.abs().clamp(min=1.0)).max().item()
    assert worst <= TOLERANCE, f"{what}: differs by {worst:.3g} of its scale"


def test_every_fixture_is_there():
    for name in make_fixtures.FIXTURES:
        for suffix in (".checkpoint.json", ".json"):
            assert os.path.isfile(os.path.join(FIXTURE_DIR, name + suffix)), name + suffix
    for lang in ("src", "tgt"):
        assert os.path.isfile(os.path.join(FIXTURE_DIR, f"dict.{lang}.txt"))


@pytest.mark.parametrize("name", list(make_fixtures.FIXTURES))
def test_fixture_loads_and_decodes_as_when_saved(name):
    model, task, recorded = load_fixture(name)
    assert recorded["flags"] == make_fixtures.FIXTURES[name]
    batch = [torch.tensor(recorded["batch"][key])
             for key in ("src_tokens", "src_lengths", "prev_output_tokens")]
    now = make_fixtures.outputs(task, model, batch)
    assert_close(now["log_probs"], recorded["log_probs"], f"{name} log-probabilities")
    assert set(now["decodes"]) == set(recorded["decodes"]) == {str(beam) for beam in make_fixtures.BEAMS}
    for beam, hypotheses in recorded["decodes"].items():
        assert [h["tokens"] for h in now["decodes"][beam]] == [h["tokens"] for h in hypotheses], \
            f"{name} beam {beam}"
        for i, (ours, theirs) in enumerate(zip(now["decodes"][beam], hypotheses)):
            assert_close(ours["positional_scores"], theirs["positional_scores"], f"{name} beam {beam} sentence {i}")


#: what each fixture's loaded model says it was built from (models/resolved_config.py)
RESOLVED = {
    "stock_postnorm": ("layernorm", "post", (), False, "fairseq"),
    "tears_prenorm_fixnorm_scalenorm_smallinit": ("scalenorm", "pre", (), True, "smallinit"),
    "prenorm_dyt": ("dyt", "pre", (), False, "fairseq"),
    "b2t": ("layernorm", "b2t", (), False, "fairseq"),
    "hyper_connections_2": ("layernorm", "hyper-connections", (), False, "fairseq"),
    "prenorm_gated_attention": ("layernorm", "pre", ("gated-attention",), False, "fairseq"),
}


@pytest.mark.parametrize("name", list(RESOLVED))
def test_a_loaded_model_carries_the_configuration_it_was_built_from(name):
    model, _, _ = load_fixture(name)
    config = built_config(model)
    assert (config.norm_type, config.placement, config.modifiers, config.fixnorm, config.weight_init) == RESOLVED[name]
    assert config.extension_modules == () and config.norm_types_per_layer is None
    assert config.placement_design is config.settings.layer_plan.placement
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.norm_type = "rmsnorm"


def test_resolve_refuses_in_one_line_and_records_extensions(tmp_path):
    with pytest.raises(NormplugError, match="--prenorm contradicts --postnorm"):
        resolve(Namespace(prenorm=True, postnorm=True))
    name = f"resolved_norm_{os.getpid()}"  # its own name: no other test can have loaded it
    extension = tmp_path / f"{name}.py"
    extension.write_text(textwrap.dedent(f"""
        from fairseq_normplug import FormulaNorm, register_norm

        @register_norm("{name}")
        class ResolvedNorm(FormulaNorm):
            \"\"\"y = x (a test norm).\"\"\"

            def __init__(self, dim, args):
                super().__init__(dim)

            def formula(self, x, weight):
                return x
    """))
    config = resolve(Namespace(normplug_modules=str(extension), norm_type=name))
    assert config.norm_type == name and config.extension_modules == (str(extension),)
    assert (config.placement, config.modifiers, config.qknorm, config.residual_scale) == ("post", (), False, "none")
    assert built_config(torch.nn.Linear(1, 1)) is None
