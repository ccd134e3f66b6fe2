"""A process that ends while its Trainer's launcher still holds bucket calls (a
backward with ``shard="gradients"`` and no step after it); run by
tests/jobs/test_launcher_exit.py.

Usage: queued_at_exit.py CASE RANK [TAG]

CASE:
    even: every rank trains 3 steps, then makes one more backward and ends.
    odd: the same, but only RANK makes the last backward; the others end after
        their 3 steps.
TAG: not read (it marks the job's processes, for the test to find any left).
"""

import sys

import torch

import mpikv.torch
from mpikv.torch import trainer as trainer_module


def main(case, odd):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    made = []   # the Trainer's pieces (mpikv/torch/_pieces.py), to read its launcher's mode
    make = trainer_module.make_pieces
    trainer_module.make_pieces = lambda *args: made.append(make(*args)) or made[-1]
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, bucket_bytes=64,
                                  shard="gradients")
    rank = trainer.kvstore.rank
    for _ in range(3):
        trainer.zero_grad()
        net(torch.randn(8, 4)).pow(2).sum().backward()
        trainer.step()
    print(f"rank {rank} finished 3 steps, launcher threaded: {made[-1].context.launcher.threaded}",
          flush=True)
    if case == "even" or rank == odd:
        trainer.zero_grad()
        net(torch.randn(8, 4)).pow(2).sum().backward()   # queued: the process ends


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
