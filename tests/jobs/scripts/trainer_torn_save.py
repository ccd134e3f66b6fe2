"""A Trainer checkpoint saved twice to one path, a rank killed between two of the
second save's files; run by tests/jobs/test_trainer_torn_save.py.

Usage: trainer_torn_save.py save PATH OUTDIR KILL_RANK KILL_BEFORE
       trainer_torn_save.py load PATH OUT.npz [PATH OUT.npz ...]

``save``: 2 steps, save A to PATH, 2 more steps, save B to PATH; rank 0 writes
what each save holds to OUTDIR/a.npz and OUTDIR/b.npz before it saves. During
save B, rank KILL_RANK ends (``os._exit``) just before its KILL_BEFORE-th file
rename (every file of a save is put in place by one rename): each number is a
point between two files. A run whose kill never came prints ``renames=N``.
``load``: for each PATH, a new store and a new Trainer (a new model) load PATH and
write what they hold to its OUT.npz: one job for the checkpoints of every kill.
"""

import os
import sys

import numpy as np
import torch

import mpikv
import mpikv.torch


def make(kv):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.BatchNorm1d(20), torch.nn.Tanh(),
                              torch.nn.Linear(20, 3))
    trainer = mpikv.torch.Trainer(net, torch.optim.AdamW, {"lr": 0.01}, kv,
                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(
                                      o, step_size=1, gamma=0.5))
    return net, trainer


def train(net, trainer, steps):
    for step in steps:
        g = torch.Generator().manual_seed(100 + step + 7 * trainer.rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        trainer.step()
        trainer.lr_scheduler.step()


def dump(net, trainer, out):
    """What the Trainer holds: weights, buffers, update count, learning rate (rank 0)."""
    with trainer.gathered():
        if trainer.rank == 0:
            np.savez(out, num_update=trainer.num_update, lr=trainer.learning_rate,
                     **{"w." + n: p.detach().numpy() for n, p in net.named_parameters()},
                     **{"b." + n: b.numpy() for n, b in net.named_buffers()})


def kill_before(nth):
    """Ends this process just before its ``nth`` rename from now on."""
    real, count = os.replace, [0]

    def replace(src, dst, **kw):
        count[0] += 1
        if count[0] == nth:
            os._exit(9)
        return real(src, dst, **kw)
    os.replace = replace
    return count


def main(argv):
    if argv[0] == "load":
        for path, out in zip(argv[1::2], argv[2::2]):
            print(f"loading {path}", flush=True)
            kv = mpikv.create("dist_sync", timeout=60)
            net, trainer = make(kv)
            trainer.load_checkpoint(path)
            dump(net, trainer, out)
            trainer.close()
            kv.close()
        return 0
    path, outdir, rank, nth = argv[1], argv[2], int(argv[3]), int(argv[4])
    kv = mpikv.create("dist_sync", timeout=60)
    net, trainer = make(kv)
    train(net, trainer, range(2))
    dump(net, trainer, os.path.join(outdir, "a.npz"))
    trainer.save_checkpoint(path)
    train(net, trainer, range(2, 4))
    dump(net, trainer, os.path.join(outdir, "b.npz"))
    count = kill_before(nth) if kv.rank == rank else None
    trainer.save_checkpoint(path)
    if count is not None:
        print(f"renames={count[0]}", flush=True)
    trainer.close()
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
