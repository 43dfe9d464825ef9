"""fairseq-train that also saves each data-parallel rank's model state (``rank<N>.pt`` in
the directory ``$DUMP_PARAMS_DIR``) after every update, so a test can compare the ranks."""
import os

import torch
from fairseq import trainer
from fairseq_cli.train import cli_main

_train_step = trainer.Trainer.train_step


def train_step(self, *args, **kwargs):
    out = _train_step(self, *args, **kwargs)
    path = os.path.join(os.environ["DUMP_PARAMS_DIR"], f"rank{self.data_parallel_rank}.pt")
    torch.save({k: v.detach().cpu() for k, v in self.model.state_dict().items()}, path)
    return out


trainer.Trainer.train_step = train_step

if __name__ == "__main__":
    cli_main()
