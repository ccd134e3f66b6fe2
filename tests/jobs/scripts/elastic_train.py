"""trainer.run over a rank that is killed: the survivors go on from the latest
checkpoint; run by tests/jobs/test_elastic_trainer.py under ``scripts/mpirun.sh --ft``.

Usage: elastic_train.py DIR KILLS MIN_WORKERS TOKEN [REDUNDANCY]

A float64 model, SGD with momentum, ``trainer.resume(DIR, every=3)``; each step
``i`` is one global batch of 12 samples, each rank taking its slice from
``trainer.rank`` and ``trainer.num_workers``. KILLS is ``RANK@STEP,...`` (or
``-``): the process that was rank RANK at the start kills itself (SIGKILL) in
step STEP, right after its ``zero_grad`` (where the checkpoint due is started
in the background: it is being written when the rank dies). At the end
each survivor compares its weights with plain torch's on the whole batches
(an uninterrupted one-process run) and checks that every checkpoint in DIR
with a Trainer file is complete. TOKEN is ignored (it marks the processes).
REDUNDANCY is the Trainer's ``redundancy`` (default "checkpoint").
SHARD in the environment: the Trainer's ``shard`` (default its own); MODEL=embedding:
a model with an ``nn.Embedding(sparse=True)`` (its rows in row tables), plain SGD.
DIE_IN_RECOVERY=RANK in the environment: that rank is killed (SIGKILL) when the
first recovery starts making the survivors' store: the others' recovery meets
a second loss and recovers from it in turn. KILL_PARENT=1: a dying rank first kills
its parent, its host's launcher daemon (tests/system/test_cluster_ft.py).
KILL_IN=backward: a dying rank dies inside its backward instead, when the first
layer's gradient is made, the other layers' buckets (one per parameter then) being
reduced in the background.
BACKGROUND=0 in the environment: each periodic checkpoint is written and committed
before the loop goes on (``resume(background=False)``), so that a rank killed two
steps later always finds it: a test that asserts the step the survivors go on
from makes that checkpoint exist, instead of hoping the background write ended
in time (under load it may not have, and they go on from the one before).
"""

import os
import signal
import sys
import time

import torch

import mpikv
import mpikv.torch
from mpikv.torch import resume
from mpikv.torch import trainer as trainer_module

STEPS, BATCH, EVERY = 14, 12, 3
#: MODEL=embedding in the environment: a sparse embedding (row tables) and plain SGD
EMBEDDING = os.environ.get("MODEL") == "embedding"
HYPER = {"lr": 0.05} if EMBEDDING else {"lr": 0.05, "momentum": 0.9}


class Embedded(torch.nn.Module):
    """Rows of an ``nn.Embedding(sparse=True)`` picked by the input, and a linear head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        ids = (x[:, 0].abs() * 7).long() % 20
        return self.out(torch.cat([self.emb(ids), x], dim=1))


def model():
    torch.manual_seed(0)
    if EMBEDDING:
        return Embedded().double()
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(BATCH, 4, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 2, generator=g, dtype=torch.float64))


def loss_of(net, x, y):
    return ((net(x) - y) ** 2).sum() / BATCH   # a slice's share of the batch's mean


def reference():
    """The uninterrupted run: plain torch, one process, the whole batches."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), **HYPER)
    for i in range(STEPS):
        opt.zero_grad()
        loss_of(net, *batch(i)).backward()
        opt.step()
    return dict(net.named_parameters())


def main(directory, kills, min_workers, redundancy="checkpoint"):
    kills = {} if kills == "-" else {int(r): int(s) for r, s in
                                     (k.split("@") for k in kills.split(","))}
    net = model()
    in_backward = os.environ.get("KILL_IN") == "backward"
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, fault_tolerant=True,
                                  min_workers=min_workers, redundancy=redundancy,
                                  shard=os.environ.get("SHARD"),
                                  bucket_bytes=8 if in_backward else 8 << 20)
    me = trainer.rank   # the rank at the start (this process's name in the output)
    if os.environ.get("DIE_IN_RECOVERY") == str(me):
        # The recovery's first step makes the store over the survivors: die there.
        store_for = trainer_module.store_for

        def dying_store_for(options, survivors=None):
            if survivors is not None:
                print(f"rank {me}: dying in the recovery at {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return store_for(options, survivors)
        trainer_module.store_for = dying_store_for
    trainer.resume(directory, every=EVERY,
                   background=os.environ.get("BACKGROUND", "1") != "0")
    seen = [trainer.num_workers]
    reported = [trainer.num_workers]

    def step_fn(i):
        n, r = trainer.num_workers, trainer.rank
        if n != seen[-1]:
            seen.append(n)
            print(f"rank {me}: step {i} on {n} workers as rank {r} at {time.time():.6f}",
                  flush=True)
        x, y = batch(i)
        lo, hi = r * BATCH // n, (r + 1) * BATCH // n
        trainer.zero_grad()
        def die(*_):
            print(f"rank {me}: dying in step {i}{' in backward' if in_backward else ''} "
                  f"at {time.time():.6f}", flush=True)
            if os.environ.get("KILL_PARENT"):   # the host's daemon (prted) too
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if kills.get(me) == i:
            if in_backward:   # the first layer's gradient comes last
                next(net.parameters()).register_hook(die)
            else:
                die()
        loss_of(net, x[lo:hi], y[lo:hi]).backward()
        trainer.step(batch_size=1)   # the sum of the slices' gradients: the batch's
        if reported[-1] != n:
            reported.append(n)
            print(f"rank {me}: step {i} completed on {n} workers at {time.time():.6f}",
                  flush=True)

    try:
        done = trainer.run(step_fn, STEPS)
    except mpikv.MPIKVError as exc:
        print(f"rank {me}: {type(exc).__name__}: {exc}", flush=True)
        return
    want = reference()
    diff = max((p.detach() - want[name]).abs().max().item()
               for name, p in net.named_parameters())
    print(f"rank {me}: finished {done} updates on {trainer.num_workers} workers as rank "
          f"{trainer.rank}; max difference {diff:.3e}", flush=True)
    if trainer.rank == 0:
        found = resume.steps_in(directory)
        half = [s for s in found if os.path.exists(f"{directory}/{resume.name_of(s)}.trainer.json")
                and not resume.is_complete(f"{directory}/{resume.name_of(s)}")]
        print(f"checkpoints {sorted(found)}; committed but incomplete {half}", flush=True)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[5:6])
