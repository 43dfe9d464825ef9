"""Every numeric flag of the plugin is a finite number in its declared range (issue 53): ``inf``,
``-inf`` and ``nan`` are refused in one line naming the flag, the value and the range, as
fairseq-train parses the flags (in-process ``options.parse_args_and_arch``), for the built-in
designs, the lr schedulers and a researcher's extension declared with the public
``number_flag``; a hand-made Namespace is checked when the flags are resolved."""
import argparse
import os
import textwrap

import pytest

from fairseq_normplug import number_flag
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.normplug_args import add_normplug_args, resolve_normplug_args
from fairseq_normplug.models.normplug_config import flag_actions
from fairseq_normplug.modules.norm_registry import NORM_TYPES, NormType, norm_args
from fairseq_normplug.numeric_flags import check_number_flags
from model_helpers import parse_args

TINY = "transformer_normplug_tiny"
LR = ["--optimizer", "adam", "--lr", "1e-3"]

NOT_FINITE = [
    (["--norm-eps", "inf"], "--norm-eps must be a finite number > 0, got inf"),
    (["--scalenorm", "--norm-eps", "nan"], "--norm-eps must be a finite number > 0, got nan"),
    (["--dyt", "--dyt-alpha-init", "inf"], "--dyt-alpha-init must be a finite number > 0, got inf (or pass auto)"),
    (["--dyt", "--dyt-attn-alpha-init", "inf"], "--dyt-attn-alpha-init must be a finite number > 0, got inf"),
    (["--norm-type", "derf", "--derf-alpha-init", "inf"], "--derf-alpha-init must be a finite number > 0, got inf"),
    (["--norm-type", "dyisru", "--dyisru-beta-init", "inf"], "--dyisru-beta-init must be a finite number > 0"),
    (["--qknorm", "--qknorm-g0", "inf"], "--qknorm-g0 must be a finite number > 0, got inf"),
    (["--norm-weight-decay", "inf"], "--norm-weight-decay must be a finite number >= 0, got inf"),
    (["--norm-placement", "mix", "--mix-ln-ratio=-inf"],
     "--mix-ln-ratio must be a finite number in [0, 1] (the share of PostNorm layers), got -inf"),
    ([*LR, "--lr-scheduler", "inv_sqrt_decay", "--stop-lr", "inf"], "--stop-lr must be a finite number >= 0, got inf"),
    ([*LR, "--lr-scheduler", "val_decay", "--stop-lr", "inf"], "--stop-lr must be a finite number >= 0, got inf"),
]


@pytest.mark.parametrize("flags,message", NOT_FINITE, ids=[" ".join(f) for f, _ in NOT_FINITE])
def test_a_value_that_is_not_finite_is_one_line_at_argument_time(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


OUT_OF_RANGE = [
    (["--norm-eps", "0"], "--norm-eps must be > 0, got 0.0"),
    (["--norm-stats-interval", "-1"], "--norm-stats-interval must be >= 0, got -1"),
    (["--norm-placement", "hyper-connections", "--hc-streams", "0"],
     "--hc-streams must be >= 1 (the number of residual streams; the papers use 4), got 0"),
    (["--norm-type", "seednorm", "--seednorm-heads", "0"], "--seednorm-heads must be >= 1, got 0"),
]


@pytest.mark.parametrize("flags,message", OUT_OF_RANGE, ids=[" ".join(f) for f, _ in OUT_OF_RANGE])
def test_a_value_out_of_the_declared_range_names_the_range(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_auto_and_finite_values_in_range_pass(tiny_bin):
    args = parse_args(tiny_bin, TINY, "--dyt", "--dyt-alpha-init", "auto", "--dyt-attn-alpha-init", "0.3",
                      "--norm-eps", "1e-6", "--norm-weight-decay", "0")
    assert (args.dyt_alpha_init, args.dyt_attn_alpha_init, args.norm_eps, args.norm_weight_decay) == \
        ("auto", 0.3, 1e-6, 0.0)


def test_a_hand_made_namespace_is_checked_when_resolved():
    with pytest.raises(NormplugError, match=r"^--dyt-alpha-init must be a finite number > 0, got inf"):
        norm_args("dyt", dyt_alpha_init=float("inf"))
    with pytest.raises(NormplugError, match=r"^--norm-eps must be a finite number > 0, got inf$"):
        resolve_normplug_args(argparse.Namespace(norm_eps=float("inf")))


def test_an_extensions_flags_get_the_same_check(tiny_bin, tmp_path):
    """A researcher's norm: its flag declared with the public ``number_flag`` is refused out of
    range or not finite; one declared with a plain ``type=float`` is refused when not finite."""
    name = f"range_norm_{os.getpid()}"
    extension = tmp_path / f"{name}.py"
    extension.write_text(textwrap.dedent(f"""
        from fairseq_normplug import FormulaNorm, number_flag, register_norm

        @register_norm("{name}")
        class RangeNorm(FormulaNorm):
            \"\"\"y = x / max(|x|, floor) * p (a test norm).\"\"\"

            @staticmethod
            def add_args(parser):
                parser.add_argument("--range-norm-p", **number_flag(above=0, at_most=4))
                parser.add_argument("--range-norm-floor", type=float)

            def __init__(self, dim, args):
                super().__init__(dim)

            def formula(self, x, weight):
                return x
    """))
    base = ["--normplug-modules", str(extension), "--norm-type", name]
    for value, message in [("inf", "--range-norm-p must be a finite number in (0, 4], got inf"),
                           ("nan", "--range-norm-p must be a finite number in (0, 4], got nan"),
                           ("5", "--range-norm-p must be in (0, 4], got 5.0")]:
        with pytest.raises(NormplugError) as error:
            parse_args(tiny_bin, TINY, *base, "--range-norm-p", value)
        assert str(error.value) == message
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *base, "--range-norm-floor=-inf")
    assert str(error.value) == "--range-norm-floor must be a finite number, got -inf"
    args = parse_args(tiny_bin, TINY, *base, "--range-norm-p", "4", "--range-norm-floor", "1e-3")
    assert (args.range_norm_p, args.range_norm_floor) == (4.0, 1e-3)


def test_check_number_flags_reads_the_declared_ranges():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ratio", **number_flag(at_least=0, below=1))
    parser.add_argument("--count", **number_flag(int, at_least=1))
    check_number_flags(argparse.Namespace(ratio=0.0, count=None), parser._actions)
    with pytest.raises(NormplugError, match=r"^--ratio must be in \[0, 1\), got 1$"):
        check_number_flags(argparse.Namespace(ratio=1, count=3), parser._actions)
    with pytest.raises(NormplugError, match=r"^--count must be >= 1, got 0$"):
        parser.parse_args(["--count", "0"])


def test_a_hydra_model_config_value_gets_the_same_check():
    from omegaconf import OmegaConf
    from fairseq_normplug.models.normplug_config import check_hydra_model_config

    cfg = OmegaConf.create({"model": {"_name": TINY, "norm_type": "dyt", "dyt_alpha_init": float("inf")}})
    with pytest.raises(NormplugError) as error:
        check_hydra_model_config(cfg)
    assert str(error.value) == "--dyt-alpha-init must be a finite number > 0, got inf (or pass auto)"


def test_a_norm_registered_after_the_flags_were_read_gets_its_range_checked(monkeypatch):
    """The plugin's flag actions are read once per set of registered norm types and designs
    (``normplug_config.flag_actions``, asked eight times a model build): a norm type registered
    later is in them, so a hand-made Namespace's value of its flag is checked at resolve time."""
    class LateNorm:
        @staticmethod
        def add_args(parser):
            parser.add_argument("--late-norm-p", **number_flag(above=0, at_most=4))

    first = flag_actions(add_normplug_args)
    assert flag_actions(add_normplug_args) is first and "late_norm_p" not in first
    resolve_normplug_args(argparse.Namespace(late_norm_p=9.0))  # not a flag yet: not checked
    monkeypatch.setitem(NORM_TYPES, "late-norm", NormType("late-norm", LateNorm, False, False))
    assert "late_norm_p" in flag_actions(add_normplug_args)
    with pytest.raises(NormplugError, match=r"^--late-norm-p must be in \(0, 4\], got 9.0$"):
        resolve_normplug_args(argparse.Namespace(late_norm_p=9.0))
