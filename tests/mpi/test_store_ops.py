"""The store operations for the layers above, at 1-4 ranks: agree and
load_owned_states agree across ranks and fail on every rank alike."""

import numpy as np
import pytest

import mpikv
from mpikv import errors

from .conftest import TEST_TIMEOUT, raises_everywhere

pytestmark = pytest.mark.mpi


def _store():
    kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT, bigarray_bound=10)
    kv.init("w", np.arange(40, dtype=np.float32))   # split over the owners
    kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    kv.push("w", np.ones(40, np.float32))
    return kv


def test_owned_states_are_this_ranks_parts(comm):
    kv = _store()
    owned = kv.owned_states(["w"])["w"]
    starts = comm.allgather([(p.start, p.stop) for p in owned.parts])
    covered = sorted(part for parts in starts for part in parts)
    assert covered[0][0] == 0 and covered[-1][1] == 40
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for part in owned.parts:
        assert part.whole is (comm.size == 1)
        assert part.state["mom"].tolist() == [-0.5 * comm.size] * (part.stop - part.start)
    kv.close()


def test_a_check_failed_on_one_rank_loads_nothing_on_any(comm):
    kv = _store()
    fresh = {("w", p.start): {"mom": np.full(p.stop - p.start, 2.0, np.float32)}
             for p in kv.owned_states(["w"])["w"].parts}
    if comm.rank == comm.size - 1:
        kv.fail_next_call(errors.OptimizerError, "rank's check failed")
    message = raises_everywhere(comm, errors.OptimizerError,
                                lambda: kv.load_owned_states(fresh))
    assert "rank's check failed" in message
    for part in kv.owned_states(["w"])["w"].parts:
        assert part.state["mom"].tolist() == [-0.5 * comm.size] * (part.stop - part.start)
    kv.load_owned_states(fresh)   # agreed: loaded on every rank
    for part in kv.owned_states(["w"])["w"].parts:
        assert part.state["mom"].tolist() == [2.0] * (part.stop - part.start)
    kv.close()


def test_a_part_not_owned_fails_on_every_rank(comm):
    kv = _store()
    theirs = {("w", 0): {"mom": np.zeros(1, np.float32)}} if comm.rank == comm.size - 1 else {}
    mine = {p.start for p in kv.owned_states(["w"])["w"].parts}
    if 0 in mine:
        theirs = {("w", 1): {"mom": np.zeros(1, np.float32)}}
    message = raises_everywhere(comm, errors.InputError, lambda: kv.load_owned_states(theirs))
    assert "does not own the part of key 'w'" in message
    kv.close()


def test_agree_is_a_call_every_rank_makes(comm):
    kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)
    kv.agree("Trainer.close")
    if comm.size > 1:
        message = raises_everywhere(
            comm, errors.MismatchError,
            lambda: kv.agree("Trainer.close") if comm.rank == 0 else kv.barrier())
        assert "Trainer.close" in message
    kv.close()
    kv.agree("Trainer.close")   # closed: nothing
