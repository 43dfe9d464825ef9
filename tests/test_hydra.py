"""fairseq-normplug-hydra-train (fairseq_normplug/hydra_train.py) against fairseq-train: the
recipe YAML of configs/hydra/ and the scripts' command give the same configuration, the same
model (class tree, parameter names, initial values) and the same training; the model's config
dataclass follows its flags; typos and bad values are refused in one line. The commands run in
forked children of this process (tests/inprocess.py's run_forked): their configuration, training
and errors are the subject, not the start of a process."""
import argparse
import json
import os
import sys

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models.transformer import TransformerConfig
from omegaconf import OmegaConf

from conftest import REPO, cli
from inprocess import run_forked
from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.runner import Run, subword_method
from fairseq_normplug.hydra_train import compose
from fairseq_normplug.models.normplug_args import add_normplug_args
from fairseq_normplug.models.normplug_config import flag_actions, normplug_config_class
from fairseq_normplug.models.transformer_normplug import TransformerNormplugModel

HYDRA_DIR = os.path.join(REPO, "configs", "hydra")
#: configs/hydra/ted_gl_en_full.yaml is this row of this table (with the "ted" recipe)
TABLE, ROW = "table3", "PreNorm + FixNorm + ScaleNorm"
HYDRA_TRAIN = [sys.executable, "-m", "fairseq_normplug.hydra_train"]
#: the same short run on the tiny corpus, as fairseq-train flags and as hydra overrides
SHORT_FLAGS = ["--arch", "transformer_normplug_tiny", "--max-update", "20", "--max-tokens", "1200",
               "--disable-validation", "--log-interval", "10"]
SHORT_OVERRIDES = ["model._name=transformer_normplug_tiny", "optimization.max_update=20", "dataset.max_tokens=1200",
                   "dataset.disable_validation=true", "common.log_interval=10"]


def recipe_run(data_dir, run_dir) -> Run:
    table = load_table(TABLE)
    return Run(table=table, row=table.row(ROW), pair="src-tgt", data_dir=data_dir, run_dir=str(run_dir))


def yaml_overrides(data_dir, save_dir):
    """What differs between the YAML (TED gl-en) and a run on the tiny prepared corpus."""
    return [f"task.data={data_dir}/bin", "task.source_lang=src", "task.target_lang=tgt",
            f"task.eval_bleu_remove_bpe={subword_method(data_dir)}", f"checkpoint.save_dir={save_dir}",
            f"common.cpu={str(not torch.cuda.is_available()).lower()}"]


def built(cfg, seed=1):
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(seed)
    return task.build_model(cfg.model)


def test_the_config_dataclass_is_generated_from_the_flags():
    config = normplug_config_class()
    assert issubclass(config, TransformerConfig)
    fields = set(config.__dataclass_fields__)
    assert set(flag_actions(add_normplug_args)) <= fields and {"fixnorm", "norm_type", "target_vocab_mask"} <= fields
    assert config.__dataclass_fields__["fixnorm"].default is False

    def extended(parser):  # an extension's flag, added before the config is generated
        add_normplug_args(parser)
        parser.add_argument("--my-norm-scale", type=float)
    assert "my_norm_scale" in normplug_config_class(extended).__dataclass_fields__


def test_the_yaml_recipe_is_the_scripts_command(tiny_data_dir, tmp_path):
    """Same configuration in every group (but the device and --user-dir), same model: class
    tree, parameter names and initial values at the recipe's full size (on a data folder's
    dictionaries: nothing is trained)."""
    command = recipe_run(tiny_data_dir, tmp_path).train_command()
    args = options.parse_args_and_arch(options.get_training_parser(), command[1:])
    flags_cfg = convert_namespace_to_omegaconf(args)
    yaml_cfg = compose("ted_gl_en_full", yaml_overrides(tiny_data_dir, flags_cfg.checkpoint.save_dir), HYDRA_DIR)
    for group in yaml_cfg:
        if group == "model" or not OmegaConf.is_config(yaml_cfg[group]):
            continue
        expected = OmegaConf.to_container(flags_cfg[group])
        if group == "common":
            expected["user_dir"] = None  # the hydra entry point imports the plugin itself
        assert OmegaConf.to_container(yaml_cfg[group]) == expected, group
    assert yaml_cfg.model._name == args.arch == "transformer_normplug_ted"

    ours, theirs = built(yaml_cfg), built(flags_cfg)
    assert [type(m) for m in ours.modules()] == [type(m) for m in theirs.modules()]
    assert type(ours.decoder.embed_tokens).__name__ == "FixNormEmbedding"
    theirs_state = theirs.state_dict()
    assert list(ours.state_dict()) == list(theirs_state)
    for name, value in ours.state_dict().items():
        assert torch.equal(value, theirs_state[name]), name


def loss_at(proc, updates):
    """The training loss logged at ``updates`` (a JSON train_inner record)."""
    for line in (proc.stdout + proc.stderr).splitlines():
        if "train_inner" in line and "{" in line:
            record = json.loads(line[line.index("{"):])
            if record["num_updates"] == str(updates):
                return record["loss"]
    raise AssertionError(f"no train_inner record at {updates} updates:\n{proc.stderr[-3000:]}")


def model_flags(cfg_model) -> dict:
    """{dest: value} of the model flags a checkpoint's cfg.model holds (Namespace or dict)."""
    values = vars(cfg_model) if isinstance(cfg_model, argparse.Namespace) else dict(cfg_model)
    return {dest: values[dest] for dest in flag_actions(TransformerNormplugModel.add_args) if dest in values}


@pytest.mark.slow
def test_hydra_and_fairseq_train_train_the_same_model(tiny_prepared, tmp_path):
    """20 updates of the full method on the tiny corpus, from the YAML and from the scripts'
    command: the same losses, the same trained parameters, the same resolved model flags in both
    checkpoints, every flag given to fairseq-train kept with its value."""
    flags_dir, yaml_dir = tmp_path / "flags", tmp_path / "yaml"
    command = recipe_run(tiny_prepared, flags_dir).train_command(SHORT_FLAGS)
    hydra = [*HYDRA_TRAIN, "--config-dir", HYDRA_DIR, "--config-name", "ted_gl_en_full",
             *yaml_overrides(tiny_prepared, yaml_dir / "checkpoints"), *SHORT_OVERRIDES]
    by_flags, by_yaml = run_forked([command, hydra], cwd=str(tmp_path))
    assert loss_at(by_yaml, 10) == loss_at(by_flags, 10) and loss_at(by_yaml, 20) == loss_at(by_flags, 20)

    paths = [str(d / "checkpoints" / "checkpoint_last.pt") for d in (flags_dir, yaml_dir)]
    (flags_model,), flags_cfg, _ = checkpoint_utils.load_model_ensemble_and_task(paths[:1])
    (yaml_model,), yaml_cfg, _ = checkpoint_utils.load_model_ensemble_and_task(paths[1:])
    assert isinstance(flags_cfg.model, argparse.Namespace) and OmegaConf.is_config(yaml_cfg.model)
    assert type(yaml_model.decoder).__name__ == "FixNormTransformerDecoder"
    assert yaml_model.decoder.target_vocab_mask is not None
    assert [type(m) for m in yaml_model.modules()] == [type(m) for m in flags_model.modules()]
    flags_state = flags_model.state_dict()
    for name, value in yaml_model.state_dict().items():
        assert torch.equal(value, flags_state[name]), name

    given = options.parse_args_and_arch(options.get_training_parser(), command[1:])
    stored = model_flags(flags_cfg.model)
    assert stored == model_flags(given)
    assert stored["norm_type"] == "scalenorm" and stored["encoder_layers"] == 2 and stored["norm_stats_interval"] == 100
    assert model_flags(yaml_cfg.model) == stored


@pytest.mark.slow
def test_typos_and_bad_values_are_one_line_errors(tiny_bin, tmp_path):
    groups = ["task=translation_normplug", f"task.data={tiny_bin}", "model=transformer_normplug_tiny",
              "lr_scheduler=val_decay", "criterion=masked_label_smoothed_cross_entropy", "optimizer=adam",
              "common.cpu=true"]
    typo, bad_value, train_bad_value = run_forked([
        [*HYDRA_TRAIN, *groups, "+model.prenrom=true"],
        [*HYDRA_TRAIN, *groups, "+model.norm_type=foo"],
        [cli("fairseq-train"), tiny_bin, "--user-dir", os.path.join(REPO, "fairseq_normplug"),
         "--arch", "transformer_normplug_tiny", "--norm-type", "foo", "--cpu"],
    ], cwd=str(tmp_path))
    for proc in (typo, bad_value, train_bad_value):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = [proc.stderr.strip().splitlines()[-1] for proc in (typo, bad_value, train_bad_value)]
    assert last[0] == ("fairseq-normplug: error: unknown model setting 'prenrom' for transformer_normplug_tiny "
                       "(did you mean 'prenorm'?); the settings are the flags of fairseq-train --arch "
                       "transformer_normplug_tiny --help, with '_' for '-'")
    assert last[1].startswith("fairseq-normplug: error: argument --norm-type: invalid choice: 'foo'")
    assert last[1].split(": error: ", 1)[1] == last[2].split(": error: ", 1)[1]


def test_the_plugins_config_groups(tiny_bin):
    cfg = compose(overrides=["task=translation_normplug", f"task.data={tiny_bin}", "model=transformer_normplug_tiny",
                             "lr_scheduler=val_decay", "criterion=masked_label_smoothed_cross_entropy",
                             "+model.fixnorm=true", "+model.norm_eps='1e-6'", "+model.dyt_alpha_init=auto", "+model.dyt=true"])
    assert (cfg.task._name, cfg.model._name, cfg.lr_scheduler._name, cfg.criterion._name) == (
        "translation_normplug", "transformer_normplug_tiny", "val_decay", "masked_label_smoothed_cross_entropy")
    assert cfg.lr_scheduler.lr_decay == 0.8 and cfg.task.word_dropout == 0.0  # the dataclasses' defaults
    assert cfg.model.norm_eps == 1e-6 and cfg.model.dyt_alpha_init == "auto"  # as fairseq-train parses them
    model = built(cfg)
    assert type(model.encoder.embed_tokens).__name__ == "FixNormEmbedding"
    assert model.encoder.embed_tokens.embedding_dim == 64  # the tiny preset filled what was not given
