"""``fairseq-normplug-hydra-train`` (= ``python -m fairseq_normplug.hydra_train``): fairseq's
``fairseq-hydra-train`` with the plugin imported before hydra composes the config, so that its
config groups can be chosen like fairseq's own (``task=translation_normplug``,
``model=transformer_normplug_ted``, ``lr_scheduler=val_decay``,
``criterion=masked_label_smoothed_cross_entropy``) and the recipes of configs/hydra/ run:

    fairseq-normplug-hydra-train --config-dir configs/hydra --config-name ted_gl_en_full \\
        task.data=data/ted/gl-en/bin

The model's settings are read as fairseq-train reads its flags (an unknown key or a bad value
is the same one-line error, before any data is read; docs/experiments.md, "Hydra").
Do not set ``common.user_dir``: the plugin is already imported.
"""
import os

import fairseq
import hydra
from fairseq.dataclass.initialize import add_defaults, hydra_init
from fairseq.dataclass.utils import omegaconf_no_object_check
from fairseq_cli.hydra_train import _hydra_main
from omegaconf import OmegaConf

import fairseq_normplug  # noqa: F401  (registers the model, task, schedulers and criterion)
from fairseq_normplug.errors import NormplugError, exit_with_one_line
from fairseq_normplug.models.normplug_config import check_hydra_model_config, register_hydra_model_nodes

#: fairseq's own primary config (fairseq/config/config.yaml), as fairseq-hydra-train uses it
FAIRSEQ_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(fairseq.__file__)), "config")


@hydra.main(config_path=FAIRSEQ_CONFIG_DIR, config_name="config")
def hydra_main(cfg) -> float:
    try:
        check_hydra_model_config(cfg)
        return _hydra_main(cfg)
    except NormplugError as error:  # hydra would print it with a stack trace
        exit_with_one_line(error)


def compose(config_name: str = "config", overrides=(), config_dir: str = None):
    """The config ``fairseq-normplug-hydra-train [--config-dir DIR] --config-name NAME OVERRIDES``
    trains with (composed, checked, with fairseq's defaults added and interpolations resolved),
    without training: for tests and for a look at a recipe."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_hydra_model_nodes()
    hydra_init(config_name)
    # no version_base, as @hydra.main above (and fairseq-hydra-train): the same composition rules
    with initialize_config_dir(config_dir=os.path.abspath(config_dir or FAIRSEQ_CONFIG_DIR)):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    check_hydra_model_config(cfg)
    add_defaults(cfg)
    with omegaconf_no_object_check():
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    OmegaConf.set_struct(cfg, True)
    return cfg


def cli_main() -> None:
    """fairseq's ``fairseq_cli.hydra_train.cli_main``, with the plugin's model presets stored
    as hydra's ``model`` group first."""
    from hydra._internal.utils import get_args

    register_hydra_model_nodes()
    hydra_init(get_args().config_name or "config")
    hydra_main()


if __name__ == "__main__":
    cli_main()
