"""kv.run at 1-4 ranks without a loss: the steps, the exact sum on any rank count, and
a bad argument on one rank only raising on every rank (no rank left waiting)."""

import numpy as np
import pytest

import mpikv

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi


def _accumulate(key, pushed, stored):
    stored += pushed


def _accumulating(make_store):
    """A store that adds what is pushed to what it holds, "w" zeros."""
    kv = make_store()
    kv.set_updater(_accumulate)
    kv.init("w", np.zeros(3))
    return kv


def test_run_sums_each_batch_once_on_any_rank_count(make_store, shared_dir):
    kv = _accumulating(make_store)
    calls = []

    def step_fn(kv, i):
        calls.append(i)
        batch = np.arange(12 * 3, dtype=np.float64).reshape(12, 3) * (i + 1)
        n, r = kv.num_workers, kv.rank
        kv.push("w", batch[r * 12 // n:(r + 1) * 12 // n].sum(axis=0))
    assert kv.run(step_fn, 5, shared_dir, every=2) is kv
    assert calls == [0, 1, 2, 3, 4]
    out = np.zeros(3)
    kv.pull("w", out=out)
    want = np.arange(36.0).reshape(12, 3).sum(axis=0) * 15   # (1 + ... + 5) x the batch
    assert out.tolist() == want.tolist()
    kv.close()


def test_a_bad_argument_on_one_rank_raises_on_every_rank(make_store, comm, shared_dir):
    kv = _accumulating(make_store)
    every = 0 if comm.rank == comm.size - 1 else 2
    said = raises_everywhere(comm, mpikv.InputError,
                             lambda: kv.run(lambda kv, i: None, 3, shared_dir, every=every))
    assert "kv.run: every must be a positive int, not 0" in said
    kv.close()


def test_a_bad_redundancy_on_one_rank_raises_on_every_rank(make_store, comm, shared_dir):
    kv = _accumulating(make_store)
    redundancy = "disk" if comm.rank == comm.size - 1 else "memory"
    said = raises_everywhere(comm, mpikv.InputError, lambda: kv.run(
        lambda kv, i: None, 3, shared_dir, every=2, redundancy=redundancy))
    assert "kv.run: redundancy must be 'checkpoint' or 'memory', not 'disk'" in said
    kv.close()
