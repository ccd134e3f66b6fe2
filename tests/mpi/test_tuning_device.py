"""The tuner's device dimension: GPU buffers are timed through the staging a store
uses, into ``device:`` columns, and the chooser takes a device bucket's strategy
from them (``cp``: real cupy where there is a GPU, else the stand-in, staged and
direct; see tests/mpi/test_gpu.py).

Run: ``scripts/mpirun.sh -n 2 python -m pytest tests/mpi/test_tuning_device.py --with-mpi``.
"""

import math

import numpy as np
import pytest

from mpikv.store import config
from mpikv import reducers
from mpikv.tuning import table as tuning
from mpikv.transport.mpi import MPITransport

from .conftest import TEST_TIMEOUT

pytestmark = pytest.mark.mpi

SIZES = (4096, 65536)


@pytest.fixture
def transport(cp, comm):
    # made after ``cp`` set MPIKV_CUDA_AWARE: its staging is the way under test
    t = MPITransport(comm, config.resolve(timeout=TEST_TIMEOUT, bucket_bytes=1024,
                                          autotune=False))
    yield t
    t.close()


def test_device_columns_are_measured_and_used(cp, comm, transport):
    times = tuning.measure(transport, SIZES, reps=1, device=True)
    assert set(times) == {(m, s) for m in tuning.DEVICE_MODES for s in SIZES}
    for (mode, _), per_name in times.items():
        assert sorted(per_name) == sorted(tuning.candidates(mode, transport))
        assert all(math.isfinite(t) and t > 0 for t in per_name.values())
    table = tuning.decide(times, "device measurement")
    # Host columns naming a strategy no device column names: a device bucket must not
    # get it, a host bucket must.
    table.winners.update({(m, s): "reduce_bcast_blocks" for m in tuning.MODES for s in SIZES})
    for m in tuning.DEVICE_MODES:
        for s in SIZES:
            if table.winners[(m, s)] == "reduce_bcast_blocks":
                table.winners[(m, s)] = "allreduce"
    chooser = reducers.Chooser(transport, table, transport.piece_bytes)
    for in_place, owners, mode in ((True, False, "in_place"), (False, False, "out_of_place"),
                                   (True, True, "to_owners")):
        red = chooser.get(None, 4096, in_place, device=True, owners=owners)
        assert red.name == "staged:" + table.winners[("device:" + mode, 4096)]
        assert chooser.get(None, 4096, in_place, owners=owners).name.endswith(
            "reduce_bcast_blocks")
    # The chosen device reducer sums each owner's block right, on the GPU.
    n, r = 1000, comm.rank
    red = chooser.get(None, n * 4, True, device=True, owners=True)
    blocks = reducers.even_blocks(n, comm.size)
    buf = cp.asarray(np.arange(n, dtype=np.float32) + r)
    red.reduce_to_owners(buf, None, blocks, ("test", []))
    lo, hi = blocks.displs[r], blocks.displs[r] + blocks.counts[r]
    want = comm.size * np.arange(n, dtype=np.float32) + sum(range(comm.size))
    np.testing.assert_array_equal(buf.get()[lo:hi], want[lo:hi])


def test_host_measurement_has_no_device_columns(cp, transport):
    times = tuning.measure(transport, (4096,), reps=1)
    assert {m for m, _ in times} == set(tuning.MODES)
    table = tuning.decide(times, "host")
    chooser = reducers.Chooser(transport, table, transport.piece_bytes)
    # device buckets use the host columns, as before the device dimension, except a
    # winner that stages every GPU buffer where MPI takes them directly
    winner = table.winners[("in_place", 4096)]
    if reducers.strategy_class(winner).host_only and transport.staging.direct:
        winner = "allreduce"
    assert chooser.get(None, 4096, True, device=True).name == "staged:" + winner


@pytest.mark.parametrize("node_of", [lambda r: r // 2, lambda r: r % 2, lambda r: r],
                         ids=["pairs", "strided", "one_per_node"])
@pytest.mark.parametrize("name", ["hierarchical", "copy+hierarchical"])
def test_hierarchical_to_the_owners_on_device_buffers(cp, comm, name, node_of):
    """Across nodes the leaders pack and unpack on the GPU where MPI takes device
    buffers: the copies must have run before MPI reads them (the stand-in checks)."""
    from mpikv.reducers.staged import StagedReducer
    t = MPITransport(comm, config.resolve(timeout=TEST_TIMEOUT, bucket_bytes=64,
                                          autotune=False), node_of=node_of)
    try:
        red = StagedReducer(reducers.make(name, t, 64), t.staging)
        n, r = 301, comm.rank
        blocks = reducers.even_blocks(n, comm.size)
        blocks = reducers.Blocks(blocks.counts[::-1], blocks.displs[::-1])   # out of order
        mine = cp.asarray(np.arange(n, dtype=np.float32) * (r + 1))
        dst = cp.zeros(n, cp.float32)
        red.reduce_to_owners(dst, mine, blocks, ("test", []))
        lo, hi = blocks.displs[r], blocks.displs[r] + blocks.counts[r]
        want = np.arange(n, dtype=np.float32) * sum(range(1, comm.size + 1))
        np.testing.assert_array_equal(dst.get()[lo:hi], want[lo:hi])
        np.testing.assert_array_equal(mine.get(), np.arange(n, dtype=np.float32) * (r + 1))
    finally:
        t.close()


def test_mpikv_tune_finds_the_gpus_and_times_the_device_columns(cp, transport):
    from mpikv.tools import tune
    assert tune._every_rank_has_a_gpu(transport)
    times = tune._measure_device(transport, (4096,), 1, lambda size: None)
    assert {m for m, _ in times} == set(tuning.DEVICE_MODES)
