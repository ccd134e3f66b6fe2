"""A stream-race stress on a real GPU: one 256 MiB float32 key on a
``dist_sync_device`` store, 50 ``a += 1`` kernels queued before each
``pushpull`` (and ``pushpull_async`` + ``wait``), 10 rounds; the sum must be
exact. Large buffers and queued kernels make a missing synchronization
visible: MPI (or the staging copy) reading ``a`` before the kernels finish
sums stale values, and a reader after the call that is not ordered after the
store's copies sees stale results.

Run (GPU only; skipped without one):
``scripts/mpirun.sh -n 2 python -m pytest tests/gpu/test_stream_race.py --with-mpi``.
"""

import numpy as np
import pytest

import mpikv

pytestmark = pytest.mark.mpi

ELEMENTS = 64 * 2**20    # 256 MiB of float32
KERNELS = 50
ROUNDS = 10


@pytest.mark.parametrize("how", ["pushpull", "pushpull_async", "pushpull on a side stream"])
def test_queued_kernels_before_pushpull(cp, how):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    kv = mpikv.create("dist_sync_device", timeout=300)
    kv.init("big", cp.zeros(ELEMENTS, cp.float32))
    a = cp.empty(ELEMENTS, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True) if how.endswith("side stream") else None
    bad = []
    for rnd in range(ROUNDS):
        with stream if stream is not None else _null():
            a.fill(r + rnd)
            for _ in range(KERNELS):
                a += 1            # queued on the current stream; nobody waits for them
            if how == "pushpull_async":
                kv.wait(kv.pushpull_async("big", a))
            else:
                kv.pushpull("big", a)
            # sum over ranks of (rank + rnd + KERNELS): small integers, exact in float32
            want = n * (n - 1) // 2 + n * (rnd + KERNELS)
            first, last = float(a[0].get()), float(a[-1].get())
            wrong = int((a != want).sum().get())
        if (first, last, wrong) != (want, want, 0):
            bad.append((rnd, first, last, wrong, want))
    kv.close()
    everyone = comm.allgather(bad)
    assert everyone == [[]] * n, everyone


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
