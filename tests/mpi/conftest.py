"""Fixtures for collective tests (run under mpiexec with ``--with-mpi``)."""

import pytest

import mpikv
from mpikv import backends
from mpikv.transport import cuda

from .. import fakecupy

# A bug must end a test job quickly, not hang it for the default 10 minutes.
TEST_TIMEOUT = 120


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared_dir(comm):
    """A directory every rank names the same: made on rank 0, its path broadcast."""
    import shutil
    import tempfile
    path = comm.bcast(tempfile.mkdtemp(prefix="mpikv-shared-") if comm.rank == 0 else None,
                      root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kv():
    return mpikv.create("dist_sync", timeout=TEST_TIMEOUT)


@pytest.fixture
def kv_split():
    """A store that splits arrays of 10 elements or more over the owners."""
    return mpikv.create("dist_sync", timeout=TEST_TIMEOUT, bigarray_bound=10)


def raises_everywhere(comm, exc, call):
    """Runs ``call``; asserts it raised ``exc`` with the same message on every rank."""
    try:
        call()
        got = None
    except exc as e:
        got = f"{type(e).__name__}: {e}"
    everyone = comm.allgather(got)
    assert all(m is not None for m in everyone), everyone
    assert len(set(everyone)) == 1, everyone
    return everyone[0]


# -- GPU values: real cupy where a GPU is, else tests/fakecupy.py, staged or direct ----
WAYS = ["cupy", "stand-in-staged", "stand-in-direct"]


@pytest.fixture(params=WAYS)
def cp(request, comm, monkeypatch):
    """cupy, three ways (see ``tests/mpi/test_gpu.py``), on GPU ``rank % device_count``."""
    if request.param == "cupy":
        if not backends.cupy_available():
            pytest.skip("cupy not installed / no GPU")
        import cupy
    else:
        cupy = fakecupy.install(monkeypatch)
        monkeypatch.setenv(cuda.ENV, "1" if request.param.endswith("direct") else "0")
        monkeypatch.setattr(cuda, "FALLBACK", cuda.Fallback())
    device = cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount())
    with device:
        yield cupy
    if request.param != "cupy":  # nothing was read before the GPU had finished writing it
        assert fakecupy.races() == []


# -- torch.distributed over gloo on the same ranks, for comparisons with DDP ---------
@pytest.fixture(scope="module")
def gloo():
    import torch.distributed as dist
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
    yield dist
    dist.destroy_process_group()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_torch():
    """Whether CUDA torch and cupy see a GPU (for the tests that need a real one)."""
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, or no driver
        return False
