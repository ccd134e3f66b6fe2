"""A store takes calls from one thread at a time (issue 38, class 7): a call while
another thread of the rank is in one is a ConcurrentCallError there, before any
collective, the other thread's call going on unaffected; the rank's next call then
fails on every rank with the same error class. Calls from several threads one
after another are fine."""

import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpikv
from mpikv.calls.agreement import format_ranks
from mpikv.store import config
from mpikv.store.kvstore import KVStore
from mpikv.transport.mpi import MPITransport
from mpikv.tuning import table as tuning

from .conftest import TEST_TIMEOUT, end_stores


class HeldTransport(MPITransport):
    """Holds its barrier, once ``hold`` is set, until the test releases it: a call
    of one thread stays inside the store for as long as the test needs."""

    hold = False

    def barrier(self, what):
        if self.hold:
            self.entered.set()
            assert self.release.wait(TEST_TIMEOUT)
        super().barrier(what)


@pytest.fixture
def held(request):
    """A store over a :class:`HeldTransport`, and the transport; ended with the test."""
    made = []

    def make():
        options = config.resolve(timeout=TEST_TIMEOUT, autotune=False)
        transport = HeldTransport(MPI.COMM_WORLD, options)
        transport.entered, transport.release = threading.Event(), threading.Event()
        kv = KVStore("dist_sync", transport, options, tuning.forced("allreduce", "threads"))
        made.append(kv)
        return kv, transport

    yield make
    end_stores(request.node, made)


def in_thread(fn):
    """Starts ``fn()`` on a thread; returns the thread and the list its exception
    (if any) goes to."""
    raised = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - the test asserts there was none
            raised.append(exc)
    thread = threading.Thread(target=run, name="first-caller")
    thread.start()
    return thread, raised


def test_a_call_while_another_thread_is_in_one_fails_on_every_rank(held):
    kv, transport = held()
    kv.init("w", np.zeros(3))
    transport.hold = True
    first, raised = in_thread(kv.barrier)
    try:
        assert transport.entered.wait(TEST_TIMEOUT)   # the first thread is in its barrier
        with pytest.raises(mpikv.ConcurrentCallError) as refused:
            kv.push("w", np.ones(3))
    finally:
        transport.hold = False
        transport.release.set()
        first.join(TEST_TIMEOUT)
    assert not first.is_alive() and raised == []   # the first thread's call went on
    message = str(refused.value)
    assert "push called from thread 'MainThread' while thread 'first-caller' was in this " \
           "store's barrier call: a store takes calls from one thread at a time" in message
    assert "nothing was applied" in message
    # The rank's next call: the same error class on every rank, nothing applied ...
    with pytest.raises(mpikv.ConcurrentCallError) as agreed:
        kv.push("w", np.ones(3))
    every = f"{format_ranks(list(range(kv.num_workers)))}: " if kv.num_workers > 1 else ""
    assert str(agreed.value).startswith(
        f"push: {every}refused earlier: "
        "push called from thread 'MainThread' while thread 'first-caller' was in this "
        "store's barrier call"), agreed.value
    assert str(agreed.value).endswith("; nothing was applied")
    # ... and then the store goes on.
    out = np.full(3, -1.0)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.zeros(3))
    kv.push("w", np.ones(3))
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.full(3, kv.num_workers))


def test_calls_from_several_threads_one_after_another_are_fine(kv):
    kv.init("w", np.zeros(3))
    first, raised = in_thread(lambda: kv.push("w", np.ones(3)))
    first.join(TEST_TIMEOUT)
    assert not first.is_alive() and raised == []
    handle = kv.push_async("w", np.ones(3))
    # Waiting on another thread, and a call of that thread, while the background
    # call may still run: the caller's thread is no longer in the store.
    second, raised = in_thread(lambda: (handle.wait(), kv.barrier()))
    second.join(TEST_TIMEOUT)
    assert not second.is_alive() and raised == []
    out = np.zeros(3)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.full(3, kv.num_workers))   # (a push replaces)
