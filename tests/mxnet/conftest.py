"""Fixtures of the MXNet tests (tests/mxnet): MXNet's own clients on mpikv.

Every test module skips itself where MXNet is not installed; this file does
not import MXNet. Collective tests are marked ``mpi`` and run under
``mpiexec ... pytest --only-mpi``; the others run in one process.
"""

import os
import tempfile

import pytest

# A bug must end a test job quickly, not hang it for the default 10 minutes.
TEST_TIMEOUT = 120


@pytest.fixture(autouse=True)
def _timeout(monkeypatch):
    monkeypatch.setenv("MPIKV_TIMEOUT", str(TEST_TIMEOUT))


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared_dir(comm):
    """A directory every rank sees (this machine's temp dir), made by rank 0."""
    path = tempfile.mkdtemp(prefix="mpikv-mxnet-") if comm.rank == 0 else None
    path = comm.bcast(path)
    yield path
    comm.barrier()
    if comm.rank == 0:
        import shutil
        shutil.rmtree(path, ignore_errors=True)


def same_on_every_rank(comm, arrays):
    """Asserts every rank holds bit-identical arrays."""
    import numpy as np
    mine = [np.ascontiguousarray(a).tobytes() for a in arrays]
    assert all(other == mine for other in comm.allgather(mine))


os.environ.setdefault("OMP_NUM_THREADS", "1")   # 4 ranks on 2 cores: no thread pools fighting
