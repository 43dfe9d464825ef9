"""Every fairseq door reads the model's settings strictly: an in-process
``options.parse_args_and_arch(input_args=[..., "--normplug-modules", ...])`` loads the extension
it names, and a hydra ``cfg.model`` with a misspelt key is refused in one line by the model's
own ``build_model``, through plain ``fairseq-hydra-train`` with ``common.user_dir`` too."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from fairseq import options, tasks
from omegaconf import OmegaConf

from conftest import REPO, cli
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.transformer_normplug import TransformerNormplugModel

PLUGIN = os.path.join(REPO, "fairseq_normplug")


def write_dictionaries(folder) -> str:
    words = "\n".join(f"w{i} 1" for i in range(20)) + "\n"
    for lang in ("src", "tgt"):
        (folder / f"dict.{lang}.txt").write_text(words)
    return str(folder)


def test_parse_args_and_arch_loads_normplug_modules_from_input_args(tmp_path):
    # a module of its own name, so that no other test can have loaded it into this process
    name = f"door_norm_{os.getpid()}"
    extension = tmp_path / f"{name}.py"
    extension.write_text(textwrap.dedent(f"""
        from fairseq_normplug import FormulaNorm, register_norm

        @register_norm("{name}", per_channel_gain=True)
        class DoorNorm(FormulaNorm):
            \"\"\"y = g * x / max|x| (a test norm).\"\"\"

            @staticmethod
            def add_args(parser):
                parser.add_argument("--door-norm-floor", type=float, default=1e-6)

            def __init__(self, dim, args):
                super().__init__(dim)
                self.floor = args.door_norm_floor
                self.weight = self.new_gain()

            def formula(self, x, weight):
                return weight * x / x.abs().amax(-1, keepdim=True).clamp(min=self.floor)
    """))
    data = write_dictionaries(tmp_path)
    assert "--normplug-modules" not in sys.argv
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[
        data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "src",
        "--target-lang", "tgt", "--arch", "transformer_normplug_tiny", "--normplug-modules", str(extension),
        "--norm-type", name, "--door-norm-floor", "0.5", "--cpu"])
    assert args.norm_type == name and args.door_norm_floor == 0.5
    model = tasks.setup_task(args).build_model(args)
    norms = [module for module in model.modules() if type(module).__name__ == "DoorNorm"]
    assert norms and all(norm.floor == 0.5 for norm in norms)
    assert args.normplug_modules == str(extension)  # recorded for the checkpoint (absolute path)


def test_a_misspelt_hydra_model_key_is_refused_by_build_model(tmp_path):
    data = write_dictionaries(tmp_path)
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[
        data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "src",
        "--target-lang", "tgt", "--arch", "transformer_normplug_tiny", "--cpu"])
    task = tasks.setup_task(args)
    model_cfg = OmegaConf.create({"_name": "transformer_normplug_tiny", "prenrom": True})
    with pytest.raises(NormplugError, match=r"unknown model setting 'prenrom' .*did you mean 'prenorm'"):
        TransformerNormplugModel.build_model(model_cfg, task)
    # the same config without the typo builds PreNorm (fairseq's preset fills the rest)
    good = OmegaConf.create({"_name": "transformer_normplug_tiny", "prenorm": True})
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import open_dict
    with open_dict(good):
        ARCH_CONFIG_REGISTRY["transformer_normplug_tiny"](good)
    torch.manual_seed(1)
    model = TransformerNormplugModel.build_model(good, task)
    assert model.encoder.layers[0].normalize_before


@pytest.mark.slow
def test_plain_fairseq_hydra_train_with_user_dir_refuses_a_typo_in_one_line(tiny_bin, tmp_path):
    proc = subprocess.run(
        [cli("fairseq-hydra-train"), f"common.user_dir={PLUGIN}", "+task._name=translation_normplug",
         f"+task.data={tiny_bin}", "+model._name=transformer_normplug_tiny", "+model.prenrom=true",
         "common.cpu=true", "optimization.max_update=2", "dataset.max_tokens=500", "criterion=cross_entropy",
         "optimizer=adam", "lr_scheduler=fixed", f"checkpoint.save_dir={tmp_path}/checkpoints"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "fairseq-normplug: error: unknown model setting 'prenrom' for transformer_normplug_tiny (did you mean 'prenorm'?)")
    assert not list((tmp_path / "checkpoints").glob("*.pt"))  # nothing trained, nothing saved


def test_fairseq_train_flag_errors_are_one_line_naming_the_nearest_flag(tmp_path, capsys):
    data = write_dictionaries(tmp_path)
    base = [data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "src",
            "--target-lang", "tgt", "--arch", "transformer_normplug_tiny", "--cpu"]
    for extra, expected in [
        (["--prenrom"], "train.py: error: unrecognized arguments: --prenrom (--prenrom: did you mean --prenorm?)"),
        (["--norm-type", "foo"], "train.py: error: argument --norm-type: invalid choice: 'foo' (choose from "),
    ]:
        with pytest.raises(SystemExit) as stopped:
            options.parse_args_and_arch(options.get_training_parser(), input_args=base + extra)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "usage:" not in err, err[:500]
        assert err.split(": error: ", 1)[1].startswith(expected.split(": error: ", 1)[1]), err


def one_line_exit(parse, capsys) -> str:
    """The one stderr line of a refused parse (exit status 2, no usage dump)."""
    with pytest.raises(SystemExit) as stopped:
        parse()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err[:500]
    return err.strip()


def test_an_invalid_choice_is_one_line_naming_the_nearest_choice(tmp_path, capsys):
    data = write_dictionaries(tmp_path)
    base = [data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "src",
            "--target-lang", "tgt", "--arch", "transformer_normplug_tiny", "--cpu"]
    line = one_line_exit(lambda: options.parse_args_and_arch(
        options.get_training_parser(), input_args=base + ["--norm-placement", "sandwhich"]), capsys)
    assert line.split(": error: ", 1)[1].startswith("argument --norm-placement: invalid choice: 'sandwhich' (choose from ")
    assert "'sandwich'" in line.split("(choose from ", 1)[1] and line.endswith("(did you mean 'sandwich'?)"), line
    line = one_line_exit(lambda: options.parse_args_and_arch(
        options.get_training_parser(), input_args=base + ["--norm-type", "rmsnrom"]), capsys)
    assert line.endswith("(did you mean 'rmsnorm'?)"), line
    line = one_line_exit(lambda: options.parse_args_and_arch(  # nothing near: the choices, no guess
        options.get_training_parser(), input_args=base + ["--norm-type", "qqqq"]), capsys)
    assert "invalid choice: 'qqqq' (choose from " in line and "did you mean" not in line, line


@pytest.mark.parametrize("door", ["generate", "interactive"])
def test_generate_and_interactive_flag_errors_are_one_line(door, tmp_path, capsys):
    """fairseq-generate and fairseq-interactive add no model flags: the plugin's task makes their
    errors one line (an unknown flag, the task's own invalid choice with the nearest one)."""
    data = write_dictionaries(tmp_path)
    make_parser = {"generate": options.get_generation_parser,
                   "interactive": options.get_interactive_generation_parser}[door]
    base = [data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "src",
            "--target-lang", "tgt", "--path", str(tmp_path / "checkpoint.pt"), "--cpu"]
    line = one_line_exit(lambda: options.parse_args_and_arch(make_parser(), input_args=base + ["--gnmt-alpah", "0.6"]),
                         capsys)
    assert line.split(": error: ", 1)[1] == (
        "unrecognized arguments: --gnmt-alpah 0.6 (--gnmt-alpah: did you mean --gnmt-alpha?)"), line
    line = one_line_exit(lambda: options.parse_args_and_arch(
        make_parser(), input_args=base + ["--resume-batches", "uninterupted"]), capsys)
    assert line.split(": error: ", 1)[1] == (
        "argument --resume-batches: invalid choice: 'uninterupted' (choose from 'uninterrupted', 'fairseq') "
        "(did you mean 'uninterrupted'?)"), line
    assert options.parse_args_and_arch(make_parser(), input_args=base + ["--gnmt-alpha", "0.6"]).gnmt_alpha == 0.6


@pytest.mark.slow
def test_fairseq_generate_refuses_a_misspelt_flag_in_one_line(tmp_path):
    data = write_dictionaries(tmp_path)
    proc = subprocess.run(
        [cli("fairseq-generate"), data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang",
         "src", "--target-lang", "tgt", "--path", str(tmp_path / "checkpoint.pt"), "--cpu", "--resume-batches",
         "uninterupted"], cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fairseq-generate: error: argument --resume-batches: invalid choice: 'uninterupted' (choose from "
        "'uninterrupted', 'fairseq') (did you mean 'uninterrupted'?)"], proc.stderr[-2000:]


class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


@pytest.fixture
def bad_checkpoints(tmp_path):
    """A data folder, and in a checkpoint folder: ``evil.pt`` (whole, but unpickling it would run
    ``os.makedirs(marker)``) and ``cut.pt`` (the first half of a torch checkpoint)."""
    data = write_dictionaries(tmp_path)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"cfg": None, "model": {}, "payload": RunsCodeWhenUnpickled(str(marker))}, folder / "evil.pt")
    torch.save({"cfg": None, "model": {"w": torch.zeros(1000)}}, folder / "whole.pt")
    whole = (folder / "whole.pt").read_bytes()
    (folder / "cut.pt").write_bytes(whole[: len(whole) // 2])
    return data, folder, marker


def assert_one_line_refusal(error, path, marker):
    message = str(error)
    assert "\n" not in message and "weights_only" not in message, message
    assert message == (f"refused to load {path}: it holds os.makedirs (Unsupported global), which is not a tensor, "
                       f"a builtin container or a class of fairseq checkpoints; the safe loader ran nothing in the "
                       f"file. Load only checkpoints you made or trust")
    assert not marker.exists()


def test_an_untrusted_checkpoint_is_one_line_at_every_door(bad_checkpoints):
    """fairseq-generate's and fairseq-interactive's main, the hub, the diagnostics' loader, the
    runner and the resume check: one line naming the file and the refused class, no code run."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import generate, interactive

    from fairseq_normplug.checkpoint_compat import UntrustedCheckpoint
    from fairseq_normplug.checkpoint_safety import read_checkpoint
    from fairseq_normplug.diagnostics.loading import load_checkpoint
    from fairseq_normplug.experiments.runner import selected_checkpoint

    data, folder, marker = bad_checkpoints
    evil = str(folder / "evil.pt")
    base = [data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang", "src",
            "--target-lang", "tgt", "--path", evil, "--cpu"]
    doors = {
        "fairseq-generate": lambda: generate.main(options.parse_args_and_arch(options.get_generation_parser(),
                                                                              input_args=base)),
        "fairseq-interactive": lambda: interactive.main(convert_namespace_to_omegaconf(options.parse_args_and_arch(
            options.get_interactive_generation_parser(), input_args=base))),
        "hub": lambda: TransformerNormplugModel.from_pretrained(str(folder), "evil.pt", data_name_or_path=data),
        "diagnostics": lambda: load_checkpoint(evil, data),
        "runner": lambda: selected_checkpoint(evil),
        "resume check": lambda: read_checkpoint(evil),
    }
    for door, load in doors.items():
        with pytest.raises(UntrustedCheckpoint) as refused:
            load()
        assert_one_line_refusal(refused.value, evil, marker)


def test_an_unreadable_checkpoint_is_one_line(bad_checkpoints):
    from fairseq import checkpoint_utils

    from fairseq_normplug.checkpoint_compat import UnreadableCheckpoint
    from fairseq_normplug.checkpoint_safety import read_checkpoint

    data, folder, _ = bad_checkpoints
    cut = str(folder / "cut.pt")
    expected = (f"cannot read {cut} as a fairseq checkpoint (RuntimeError: PytorchStreamReader failed reading "
                f"zip archive: failed finding central directory)")
    for load in (lambda: checkpoint_utils.load_model_ensemble_and_task([cut]),
                 lambda: TransformerNormplugModel.from_pretrained(str(folder), "cut.pt", data_name_or_path=data)):
        with pytest.raises(UnreadableCheckpoint) as refused:
            load()
        assert str(refused.value) == expected
    assert read_checkpoint(cut) is None  # the resume check: an incomplete checkpoint, to be removed
    with pytest.raises(KeyError):  # an error outside torch.load passes through unchanged
        checkpoint_utils.load_checkpoint_to_cpu(str(folder / "whole.pt"))


@pytest.mark.slow
def test_fairseq_generate_refuses_an_untrusted_checkpoint_in_one_line(bad_checkpoints):
    data, folder, marker = bad_checkpoints
    proc = subprocess.run(
        [cli("fairseq-generate"), data, "--user-dir", PLUGIN, "--task", "translation_normplug", "--source-lang",
         "src", "--target-lang", "tgt", "--path", str(folder / "evil.pt"), "--cpu"],
        cwd=str(folder), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "weights_only" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fairseq-normplug: error: refused to load {folder / 'evil.pt'}: it holds os.makedirs ")
    assert not marker.exists()
