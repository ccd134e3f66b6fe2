"""Survivors go on: after each RankLostError, a new store on the survivors'
communicator (the error's ``.comm``), its keys planned over them anew and
initialised with the last values every survivor holds; run by
tests/jobs/test_rank_lost.py under ``scripts/mpirun.sh --ft -n 4``.

Usage: survive.py DEATHS [TOKEN]

DEATHS: ``STEP:RANK,STEP:RANK``: at the start of step STEP the rank that was
COMM_WORLD rank RANK dies (``os._exit(9)``). Every rank pushes
``(rank + 1) * (step + 1)`` (its COMM_WORLD rank) each step: the sum must be
that of the ranks alive, at the same step everywhere. A survivor whose pushpull
completed where the others' did not (``RankLostError.completed_here``: the dead
rank's data reached it first) goes back one step, so all redo the same one.
TOKEN is ignored: it marks the processes, for the test's look for leftovers.
DIE_BY=sigkill in the environment: the dying ranks get SIGKILL (kill -9) instead.
SLOW=STEP:RANK in the environment: that rank computes (sleeps) 6 s before that
step, 3 x the failure detector's timeout: it must not be taken for dead.
DIE_IN_RECOVERY=RANK in the environment: that rank is killed (SIGKILL) right after
its first RankLostError, while the others make the survivors' store: they get
a RankLostError from ``create`` and make it again on its ``.comm``.
"""

import os
import signal
import sys
import time

import numpy as np

import mpikv

STEPS = 60
SIZES = {"a": 10, "b": 300, "big": 5000}   # "big" is split over every rank (bigarray_bound)
OPTIONS = dict(fault_tolerant=True, timeout=60, autotune=False, bigarray_bound=1000)


def main(deaths):
    deaths = {int(s): int(r) for s, r in (d.split(":") for d in deaths.split(","))}
    slow = tuple(int(x) for x in os.environ.get("SLOW", "-1:-1").split(":"))
    kv = mpikv.create("dist_sync", **OPTIONS)
    me = kv.rank                              # COMM_WORLD rank, for the whole run
    alive = list(range(kv.num_workers))
    keys = list(SIZES)
    weights = [np.zeros(n) for n in SIZES.values()]
    previous = weights
    kv.init(keys, weights)
    step = 0
    while step < STEPS:
        if deaths.get(step) == me:
            print(f"rank {me}: dying at step {step}", flush=True)
            if os.environ.get("DIE_BY") == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(9)
        if (step, me) == slow:
            time.sleep(6.0)
        grads = [np.full(n, (me + 1.0) * (step + 1)) for n in SIZES.values()]
        try:
            kv.pushpull(keys, grads)
        except mpikv.RankLostError as exc:
            alive = [alive[r] for r in exc.survivors]
            if exc.completed_here:            # one step ahead of the others: back one
                step -= 1
                weights = previous
                print(f"rank {me}: completed step {step} where others did not: "
                      f"going back to it", flush=True)
            print(f"rank {me}: step {step}: lost store ranks {exc.lost}; "
                  f"survivors now {alive}", flush=True)
            if os.environ.get("DIE_IN_RECOVERY") == str(me):
                print(f"rank {me}: dying while the survivors make their store", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.monotonic()
            while True:
                try:
                    kv = mpikv.create("dist_sync", comm=exc.comm, **OPTIONS)
                    break
                except mpikv.RankLostError as again:   # lost while making it
                    alive = [alive[r] for r in again.survivors]
                    print(f"rank {me}: making the store: {again}", flush=True)
                    exc = again
            kv.init(keys, weights)            # the last values, rank 0 of the survivors'
            back = [np.empty(n) for n in SIZES.values()]
            kv.pull(keys, out=back)
            assert all((b == w).all() for b, w in zip(back, weights))
            print(f"rank {me}: new store: rank {kv.rank} of {kv.num_workers}, "
                  f"{time.monotonic() - start:.3f} s to make and fill", flush=True)
            continue                          # the step again, on the survivors
        expected = sum(r + 1.0 for r in alive) * (step + 1)
        bad = [k for k, g in zip(keys, grads) if not (g == expected).all()]
        assert not bad, (me, step, bad, expected, [g[:3] for g in grads])
        previous, weights = weights, grads
        step += 1
    print(f"rank {me}: finished {STEPS} steps on {kv.num_workers} ranks {alive}; "
          f"last sum {weights[2][0]:g}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
