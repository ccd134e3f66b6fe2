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


def test_local_states_come_back_to_their_ranks(comm, shared_dir):
    """Each rank's own arrays in the checkpoint: its own back on the same ranks, saved
    rank ``r % P``'s on other ranks, None from a file without them, none after remove."""
    path = f"{shared_dir}/local"
    kv = _store()
    mine = {"m": np.full((2, 3), comm.rank, np.float64), "step": np.array(comm.rank + 7)}
    handle = kv.add_local_state("layer", lambda: mine, lambda *a: None)
    kv.save_checkpoint(path)
    handle.remove()
    kv.save_checkpoint(f"{path}-without")
    kv.close()
    got = []

    def give(arrays, same):
        got.append((arrays, same))

    other = mpikv.create("dist_sync", timeout=TEST_TIMEOUT, bigarray_bound=10)
    other.add_local_state("layer", lambda: {}, give)
    other.load_checkpoint(path)
    other.load_checkpoint(f"{path}-without")
    other.close()
    (arrays, same), (none, _) = got
    assert same is True and none is None
    assert arrays["m"].shape == (2, 3) and arrays["m"].dtype == np.float64
    np.testing.assert_array_equal(arrays["m"], mine["m"])
    assert arrays["step"].shape == () and int(arrays["step"]) == comm.rank + 7
    # On one rank fewer (one rank: the same one): rank r takes saved rank r % P's.
    m = max(1, comm.size - 1)
    sub = comm.Split(0 if comm.rank < m else 1, comm.rank)
    if comm.rank < m:
        got.clear()
        fewer = mpikv.create("dist_sync", comm=sub, timeout=TEST_TIMEOUT, bigarray_bound=10)
        fewer.add_local_state("layer", lambda: {}, give)
        fewer.load_checkpoint(path)
        fewer.close()
        (arrays, same), = got
        assert same is (m == comm.size)
        assert int(arrays["step"]) == comm.rank % comm.size + 7
    sub.Free()
    comm.Barrier()
