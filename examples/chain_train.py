"""A training run that survives time limits and preemption: trainer.resume.

Each job continues from the newest complete checkpoint in --dir (on however
many ranks it has) and saves one every --every steps. When any rank gets
SIGUSR1 (SLURM's warning: ``#SBATCH --signal=B:USR1@120`` and a batch script
that passes it on, see slurm/job-train-chain.sbatch) or SIGTERM (a
preemption), every rank saves at the next step boundary and the job ends with
status 75, requeued first with --requeue. The data position (a generator's
state) rides along in the checkpoints, so a chain of jobs ends with the weights
of one job that never stopped.

Run: scripts/mpirun.sh -n 2 .venv/bin/python examples/chain_train.py --dir ckpt
"""

import argparse
import hashlib
import sys
import time

import torch

import mpikv.torch


class Data:
    """Synthetic regression batches from one generator: its state is the data position."""

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)
        self.truth = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed + 1))

    def batch(self, size):
        x = torch.randn(size, 16, generator=self.generator)
        return x, torch.tanh(x @ self.truth)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the checkpoints' directory (shared by the ranks)")
    p.add_argument("--steps", type=int, default=200, help="steps of the whole run")
    p.add_argument("--every", type=int, default=20, help="a checkpoint every this many steps")
    p.add_argument("--batch", type=int, default=64, help="the global batch")
    p.add_argument("--requeue", action="store_true",
                   help="at a signal, scontrol requeue this SLURM job after the checkpoint")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="sleep this long in each step (a longer model, for trying signals)")
    args = p.parse_args(argv)
    if args.batch % mpikv.torch.size():   # every rank alike, before any store call
        p.error(f"--batch {args.batch} does not divide by the {mpikv.torch.size()} ranks: each "
                f"rank takes an equal slice of the global batch, and the rest would be "
                f"dropped; give a multiple of {mpikv.torch.size()}")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    trainer = mpikv.torch.Trainer(model, torch.optim.AdamW, {"lr": 1e-2},
                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 50))
    rank, size = trainer.kvstore.rank, trainer.kvstore.num_workers
    data = Data(seed=7)
    start = trainer.resume(args.dir, every=args.every, state=data, requeue=args.requeue)
    if rank == 0:
        print(f"chain_train: {size} rank(s), from step {start} of {args.steps}", flush=True)
    per = args.batch // size
    for step in range(start, args.steps):
        x, y = data.batch(args.batch)   # every rank draws the global batch: the same position
        rows = slice(rank * per, (rank + 1) * per)
        trainer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        trainer.step()
        trainer.lr_scheduler.step()
        time.sleep(args.step_seconds)
    with trainer.gathered():
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()[:16]
    if rank == 0:
        print(f"chain_train: done at step {trainer.num_update}, loss {loss.item():.5f}, "
              f"weights {digest}", flush=True)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
