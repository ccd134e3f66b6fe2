"""kv.run over a rank that stops (SIGSTOP) instead of dying; run by
tests/jobs/test_stopped_rank.py under ``scripts/mpirun.sh --ft``.

Usage: stopped_rank.py DIR STOP_RANK@STOP_STEP TOKEN [REDUNDANCY]

As tests/jobs/scripts/elastic_store.py (one key "w" summed into by a Python
updater, each rank pushing its slice of a global batch: "w" ends as the sum of
every batch, once each), but the process that is STOP_RANK at the start stops
itself with SIGSTOP in step STOP_STEP: it never dies, its heartbeats stop, and
the failure detector declares it lost. TOKEN marks the processes.
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


def main(directory, stop, redundancy="checkpoint"):
    stop_rank, stop_step = (int(v) for v in stop.split("@"))
    kv = mpikv.create("dist_sync", fault_tolerant=True, autotune=False, timeout=120)
    me = kv.rank
    kv.set_updater(accumulate)
    kv.init("w", np.zeros(5))
    seen = [kv.num_workers]

    def step_fn(kv, i):
        n, r = kv.num_workers, kv.rank
        if n != seen[-1]:
            seen.append(n)
            print(f"rank {me}: step {i} on {n} workers as rank {r}", flush=True)
        if me == stop_rank and i == stop_step:
            print(f"rank {me}: stopping in step {i} at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        kv.push("w", batch(i)[r * BATCH // n:(r + 1) * BATCH // n].sum(axis=0))

    kv = kv.run(step_fn, STEPS, directory, every=EVERY, min_workers=1,
                setup=lambda new: new.set_updater(accumulate), redundancy=redundancy)
    w = np.zeros(5)
    kv.pull("w", out=w)
    want = sum(batch(i).sum(axis=0) for i in range(STEPS))
    print(f"rank {me}: finished on {kv.num_workers} workers as rank {kv.rank}; "
          f"max difference {np.abs(w - want).max():.3e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[4:5])
