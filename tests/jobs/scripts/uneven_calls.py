"""Ranks that reach the Trainer's collective calls differently, under the default
settings (a 600 s timeout); run by tests/jobs/test_uneven_calls.py.

Usage: uneven_calls.py CASE RANK PATH [TAG]

CASE (RANK is the rank that does something else):
    close: RANK runs out of data after step 12 and closes the Trainer; the
        others go on to step 13 (no ``trainer.join()``).
    exit: the same, but RANK's process ends without closing anything.
    save: ``if rank == RANK: trainer.save_checkpoint(PATH)`` after step 12.
    even: every rank trains 12 steps and its process ends (nothing to report).
    tail: as even, with a 3 s timeout; then RANK works 6 s more outside mpikv (a
        final evaluation) while the others' processes end and wait for it.
TAG: not read (it marks the job's processes, for the test to find any left).
"""

import sys
import time

import torch

import mpikv.torch


def main(case, odd, path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    kv = mpikv.create("dist_sync", timeout=3) if case == "tail" else None
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, kv)
    rank = trainer.kvstore.rank
    batches = (12 if case in ("even", "tail") or (case in ("close", "exit") and rank == odd)
               else 20)
    for step in range(1, batches + 1):
        if case == "save" and step == 13 and rank == odd:
            trainer.save_checkpoint(path)
        trainer.zero_grad()
        net(torch.randn(8, 4)).pow(2).sum().backward()
        trainer.step()
    if case == "close":
        trainer.close()
    if case == "tail" and rank == odd:
        time.sleep(6)
    print(f"rank {rank} finished {batches} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
