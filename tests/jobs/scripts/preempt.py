"""A job that trains until a signal stops it (tests/jobs/test_launcher_signals.py):
``trainer.resume`` with no periodic checkpoint, one line per step and rank.

Usage: preempt.py DIRECTORY LAST [TAG]

Each rank prints ``rank R/N: from step S`` once, then ``rank R step S`` after each
update S, sleeping 0.1 s a step so that a signal finds it training. At a
SIGTERM or SIGUSR1 (on any rank) every rank saves the checkpoint of its step and
the job ends with status 75; with LAST reached it ends with 0. TAG is ignored
(the tests find the job's processes by it).
"""

import sys
import time

import torch

import mpikv
import mpikv.torch


def main(argv):
    directory, last = argv[0], int(argv[1])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    kv = mpikv.create("dist_sync", timeout=120)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.01}, kv)
    generator = torch.Generator().manual_seed(1 + kv.rank)
    start = trainer.resume(directory, every=None)
    print(f"rank {kv.rank}/{kv.num_workers}: from step {start}", flush=True)
    for step in range(start, last):
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        trainer.step(batch_size=1)
        print(f"rank {kv.rank} step {step + 1}", flush=True)
        time.sleep(0.1)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
