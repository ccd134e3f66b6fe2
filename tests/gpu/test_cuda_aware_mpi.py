"""The direct path on a real GPU, with a CUDA-aware MPI (issue 41): the store's
detection says CUDA-aware, device buffers go to MPI as they are, and a rank that
stages makes every rank stage.

Run (a GPU and the Open MPI of ``scripts/build-cuda-mpi.sh``; skipped otherwise):
``MPIKV_MPI_PREFIX=.cuda-mpi scripts/mpirun.sh -n 2 python -m pytest tests/gpu/test_cuda_aware_mpi.py --with-mpi``.
``MPIKV_EXPECT_CUDA_AWARE=1`` (``scripts/gpu-check.sh`` sets it) turns "MPI is not
CUDA-aware here" into a failure: the check must not pass by skipping.
"""

import os

import numpy as np
import pytest

import mpikv
from mpikv.transport import cuda

pytestmark = pytest.mark.mpi

EXPECT = "MPIKV_EXPECT_CUDA_AWARE"


@pytest.fixture
def aware(cp):
    """The detection's :class:`~mpikv.transport.cuda.Decision`, where it says CUDA-aware."""
    if os.environ.get(cuda.ENV, "").strip():
        pytest.skip(f"{cuda.ENV} is set: the detection is not asked")
    from mpi4py import MPI
    decision = cuda.detect()
    if not decision.aware:
        text = (f"MPI is not CUDA-aware here ({decision.source}; {decision.detail}; "
                f"{MPI.Get_library_version().strip(chr(0)).splitlines()[0]})")
        if os.environ.get(EXPECT, "").strip() == "1":
            pytest.fail(text)
        pytest.skip(text)
    return decision


def test_the_library_itself_says_cuda_aware(aware):
    from mpi4py import MPI
    # Open MPI 5's MPIX_Query_cuda_support() is true only once its CUDA accelerator
    # component loaded (the driver and a device found), not merely when built with CUDA.
    assert aware.source == "MPIX_Query_cuda_support() (library)", aware
    assert MPI.COMM_WORLD.allgather(aware.aware) == [True] * MPI.COMM_WORLD.size


@pytest.mark.parametrize("elements", [1, 1000, 2**20, 16 * 2**20])
def test_raw_collectives_on_device_buffers(cp, aware, elements):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    send = cp.full(elements, r + 1, cp.float32)
    recv = cp.empty(elements, cp.float32)
    cp.cuda.get_current_stream().synchronize()   # MPI reads the memory, not the stream
    comm.Allreduce(send, recv, op=MPI.SUM)
    assert int((recv != n * (n + 1) // 2).sum().get()) == 0
    b = cp.full(elements, r + 7, cp.int32)
    cp.cuda.get_current_stream().synchronize()
    comm.Bcast(b, root=n - 1)
    assert int((b != n + 6).sum().get()) == 0
    gathered = cp.empty(elements * n, cp.float32)
    comm.Allgather(send, gathered)
    want = np.repeat(np.arange(1, n + 1, dtype=np.float32), elements)
    np.testing.assert_array_equal(gathered.get(), want)


def test_the_store_takes_the_direct_path(cp, aware):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    kv = mpikv.create("dist_sync_device", timeout=120)
    try:
        facts = kv.describe()
        assert facts["cuda_paths"] == {"reduce": "direct", "pull": "direct"}, facts
        kv.init("w", cp.zeros(3 * 2**20, cp.float32))
        kv.init("b", cp.zeros(1000, cp.float32))
        for step in range(3):
            g = cp.full(3 * 2**20, r + 1 + step, cp.float32)
            kv.pushpull("w", g)
            assert int((g != n * (n + 1) // 2 + n * step).sum().get()) == 0
            small = cp.full(1000, r, cp.float32)
            out = cp.empty(1000, cp.float32)
            kv.pushpull("b", small, out=out)
            assert int((out != n * (n - 1) // 2).sum().get()) == 0
        after = kv.describe()["cuda"]
        # no MPI error on a device buffer made the process fall back to staging
        assert after["device_path"] == "direct" and after["device_fallback"] is False, after
    finally:
        kv.close()


def test_a_rank_that_stages_makes_every_rank_stage(cp, aware, monkeypatch):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    if comm.rank == 0:
        monkeypatch.setenv(cuda.ENV, "0")
    kv = mpikv.create("dist_sync_device", timeout=120)
    try:
        assert kv.describe()["cuda_paths"] == {"reduce": "staged", "pull": "staged"}
        kv.init("w", cp.zeros(2**20, cp.float32))
        g = cp.full(2**20, comm.rank + 1, cp.float32)
        kv.pushpull("w", g)
        assert int((g != comm.size * (comm.size + 1) // 2).sum().get()) == 0
    finally:
        kv.close()
