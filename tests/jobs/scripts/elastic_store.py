"""kv.run over a rank that is killed; run by tests/jobs/test_elastic_store.py under
``scripts/mpirun.sh --ft``.

Usage: elastic_store.py DIR KILL_RANK@KILL_STEP MIN_WORKERS TOKEN [REDUNDANCY]

One key "w" of 5 float64, summed into by a Python updater (``stored += pushed``):
at step ``i`` each rank pushes the sum of its slice of a global batch of 12
rows (taken from ``kv.rank`` and ``kv.num_workers``), so "w" ends as the sum of
every batch, once each, whatever the rank count: a step applied twice or lost
would show. Checkpoints every 3 steps; the process that was KILL_RANK at the
start kills itself (SIGKILL) in step KILL_STEP. TOKEN marks the processes.
DIE_IN_RECOVERY=RANK in the environment: that rank kills itself in ``setup``, on the
survivors' new store, so the others' recovery meets a second loss.
"""

import os
import signal
import sys
import time

import numpy as np

import mpikv

STEPS, BATCH, EVERY = 14, 12, 3


def batch(i):
    return np.random.default_rng(100 + i).standard_normal((BATCH, 5))


def accumulate(key, pushed, stored):
    stored += pushed


def main(directory, kill, min_workers, redundancy="checkpoint"):
    kill_rank, kill_step = (int(v) for v in kill.split("@"))
    kv = mpikv.create("dist_sync", fault_tolerant=True, autotune=False, timeout=60)
    me = kv.rank
    kv.set_updater(accumulate)
    kv.init("w", np.zeros(5))
    seen = [kv.num_workers]

    def step_fn(kv, i):
        n, r = kv.num_workers, kv.rank
        if n != seen[-1]:
            seen.append(n)
            print(f"rank {me}: step {i} on {n} workers as rank {r} at {time.time():.6f}",
                  flush=True)
        if me == kill_rank and i == kill_step:
            print(f"rank {me}: dying in step {i} at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        kv.push("w", batch(i)[r * BATCH // n:(r + 1) * BATCH // n].sum(axis=0))

    def setup(new):
        if os.environ.get("DIE_IN_RECOVERY") == str(me):
            print(f"rank {me}: dying in the recovery at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        new.set_updater(accumulate)

    try:
        kv = kv.run(step_fn, STEPS, directory, every=EVERY, min_workers=min_workers,
                    setup=setup, redundancy=redundancy)
    except mpikv.MPIKVError as exc:
        print(f"rank {me}: {type(exc).__name__}: {exc}", flush=True)
        return
    w = np.zeros(5)
    kv.pull("w", out=w)
    want = sum(batch(i).sum(axis=0) for i in range(STEPS))
    print(f"rank {me}: finished on {kv.num_workers} workers as rank {kv.rank}; "
          f"max difference {np.abs(w - want).max():.3e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[5:6])
