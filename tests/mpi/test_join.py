"""kv.join(): a rank that ran out of batches adds zeros until every rank has joined.

Every case is checked against a one-process reference that pushes, step by
step, the sum over the ranks that still had a batch (the zero-padded sums).
Gradients are small integers and the rates powers of two, so the reference
is exact.
"""

import numpy as np
import pytest

import mpikv
from mpikv.store.join import ReplayedCall, contribution as _contribution

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi

#: key -> shape: a fused pair, and one split over the owners (bigarray_bound=50)
SHAPES = {"a": (3,), "b": (2, 2), "split": (120,)}
BASE = 3


def gradient(rank, step, key):
    size = int(np.prod(SHAPES[key]))
    return ((rank + 1) * (step + 1) + np.arange(size) % 3).astype(np.float64).reshape(SHAPES[key])


def batches(rank, size, extra):
    """``BASE`` batches, and ``extra`` more on one rank."""
    return BASE + (extra if rank == extra % size else 0)


def reference(size, extra, optimizer):
    """The stored values after every step, from the zero-padded sums on a local store."""
    kv = mpikv.create("local")
    keys = list(SHAPES)
    kv.init(keys, [np.ones(SHAPES[k]) for k in keys])
    if optimizer:
        kv.set_optimizer(make_optimizer())
    steps = max(batches(r, size, extra) for r in range(size))
    for step in range(steps):
        sums = [sum(gradient(r, step, k) for r in range(size) if step < batches(r, size, extra))
                for k in keys]
        kv.push(keys, sums)
    out = [np.empty(SHAPES[k]) for k in keys]
    kv.pull(keys, out=out)
    return dict(zip(keys, out))


def make_optimizer():
    return mpikv.optimizer.SGD(learning_rate=0.5, momentum=0.5, wd=0.25)


def _push_pull(kv, keys, grads, bufs):
    kv.push(keys, grads)
    out = [np.empty_like(g) for g in grads]
    kv.pull(keys, out=out)


def _pushpull(kv, keys, grads, bufs):
    kv.pushpull(keys, grads)


def _one_key(kv, keys, grads, bufs):
    for key, grad in zip(keys, grads):   # the repeated one-key route after the first step
        kv.pushpull(key, grad)


def _async(kv, keys, grads, bufs):
    handles = [kv.push_async(key, grad, priority=-i) for i, (key, grad) in enumerate(zip(keys, grads))]
    kv.wait(handles)
    kv.wait(kv.pull_async(keys, out=[np.empty_like(g) for g in grads]))


def _zero_copy(kv, keys, grads, bufs):
    for buf, grad in zip(bufs, grads):
        buf[...] = grad
    kv.pushpull(keys, bufs)


MODES = {"push_pull": _push_pull, "pushpull": _pushpull, "one_key": _one_key,
         "async": _async, "zero_copy": _zero_copy}


@pytest.mark.parametrize("extra", [1, 2, 3])
@pytest.mark.parametrize("optimizer", [False, True], ids=["assign", "sgd"])
@pytest.mark.parametrize("mode", list(MODES))
def test_join_adds_zeros_until_every_rank_joined(make_store, comm, mode, optimizer, extra):
    kv = make_store(bigarray_bound=50)
    rank, size = kv.rank, kv.num_workers
    keys = list(SHAPES)
    kv.init(keys, [np.ones(SHAPES[k]) for k in keys])
    if optimizer:
        kv.set_optimizer(make_optimizer())
    bufs = kv.gradient_buffers(keys) if mode == "zero_copy" else None
    for step in range(batches(rank, size, extra)):
        MODES[mode](kv, keys, [gradient(rank, step, k) for k in keys], bufs)
    last = kv.join()
    # The rank with extra batches joined last (alone, unless one rank).
    assert last == (extra % size if size > 1 else 0)
    out = [np.empty(SHAPES[k]) for k in keys]
    kv.pull(keys, out=out)
    expected = reference(size, extra, optimizer)
    for key, got in zip(keys, out):
        np.testing.assert_array_equal(got, expected[key], err_msg=f"key {key} at rank {rank}")
    everyone = comm.allgather([o.tobytes() for o in out])
    assert all(e == everyone[0] for e in everyone)


def test_join_takes_part_in_barriers_and_gather_gradients(make_store, comm):
    kv = make_store(bigarray_bound=50)
    rank = kv.rank
    keys = list(SHAPES)
    kv.init(keys, [np.zeros(SHAPES[k]) for k in keys])
    kv.set_optimizer(make_optimizer())
    bufs = kv.gradient_buffers(keys)
    if rank == 0:   # the others join at once
        for buf, key in zip(bufs, keys):
            buf[...] = gradient(0, 0, key)
        kv.push(keys, bufs)
        kv.gather_gradients(keys)
        kv.barrier()
        for buf, key in zip(bufs, keys):   # rank 0's gradients plus the joined ranks' zeros
            np.testing.assert_array_equal(buf, gradient(0, 0, key))
    assert kv.join() == 0


def test_join_on_every_rank_at_once_returns_the_highest_rank(make_store, comm):
    kv = make_store()
    kv.init("k", np.zeros(4))
    assert kv.join() == kv.num_workers - 1
    kv.pushpull("k", np.ones(4))   # the store goes on after a join
    out = np.empty(4)
    kv.pull("k", out=out)
    np.testing.assert_array_equal(out, np.full(4, kv.num_workers))


def test_calls_joined_ranks_cannot_take_part_in_are_errors_on_the_others(make_store, comm):
    if comm.Get_size() == 1:
        pytest.skip("needs a joined rank and a rank still training")
    kv = make_store()
    kv.init("k", np.zeros(4))
    rank = kv.rank
    training = comm.Split(0 if rank == 0 else 1, rank)
    if rank == 0:
        assert kv.join() == kv.num_workers - 1
        return
    raises_everywhere(training, mpikv.MismatchError, lambda: kv.init("new", np.zeros(2)))
    # A bad call among the ranks still training: theirs to raise, the joined rank waits.
    bad = np.zeros(5 if rank == 1 else 4)
    message = raises_everywhere(training, mpikv.MPIKVError, lambda: kv.push("k", bad))
    assert "nothing was applied" in message
    kv.push("k", np.ones(4))
    out = np.empty(4)
    kv.pull("k", out=out)
    np.testing.assert_array_equal(out, np.full(4, kv.num_workers - 1))
    assert kv.join() == kv.num_workers - 1


def test_init_message_names_the_joined_ranks(make_store, comm):
    if comm.Get_size() == 1:
        pytest.skip("needs a joined rank and a rank still training")
    kv = make_store()
    training = comm.Split(0 if kv.rank == 0 else 1, kv.rank)
    if kv.rank == 0:
        kv.join()
        return
    message = raises_everywhere(training, mpikv.MismatchError, lambda: kv.init("x", np.zeros(2)))
    assert message == ("MismatchError: init: rank 0 joined (kv.join()); until every rank has, "
                       "only push, pull, pushpull, barrier, gather_gradients, allreduce_ can run; "
                       "nothing was applied")
    kv.join()


# -- allreduce_ and on_call -------------------------------------------------------------
#: allreduce_ arrays of each round: (shape, dtype)
SUMS = [((5,), np.float64), ((2, 3), np.float32), ((4,), np.int64)]


def rounds(rank, size):
    """The last rank joins at once; rank 0 makes two rounds more than the others."""
    if rank == size - 1:
        return 0
    return 2 + (2 if rank == 0 else 0)


def summand(rank, step, shape, dtype):
    return (np.arange(int(np.prod(shape))).reshape(shape) + 10 * step + rank + 1).astype(dtype)


def _store_of_zeros(make_store, comm):
    """A store holding zeros under every key of SHAPES, and its keys; skips on one rank."""
    if comm.Get_size() == 1:
        pytest.skip("needs a joined rank and a rank still training")
    kv = make_store(bigarray_bound=50)
    keys = list(SHAPES)
    kv.init(keys, [np.zeros(SHAPES[k]) for k in keys])
    return kv, keys


def test_join_replays_allreduce_with_zeros(make_store, comm):
    kv, keys = _store_of_zeros(make_store, comm)
    rank, size = kv.rank, kv.num_workers
    for step in range(rounds(rank, size)):
        active = [r for r in range(size) if step < rounds(r, size)]
        grads = [gradient(rank, step, k) for k in keys]
        kv.pushpull(keys, grads)
        for key, got in zip(keys, grads):   # the sum of the ranks with data: zeros added
            np.testing.assert_array_equal(got, sum(gradient(r, step, key) for r in active))
        for shape, dtype in SUMS:
            array = summand(rank, step, shape, dtype)
            kv.allreduce_(array)
            np.testing.assert_array_equal(
                array, sum(summand(r, step, shape, dtype) for r in active), err_msg=str(dtype))
        kv.pushpull(keys[0], np.ones(SHAPES[keys[0]]))   # a one-key call between the sums
    assert kv.join() == 0   # rank 0 joined last
    out = [np.empty(SHAPES[k]) for k in keys]
    kv.pull(keys, out=out)   # the joined ranks hold the last round's sums
    last = rounds(0, size) - 1
    for key, got in zip(keys[1:], out[1:]):
        np.testing.assert_array_equal(got, gradient(0, last, key))
    np.testing.assert_array_equal(out[0], np.ones(SHAPES[keys[0]]))


def test_on_call_sees_each_replayed_call_and_gives_the_allreduce_array(make_store, comm):
    kv, keys = _store_of_zeros(make_store, comm)
    rank, size = kv.rank, kv.num_workers
    bufs = kv.gradient_buffers(keys)
    joined = size - 1
    training = comm.Split(0 if rank == joined else 1, rank)
    if rank == joined:
        seen, mine = [], np.full(3, 100.0)

        def on_call(call):
            assert isinstance(call, ReplayedCall)
            seen.append((call.op, sorted(call.keys), call.done,
                         None if call.array is None else call.array.copy()))
            if call.op == "allreduce_" and not call.done:
                assert (call.settings["shape"], call.settings["dtype"]) == ("(3,)", "float64")
                return mine
            return None
        assert kv.join(on_call=on_call) == size - 2
        ops = [op for op, _, done, _ in seen if not done]
        assert ops == ["push", "pull", "pushpull", "barrier", "push", "gather_gradients",
                       "allreduce_", "allreduce_"]
        assert [op for op, _, done, _ in seen if done] == ops   # each before, then after
        assert all(k == sorted(keys) for op, k, _, _ in seen if op not in ("barrier",
                                                                          "allreduce_"))
        trained = sum(range(1, size))   # the training ranks' r + 1
        for (op, _, done, array), want in zip(
                [s for s in seen if s[0] == "allreduce_"],
                [None, trained + 100, None, 2 * trained + 100]):
            np.testing.assert_array_equal(array, None if want is None else np.full(3, want))
        np.testing.assert_array_equal(mine, np.full(3, 2 * trained + 100))   # summed in place
        return
    grads = [gradient(rank, 0, k) for k in keys]
    kv.push(keys, grads)
    kv.pull(keys, out=[np.empty(SHAPES[k]) for k in keys])
    kv.pushpull(keys, grads)
    # Calls the joined rank does not see: bad ones, and ones it cannot take part in.
    raises_everywhere(training, mpikv.MPIKVError, lambda: kv.push("nokey", np.zeros(2)))
    raises_everywhere(training, mpikv.MismatchError, lambda: kv.init("new", np.zeros(2)))
    kv.barrier()
    for buf, grad in zip(bufs, grads):
        buf[...] = grad
    kv.push(keys, bufs)
    kv.gather_gradients(keys)
    array = np.full(3, rank + 1.0)
    kv.allreduce_(array)
    np.testing.assert_array_equal(array, np.full(3, sum(range(1, size)) + 100.0))
    array = np.full(3, rank + 1.0)
    kv.allreduce_(array)   # the joined rank gives its array again, holding the first sum
    np.testing.assert_array_equal(array, np.full(3, 2 * sum(range(1, size)) + 100.0))
    assert kv.join() == size - 2


def test_a_replayed_allreduce_takes_only_an_array_of_the_others_layout():
    settings = {"shape": "(2, 3)", "dtype": "float32"}
    zeros = _contribution(None, settings)
    assert zeros.shape == (2, 3) and zeros.dtype == np.float32 and not zeros.any()
    mine = np.ones((2, 3), np.float32)
    assert _contribution(mine, settings) is mine
    for bad in (np.ones((3, 2), np.float32), np.ones((2, 3)), np.ones((2, 6), np.float32)[:, ::2]):
        with pytest.raises(mpikv.ValueTypeError):
            _contribution(bad, settings)
    read_only = np.ones((2, 3), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(mpikv.ValueTypeError):
        _contribution(read_only, settings)
