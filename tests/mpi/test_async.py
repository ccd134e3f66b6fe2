"""Asynchronous calls: values, order with synchronous calls, priorities, errors up front."""

import numpy as np
import pytest

from mpikv import errors, optimizer

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi


#: the options of every store here
OPTIONS = dict(bigarray_bound=50, bucket_bytes=256)


def test_many_async_pushpulls_then_wait(make_store, comm):
    kv = make_store(**OPTIONS)
    keys = list(range(20))
    kv.init(keys, [np.zeros(10 + k) for k in keys])
    values = [[np.full(10 + k, float(step * 100 + k + comm.rank)) for k in keys]
              for step in range(5)]
    handles = [kv.pushpull_async(keys, v) for v in values]
    kv.wait(handles[-1])
    kv.wait()
    assert all(h.done() for h in handles)
    ranks = sum(range(comm.size))
    for step, v in enumerate(values):
        for k, arr in zip(keys, v):
            assert (arr == comm.size * (step * 100 + k) + ranks).all(), (step, k)


def test_async_then_sync_keeps_order(make_store, comm):
    kv = make_store(**OPTIONS)
    kv.init(1, np.zeros(60))  # split over the owners
    kv.set_optimizer(optimizer.SGD(learning_rate=1.0))
    h = kv.push_async(1, np.ones(60))
    out = np.zeros(60)
    kv.pull(1, out=out)  # runs after the push
    assert h.done()
    assert (out == -comm.size).all()
    h2 = kv.pull_async(1, out=out)
    kv.push(1, np.ones(60))
    kv.synchronize()
    assert h2.done()
    kv.pull(1, out=out)
    assert (out == -2 * comm.size).all()


def test_priorities_per_key(make_store, comm):
    kv = make_store(**OPTIONS)
    keys = list(range(8))
    kv.init(keys, [np.zeros(30) for _ in keys])
    vals = [np.full(30, float(k)) for k in keys]
    kv.pushpull(keys, vals, priority=[-k for k in keys])
    assert all((v == k * comm.size).all() for k, v in zip(keys, vals))
    msg = raises_everywhere(comm, errors.InputError,
                            lambda: kv.push(keys, vals, priority=[1, 2]))
    assert "one int per key" in msg


def test_async_errors_are_raised_at_the_call_on_every_rank(make_store, comm):
    kv = make_store(**OPTIONS)
    kv.init(1, np.zeros(3))
    bad = np.zeros(4) if comm.rank == 0 else np.zeros(3)
    raises_everywhere(comm, errors.ShapeError, lambda: kv.push_async(1, bad))
    # The store is still usable, and the next call sums as it should.
    value = np.ones(3)
    h = kv.pushpull_async(1, value)
    kv.wait(h)
    assert h.done() and (value == comm.size).all()
