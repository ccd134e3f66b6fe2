"""``kv.save_checkpoint_async``: what the call copied is what the checkpoint holds,
visible only once committed, at 1-4 ranks (issue 24)."""

import os
import threading

import numpy as np
import pytest

from mpikv import RowSparse, errors, optimizer, statefile

from .conftest import TEST_TIMEOUT, raises_everywhere

pytestmark = pytest.mark.mpi

SHAPES = {"a": (7, 5), "b": (33,), "c": (2, 3, 4)}


def _filled(make_store):
    """A store holding SHAPES, SGD with momentum and a row table; and its keys."""
    kv = make_store(bigarray_bound=16)
    keys = sorted(SHAPES, key=str)
    kv.init(keys, [np.arange(np.prod(SHAPES[k]), dtype=np.float64).reshape(SHAPES[k]) / 7
                   for k in keys])
    kv.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.init_rows("emb", (10, 3), np.float64, init=lambda lo, hi: np.full((hi - lo, 3), 1.0))
    return kv, keys


def _step(kv, keys, comm, scale):
    kv.push(keys, [np.full(SHAPES[k], scale * (comm.rank + 1)) for k in keys])
    ids = np.array([1, 4, 4, 9])
    kv.push("emb", RowSparse(ids, np.full((4, 3), scale), (10, 3)))


def _values(kv, keys):
    out = [np.empty(SHAPES[k]) for k in keys]
    kv.pull(keys, out)
    rows = kv.row_sparse_pull("emb", row_ids=np.arange(10))
    return [*out, rows.data.copy()]


def test_the_checkpoint_holds_what_the_call_copied(make_store, comm, shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "ck")
    kv, keys = _filled(make_store)
    _step(kv, keys, comm, 1.0)
    want = _values(kv, keys)
    # The writes start only once the next step changed every value and state.
    gate, write_part = threading.Event(), statefile.write_part

    def gated(*args):
        assert gate.wait(TEST_TIMEOUT)
        return write_part(*args)
    monkeypatch.setattr(statefile, "write_part", gated)
    handle = kv.save_checkpoint_async(path)
    _step(kv, keys, comm, 5.0)     # training goes on while the parts are written
    after = _values(kv, keys)
    assert not handle.done() and not os.path.exists(path)  # not written, not visible
    gate.set()
    handle.wait()
    assert handle.committed and handle.done() and os.path.exists(path)
    handle.wait()                    # a second wait commits nothing more
    # a store that loads it has the values (and momentum) of the call, not of later
    fresh, _ = _filled(make_store)
    fresh.load_checkpoint(path)
    for got, w in zip(_values(fresh, keys), want):
        np.testing.assert_array_equal(got, w)
    _step(fresh, keys, comm, 5.0)   # the same second step from the loaded state
    for got, w in zip(_values(fresh, keys), after):
        np.testing.assert_array_equal(got, w)
    kv.close()
    fresh.close()


@pytest.mark.parametrize("then", ["save_checkpoint", "save_checkpoint_async",
                                  "load_checkpoint", "close"])
def test_a_later_collective_call_commits_the_pending_save_first(make_store, comm, shared_dir, then):
    first, second = os.path.join(shared_dir, "first"), os.path.join(shared_dir, "second")
    kv, keys = _filled(make_store)
    want = _values(kv, keys)
    handle = kv.save_checkpoint_async(first)
    _step(kv, keys, comm, 2.0)
    if then == "load_checkpoint":
        kv.load_checkpoint(first)   # commits it, then loads it: the values of the call
        for got, w in zip(_values(kv, keys), want):
            np.testing.assert_array_equal(got, w)
    elif then == "close":
        kv.close()
    else:
        second_handle = getattr(kv, then)(second)
        if second_handle is not None:
            second_handle.wait()
        assert statefile.read_manifest(second).meta["kind"] == "checkpoint"
    assert handle.committed
    assert statefile.read_manifest(first).meta["num_workers"] == comm.size
    if then != "close":
        kv.close()


def test_a_write_that_fails_on_one_rank_fails_everywhere_and_commits_nothing(make_store,
        comm, shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "ck")
    kv, keys = _filled(make_store)
    kv.save_checkpoint(path)
    before = _values(kv, keys)
    if comm.rank == comm.size - 1:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(statefile, "write_part", full_disk)
    _step(kv, keys, comm, 3.0)
    handle = kv.save_checkpoint_async(path)
    text = raises_everywhere(comm, errors.StateFileError, handle.wait)
    assert "No space left on device" in text and "nothing was applied" in text
    handle.wait()   # the failure is raised once
    monkeypatch.undo()
    fresh, _ = _filled(make_store)
    fresh.load_checkpoint(path)   # the previous checkpoint, whole
    for got, w in zip(_values(fresh, keys), before):
        np.testing.assert_array_equal(got, w)
    kv.close()
    fresh.close()


def test_a_wait_on_some_ranks_only_is_a_mismatch_everywhere(make_store, comm, shared_dir):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    kv, keys = _filled(make_store)
    handle = kv.save_checkpoint_async(os.path.join(shared_dir, "ck"))
    call = handle.wait if comm.rank == 0 else (lambda: kv.barrier())
    text = raises_everywhere(comm, errors.MismatchError, call)
    assert "save_checkpoint_wait" in text
    kv.close()
    assert handle.committed
