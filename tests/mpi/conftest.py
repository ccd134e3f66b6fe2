"""Fixtures for collective tests (run under mpiexec with ``--with-mpi``)."""

import collections
import sys
import time

import numpy as np
import pytest

import mpikv
from mpikv.arrays import backends
from mpikv.transport import cuda

from .. import fakecupy
from ..conftest import FAILED

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


#: how long a rank waits at teardown for the others to say how their test went: a rank
#: waiting for a peer in a store call sees that call time out first (TEST_TIMEOUT)
TEARDOWN_BOUND = TEST_TIMEOUT + 30


@pytest.fixture
def make_store(request):
    """``make_store(**options)``: a ``dist_sync`` store (``timeout=TEST_TIMEOUT`` unless
    given; ``name=`` for another type), ended with the test by :func:`end_stores`."""
    made = []

    def make(name="dist_sync", **options):
        options.setdefault("timeout", TEST_TIMEOUT)
        store = mpikv.create(name, **options)
        made.append(store)
        return store

    yield make
    end_stores(request.node, made)


@pytest.fixture
def kv(make_store):
    return make_store()


@pytest.fixture
def kv_split(make_store):
    """A store that splits arrays of 10 elements or more over the owners."""
    return make_store(bigarray_bound=10)


def end_stores(item, stores):
    """Ends the stores a test made, newest first: closed (collective) where the test
    passed on every rank (:func:`passed_everywhere`), else abandoned on this rank
    alone (no collective call: no hang, no second error; the test's own failure is
    the report). Closing a store again does nothing."""
    if passed_everywhere(item):
        for store in reversed(stores):
            store.close()
    else:
        for store in reversed(stores):
            store.abandon()
            _ABANDONED.add(id(store))


# -- stores left open by a test: ended too, counted, reported at the session's end ----
def open_stores():
    """The distributed stores not closed yet on this rank."""
    from mpikv.store import factory
    return factory.open_stores()


_LEFT_OPEN = collections.Counter()   # test file -> stores its tests left to the net
_ABANDONED = set()                   # ids of the stores abandoned after a failed test


@pytest.fixture(autouse=True)
def _stores_ended(request):
    """Stores a test made without :func:`make_store` (``mpikv.create`` itself, a
    Trainer it did not close) and left open are ended as ``make_store`` ends its
    own, and counted per file (the report at the end of the session)."""
    before = {id(s) for s in open_stores()}
    yield
    left = [s for s in open_stores() if id(s) not in before | _ABANDONED]
    if left:
        _LEFT_OPEN[request.node.location[0]] += len(left)
    end_stores(request.node, left)   # (on every rank, left or not: one agreement a test)


def _still_open():
    return [s for s in open_stores() if id(s) not in _ABANDONED]


def pytest_sessionfinish(session):
    """The run fails if a store is still open at its end (one abandoned after a failed
    test aside): each test must end what it made."""
    if _still_open() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI
    still = _still_open()
    terminalreporter.write_line(
        f"rank {MPI.COMM_WORLD.rank}: {len(still)} stores open at the end"
        f"{' (the run fails: every test must end the stores it made)' if still else ''}"
        f", {len(open_stores()) - len(still)} abandoned after a failed test; "
        f"{sum(_LEFT_OPEN.values())} left open by tests and ended at their teardown: "
        f"{dict(_LEFT_OPEN.most_common())}")


# -- whether a test passed on every rank, asked once at its teardown ------------------
_PASSED_EVERYWHERE = pytest.StashKey[bool]()
_TEARDOWN = []      # [the communicator of the teardown agreements]
_UNANSWERED = []    # agreements some rank did not join in time (MPI must keep them)


@pytest.fixture(scope="session", autouse=True)
def _teardown_comm():
    """The communicator of :func:`passed_everywhere`, made (collectively) before the
    first test on every rank."""
    from mpi4py import MPI
    _TEARDOWN.append(MPI.COMM_WORLD.Dup())
    yield


def passed_everywhere(item):
    """Whether ``item``'s setup and call passed on every rank; False where some rank
    does not say so within :data:`TEARDOWN_BOUND` seconds. Asked once a test (the
    answer is kept), on every rank.

    Collective over COMM_WORLD, but never blocking past the bound: a nonblocking
    ``Iallreduce`` on a communicator of its own, so that one left unanswered
    cannot be matched with a test's own collectives later.
    """
    if _PASSED_EVERYWHERE in item.stash:
        return item.stash[_PASSED_EVERYWHERE]
    from mpi4py import MPI
    mine = np.array([0 if item.stash.get(FAILED, False) else 1], np.int32)
    everyone = np.zeros(1, np.int32)
    request = _TEARDOWN[0].Iallreduce(mine, everyone, op=MPI.MIN)
    deadline = time.monotonic() + TEARDOWN_BOUND
    answered = request.Test()
    while not answered and time.monotonic() < deadline:
        time.sleep(0.001)
        answered = request.Test()
    if not answered:
        _UNANSWERED.append((request, mine, everyone))
    item.stash[_PASSED_EVERYWHERE] = verdict = answered and bool(everyone[0])
    return verdict


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
