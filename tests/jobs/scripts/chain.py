"""One job of a chain (tests/jobs/test_job_chain.py): trains to step LAST through
``trainer.resume``, sending itself SIGNAL on rank RANK before step AT if asked.

Usage: chain.py DIRECTORY LAST [--signal NAME --at STEP --rank R] [--out WEIGHTS.npz]

As tests/jobs/scripts/trainer_resume.py: rank 0 computes the loss of the whole
batch, the others backward zero, shard="gradients" and step(batch_size=1) sum
without averaging, so runs on any number of ranks give the same bits. The data
comes from a generator whose state rides along in the checkpoints (the user's
state), so a resumed job draws the batches the uninterrupted run drew.
"""

import argparse
import os
import signal
import sys

import numpy as np
import torch

import mpikv
import mpikv.torch


class Data:
    """The data position: a torch generator, saved with each checkpoint."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(1234)

    def batch(self):
        return (torch.randn(8, 6, generator=self.generator),
                torch.randn(8, 3, generator=self.generator))

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("last", type=int)
    p.add_argument("--signal")
    p.add_argument("--at", type=int, default=-1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    kv = mpikv.create("dist_sync", bigarray_bound=100, timeout=120)
    trainer = mpikv.torch.Trainer(net, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1},
                                  kv, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(
                                      o, step_size=2, gamma=0.5), shard="gradients")
    data = Data()
    start = trainer.resume(a.directory, every=3, state=data)
    print(f"rank {kv.rank}/{kv.num_workers}: from step {start}", flush=True)
    for step in range(start, a.last):
        if step == a.at and kv.rank == a.rank:
            os.kill(os.getpid(), getattr(signal, a.signal))
        x, y = data.batch()
        trainer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        (loss if kv.rank == 0 else loss * 0).backward()
        trainer.step(batch_size=1)
        trainer.lr_scheduler.step()
    if a.out and kv.rank == 0:
        np.savez(a.out, **{n: p.detach().numpy() for n, p in net.named_parameters()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
