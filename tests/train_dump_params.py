"""fairseq-train that also saves each data-parallel rank's model state (``rank<N>.pt`` in
the directory ``$DUMP_PARAMS_DIR``) after every update, so a test can compare the ranks; with
``$DUMP_PARAMS_AT_UPDATE`` = U, also the state after update U (``rank<N>-update<U>.pt``).
Run as a program, or :func:`install` in a forked fairseq-train (tests/inprocess.py's ``at_start``)."""
import os

import torch
from fairseq import trainer
from fairseq_cli.train import cli_main

_train_step = trainer.Trainer.train_step


def train_step(self, *args, **kwargs):
    out = _train_step(self, *args, **kwargs)
    path = os.path.join(os.environ["DUMP_PARAMS_DIR"], f"rank{self.data_parallel_rank}.pt")
    state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
    torch.save(state, path)
    if os.environ.get("DUMP_PARAMS_AT_UPDATE") == str(self.get_num_updates()):
        torch.save(state, os.path.join(os.environ["DUMP_PARAMS_DIR"],
                                       f"rank{self.data_parallel_rank}-update{self.get_num_updates()}.pt"))
    return out


def install() -> None:
    """fairseq's ``Trainer.train_step`` replaced, in this process, by :func:`train_step`."""
    trainer.Trainer.train_step = train_step


if __name__ == "__main__":
    install()
    cli_main()
