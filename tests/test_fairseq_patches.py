"""fairseq_normplug.fairseq_patches: the three wrapped fairseq functions are still the ones the
wrappers were written for, the wrappers are in place after plugin import (once), a
pass-through without tags, and restorable; the param groups the optimizer wrapper builds."""
import fairseq
import fairseq.optim
import fairseq_cli.train as train_module
import pytest
import torch

import fairseq_normplug  # noqa: F401  (applies the wrappers)
from fairseq_normplug import fairseq_patches
from fairseq_normplug.fairseq_patches import PATCHES, param_groups, set_param_group


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target for p in PATCHES])
def test_wrapped_fairseq_functions_are_unchanged(patch):
    """A fairseq release whose wrapped function (or the caller the wrapper relies on) differs
    from the one recorded fails here: check the wrapper against the new code, then record it."""
    assert fairseq.__version__ in patch.digests, (
        f"fairseq {fairseq.__version__}: {patch.target} not checked for this release "
        f"(checked: {', '.join(patch.digests)})")
    recorded = dict(zip((patch.target, patch.caller), patch.digests[fairseq.__version__]))
    found = {name: fairseq_patches.source_digest(fairseq_patches.resolve(name)) for name in recorded}
    assert found == recorded


def test_installed_once_and_restored():
    fairseq_patches.install()  # the train module may have been imported after the plugin
    wrapped = (fairseq.optim._build_optimizer, train_module.should_stop_early)
    assert fairseq_patches.installed() == {"fairseq.optim._build_optimizer": True,
                                           "fairseq.checkpoint_utils.load_checkpoint_to_cpu": True,
                                           "fairseq_cli.train.should_stop_early": True}
    fairseq_patches.install()
    assert (fairseq.optim._build_optimizer, train_module.should_stop_early) == wrapped  # idempotent
    try:
        fairseq_patches.uninstall()
        assert set(fairseq_patches.installed().values()) == {False}
        assert fairseq.optim._build_optimizer is wrapped[0].__wrapped__
        assert train_module.should_stop_early is wrapped[1].__wrapped__
    finally:
        fairseq_patches.install()
    assert set(fairseq_patches.installed().values()) == {True}


def test_param_groups_keep_order_and_pass_untagged_lists_through():
    a, b, c, d, e = (torch.nn.Parameter(torch.ones(k + 1)) for k in range(5))
    assert param_groups([a, b]) == [a, b] and param_groups([]) == []
    groups = [{"params": [a]}]
    assert param_groups(groups) == groups
    set_param_group(b, weight_decay=0.0)
    d.optim_overrides = {"optimizer": {"lr_scale": 2}}  # fairseq's composite keys are kept
    set_param_group(d, weight_decay=0.0)
    set_param_group(e, weight_decay=0.5)
    assert d.optim_overrides["optimizer"] == {"lr_scale": 2}
    split = param_groups([b, a, c, d, e])
    assert [[id(p) for p in g["params"]] for g in split] == [[id(a), id(c)], [id(b), id(d)], [id(e)]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in split] == [
        {}, {"weight_decay": 0.0}, {"weight_decay": 0.5}]
    assert [len(g["params"]) for g in param_groups([b, d])] == [2]  # no empty untagged group


def test_optimizer_built_through_fairseq_gets_the_groups():
    """fairseq.optim.build_optimizer (the trainer's fp32 path) reaches the wrapper."""
    from omegaconf import OmegaConf

    weights, gain = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1))
    set_param_group(gain, weight_decay=0.0)
    cfg = OmegaConf.create({"_name": "sgd", "lr": [0.1], "momentum": 0.0, "weight_decay": 0.1})
    optimizer = fairseq.optim.build_optimizer(cfg, [weights, gain])
    assert [(g["weight_decay"], [id(p) for p in g["params"]]) for g in optimizer.param_groups] == [
        (0.1, [id(weights)]), (0.0, [id(gain)])]
