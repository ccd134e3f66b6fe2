"""A fault-tolerant store whose rank 1 dies (``os._exit(9)``) mid-run; run by
tests/jobs/test_rank_lost.py under ``scripts/mpirun.sh --ft``.

Usage: rank_lost.py CASE [TOKEN]

CASE says where rank 1 dies while the others go on calling the store:
  agreement  between two pushpulls: the others wait in the next call's agreement
  sigkill    as agreement, but rank 1 gets SIGKILL (kill -9) instead of os._exit(9)
  stall      as agreement, and rank 2 stops itself (SIGSTOP) once it has reported the
             error: the failure detector takes it for dead before the survivors' end
  data       inside a pushpull's data phase (its updater, on the owner of a key)
  barrier    between barriers
  async      as data, in pushpull_async calls: the error comes on the store's worker
             thread, and handle.wait() raises it
  none       nobody dies: every rank finishes (and MPI_Finalize ends the job)
  at_exit    rank 1 dies after the last call; the others end their processes
             (the store's agreed "exit" call at the interpreter's end)
  slow       nobody dies; rank 2 computes (sleeps) 3 x the detector's timeout,
             between two calls: it must not be taken for dead
  refuse     nobody dies: the store's creation must be refused (no ULFM launch)
  slow_plain as slow, with a store made with fault_tolerant=False: the launch's
             detector watches it all the same
  slow_start nobody dies; MPI starts before mpikv is imported, and rank 2 sleeps as long
             before the first store is made
TOKEN is ignored: it marks the processes, for the test's look for leftovers.

Each survivor prints ``rank R: RankLostError: <message>``, then ``lost=[..]
survivors=[..]`` and the seconds from the death to the error. With
``RANK_LOST_REPORTS=DIR`` each rank also appends its lines to ``DIR/R.txt``: a
survivor the launcher ends may never have its last output forwarded.
"""

import os
import signal
import sys
import time

import numpy as np

if sys.argv[1:2] == ["slow_start"]:
    from mpi4py import MPI  # noqa: F401 - MPI first, as many programs do

import mpikv  # noqa: E402

STEPS, DIE_AT = 200, 20
#: the slow cases' computing: 3 x the detector's timeout (scripts/mpirun.sh --ft)
SLOW = 3 * float(os.environ.get("MPIKV_FT_DETECTOR_TIMEOUT", "10"))
KEYS = ["a", "b", "c", "w"]


def main(case):
    if case == "refuse":
        try:
            mpikv.create("dist_sync", fault_tolerant=True, timeout=60, autotune=False)
        except mpikv.FaultToleranceUnavailableError as exc:
            say(f"refused: {type(exc).__name__}: {exc}")
            return
        say("created: not refused")
        return
    if case == "slow_start" and MPI.COMM_WORLD.Get_rank() == 2:
        time.sleep(SLOW)
    kv = mpikv.create("dist_sync", fault_tolerant=case != "slow_plain", timeout=60,
                      autotune=False)
    rank = kv.rank
    values = [np.zeros(1000) for _ in KEYS]
    kv.init(KEYS, values)
    step = [0]
    if case in ("data", "async"):
        def update(key, pushed, stored):
            if rank == 1 and step[0] == DIE_AT:
                die()
            stored[...] = pushed
        kv.set_updater(update)
    try:
        for i in range(STEPS):
            step[0] = i
            if case == "at_exit" and i == 30:
                break
            if case == "barrier":
                if i == DIE_AT and rank == 1:
                    die()
                kv.barrier()
                continue
            if case in ("agreement", "sigkill", "stall") and i == DIE_AT and rank == 1:
                die(signal.SIGKILL if case == "sigkill" else None)
            if case in ("slow", "slow_plain") and i == DIE_AT and rank == 2:
                time.sleep(SLOW)
            grads = [np.full(1000, rank + 1.0) for _ in KEYS]
            if case == "async":
                kv.pushpull_async(KEYS, grads).wait()
            else:
                kv.pushpull(KEYS, grads)
            expected = kv.num_workers * (kv.num_workers + 1) / 2
            assert all((g == expected).all() for g in grads), (i, grads[0][:3])
    except mpikv.RankLostError as exc:
        seen = time.time()
        say(f"rank {rank}: RankLostError: {exc}")
        say(f"rank {rank}: lost={exc.lost} lost_world={exc.lost_world} "
            f"survivors={exc.survivors} shrunk_size={exc.comm.Get_size()} "
            f"step={step[0]} completed_here={exc.completed_here} seen_at={seen:.6f}")
        # The store is unusable now, every call the same error again.
        try:
            kv.barrier()
        except mpikv.RankLostError as again:
            say(f"rank {rank}: again: {again == exc or str(again) == str(exc)}")
        if case == "stall" and rank == 2:
            say("rank 2: stopping")
            os.kill(os.getpid(), signal.SIGSTOP)   # the launcher's end of the job wakes it
        return
    say(f"rank {rank}: finished without a loss")
    if case == "at_exit" and rank == 1:
        time.sleep(0.5)
        die()


def say(line):
    print(line, flush=True)
    where = os.environ.get("RANK_LOST_REPORTS")
    if where:
        with open(os.path.join(where, f"{os.environ.get('PMIX_RANK', 'x')}.txt"), "a") as f:
            f.write(line + "\n")


def die(signum=None):
    say(f"rank 1: dying at {time.time():.6f}")
    if signum is not None:
        os.kill(os.getpid(), signum)
        time.sleep(60)   # not reached
    os._exit(9)


if __name__ == "__main__":
    main(sys.argv[1])
