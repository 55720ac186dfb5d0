"""Test-side wrapper of the trainer: `torchrun ... tests/load_and_dump.py PLAN_DIR OUT`.

Runs the built-in trainer on PLAN_DIR, and right after it loads the checkpoint writes this
rank's model chunks and optimizer state as full (unsharded) tensors to OUT/rank<N>.pt, for
test_checkpoint_failover to compare with the checkpoint as saved. (A test's hook, so it lives
here and not in the trainer.)"""
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from orchestrator.train.trainer import Trainer
from orchestrator.train.worker import setup_logging


class LoadAndDump(Trainer):
    def __init__(self, plan_dir: Path, out: Path):
        super().__init__(plan_dir)
        self.out = out

    def resume(self) -> int:
        step = super().resume()
        o = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        model, optim = {}, {}
        for (_, part), opt in zip(self.parts, self.opts):
            model.update(get_model_state_dict(part, options=o))
            optim.update(get_optimizer_state_dict(part, opt, options=o))
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model, "optim": optim}, self.out / f"rank{self.rank}.pt")
        return step


if __name__ == "__main__":
    setup_logging("?")
    LoadAndDump(Path(sys.argv[1]), Path(sys.argv[2])).run()
