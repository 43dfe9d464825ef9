"""Short fine-tune of a converted checkpoint: fairseq-train's own training loop
(``fairseq_cli.train.main``) on the checkpoint's stored configuration, restored from it with
fairseq's reset flags (``--reset-optimizer --reset-lr-scheduler --reset-dataloader
--reset-meters``), a constant learning rate (the ``fixed`` scheduler), no validation.

The stored configuration carries every model flag of the run (sizes, tying, PreNorm/PostNorm,
``--norm-type dyt`` after conversion), so nothing has to be spelled out again on a command
line; the optimizer, criterion, batch size and clipping are the original run's.

    python -m fairseq_normplug.diagnostics.finetune CKPT DATA_BIN SAVE_DIR --updates N --lr LR
"""
import argparse
import os
import sys

import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf, open_dict

from fairseq_normplug.cli import user_dir


def finetune_config(checkpoint: str, data_bin: str, save_dir: str, updates: int, lr: float):
    """The fairseq configuration of the fine-tune (see the module docstring)."""
    cfg = checkpoint_utils.load_checkpoint_to_cpu(checkpoint, {"data": data_bin})["cfg"]
    with open_dict(cfg):
        cfg.task.data = data_bin
        checkpoint_cfg = cfg.checkpoint
        checkpoint_cfg.restore_file = os.path.abspath(checkpoint)
        for flag in ("reset_optimizer", "reset_lr_scheduler", "reset_dataloader", "reset_meters",
                     "no_epoch_checkpoints"):
            checkpoint_cfg[flag] = True
        checkpoint_cfg.update(save_dir=save_dir, no_save=False, save_interval_updates=0,
                              finetune_from_model=None, best_checkpoint_metric="loss",
                              maximize_best_checkpoint_metric=False)
        cfg.optimization.update(max_update=updates, max_epoch=0, stop_min_lr=-1.0, lr=[lr])
        if "lr" in cfg.optimizer:
            cfg.optimizer.lr = [lr]
        cfg.lr_scheduler = OmegaConf.create({"_name": "fixed", "lr": [lr], "warmup_updates": 0,
                                             "force_anneal": None, "lr_shrink": 0.1})
        cfg.dataset.update(disable_validation=True, num_workers=0, validate_interval_updates=0)
        cfg.common.update(cpu=not torch.cuda.is_available(), log_format="json",
                          log_interval=max(1, updates // 10))
        cfg.distributed_training.distributed_world_size = 1
        # this plugin, not the checkout the run was trained from (another path would be a
        # second, clashing "fairseq_normplug" for fairseq's --user-dir import)
        cfg.common.user_dir = user_dir()
    return cfg


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fairseq_normplug.diagnostics.finetune",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data_bin")
    parser.add_argument("save_dir")
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    args = parser.parse_args(argv)
    import fairseq_normplug  # noqa: F401  (registers the model and the schedulers)
    from fairseq_cli.train import main as fairseq_train

    fairseq_train(finetune_config(args.checkpoint, args.data_bin, args.save_dir, args.updates, args.lr))


if __name__ == "__main__":
    main(sys.argv[1:])
