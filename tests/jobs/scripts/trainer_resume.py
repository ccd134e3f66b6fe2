"""Trainer steps that stop, checkpoint and resume; run by tests/jobs/test_trainer_resume.py.

Usage: trainer_resume.py FIRST LAST [--load CKPT] [--save CKPT] [--out WEIGHTS.npz]
                          [--out-each DIRECTORY] [--shard LEVEL]

``--out-each`` writes the weights after every step (DIRECTORY/STEP.npz), as ``--out``
writes those of the last.

Rank 0 computes the loss of the whole batch and the others backward a zero
loss (of other data: the BatchNorm buffers are rank 0's, and in checkpoints), and ``step(batch_size=1)`` sums without averaging: the sum is then the
same on any number of ranks, so runs on different rank counts can be compared
bit for bit (with ``--shard optimizer`` on 1, 2 or 4 ranks: the average over the
ranks, scaled back, is then exact too).
"""

import argparse
import sys

import numpy as np
import torch

import mpikv
import mpikv.torch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.BatchNorm1d(40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 3))


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--out")
    p.add_argument("--out-each")
    p.add_argument("--shard", default="gradients")
    a = p.parse_args(argv)
    net = model()
    # Keys of 100 elements or more are split over the owners (fc 0 has 240).
    kv = mpikv.create("dist_sync", bigarray_bound=100, timeout=120)
    # Default shard="gradients": the owners update from the sums themselves (with
    # "optimizer", .grad is averaged after backward and step(batch_size) scales the
    # average back: one rounding that depends on the number of ranks, unless a power of 2).
    trainer = mpikv.torch.Trainer(net, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1},
                                  kv, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(
                                      o, step_size=2, gamma=0.5), shard=a.shard)
    if a.load:
        trainer.load_checkpoint(a.load)
        assert trainer.num_update == a.first, (trainer.num_update, a.first)
    for step in range(a.first, a.last):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        trainer.zero_grad()
        # The other ranks' batches differ, and so would their BatchNorm statistics:
        # the buffers every rank takes before each forward are rank 0's.
        loss = torch.nn.functional.mse_loss(net(x if kv.rank == 0 else 2 * x), y)
        (loss if kv.rank == 0 else loss * 0).backward()
        trainer.step(batch_size=1)
        trainer.lr_scheduler.step()
        if a.out_each:
            write(f"{a.out_each}/{step + 1}.npz", trainer, net, kv)
    if a.save:
        trainer.save_checkpoint(a.save)
    if a.out:
        write(a.out, trainer, net, kv)
    return 0


def write(path, trainer, net, kv):
    """Rank 0 writes the whole weights, buffers and learning rate to ``path``."""
    with trainer.gathered():   # (shard="parameters": each rank holds its parts only)
        if kv.rank == 0:
            np.savez(path, lr=trainer.learning_rate,
                     **{n: p.detach().numpy() for n, p in net.named_parameters()},
                     **{n: b.numpy() for n, b in net.named_buffers()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
