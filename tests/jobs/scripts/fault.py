"""A job that goes wrong on purpose; tests/jobs/test_faults.py runs it under mpiexec.

Usage: fault.py CASE [TIMEOUT]
"""

import sys
import time

import numpy as np

import mpikv
from mpikv.store import config
from mpikv.tuning import table as tuning
from mpikv.store.kvstore import KVStore
from mpikv.transport.mpi import MPITransport


class _StuckInData(MPITransport):
    """Arrives at every agreement, then never joins a data collective."""

    def allreduce_(self, buf, what):
        time.sleep(300)


def _store(case, timeout):
    if case != "stuck_in_data":
        return mpikv.create("dist_sync", timeout=timeout)
    from mpi4py import MPI
    options = config.resolve(timeout=timeout, autotune=False)
    last = MPI.COMM_WORLD.size - 1
    transport = (_StuckInData if MPI.COMM_WORLD.rank == last else MPITransport)(
        MPI.COMM_WORLD, options)
    return KVStore("dist_sync", transport, options, tuning.forced("allreduce", "fault"))


def main(case, timeout):
    kv = _store(case, timeout)
    last = kv.num_workers - 1
    kv.init(["b", "w"], [np.zeros(3), np.zeros(3)])
    if case == "exception" and kv.rank == last:
        raise RuntimeError("boom on purpose")
    if case == "stuck" and kv.rank == last:
        time.sleep(300)
    if case == "other_store":
        # Every rank makes a second store; rank 1 then calls it while the others
        # push on the first: each side waits for the other.
        other = mpikv.create("dist_sync", timeout=timeout)
        kv.pushpull(["b", "w"], [np.ones(3), np.ones(3)])
        if kv.rank == 1:
            other.barrier()
    if case == "stuck_root" and kv.rank == 0:
        time.sleep(300)
    if case == "updater_raises":
        def update(key, value, stored):
            raise ValueError(f"bad update of {key}")
        kv.set_updater(update)
    if case == "mpikv_error" and kv.rank == 0:
        kv.push(["b", "w"], [np.zeros(3), np.zeros(4)])  # uncaught ShapeError on every rank
    kv.push(["w", "b"], [np.ones(3), np.ones(3)])
    out = np.zeros(3)
    kv.pull("w", out=out)
    print(f"rank {kv.rank}: finished with {out.tolist()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 30.0)
