"""Every SPEC row of a dist_sync store, at any number of ranks, with values checked."""

import numpy as np
import pytest

import mpikv
from mpikv import errors

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi
SHAPE = (2, 3)


def pulled(kv, key, shape=SHAPE, dtype=np.float64):
    out = np.zeros(shape, dtype)
    kv.pull(key, out=out)
    return out


def test_properties(make_store, kv, comm):
    assert kv.type == "dist_sync"
    assert kv.rank == comm.rank
    assert kv.num_workers == comm.size
    assert make_store("dist_sync_device").type == "dist_sync_device"


def test_init_takes_rank_zeros_value(kv, comm):
    kv.init(3, np.full(SHAPE, 2.0 + comm.rank))
    assert (pulled(kv, 3) == 2).all()


def test_seed_tutorial_sums_over_ranks(kv, comm, capfd):
    n = comm.size
    kv.init(3, np.ones(SHAPE) * 2)
    kv.push(3, np.ones(SHAPE) * 8)
    assert (pulled(kv, 3) == 8 * n).all()
    kv.push(3, [np.ones(SHAPE)] * 4)
    assert (pulled(kv, 3) == 4 * n).all()
    calls = []
    kv.set_updater(lambda key, value, stored: (calls.append(key), stored.__iadd__(value * 2)))
    assert (pulled(kv, 3) == 4 * n).all()
    kv.push(3, np.ones(SHAPE))
    assert (pulled(kv, 3) == 6 * n).all()
    keys = [5, 7, 9]
    kv.init(keys, [np.ones(SHAPE)] * 3)
    kv.push(keys, [np.ones(SHAPE)] * 3)
    b = [[np.zeros(SHAPE) for _ in range(4)] for _ in keys]
    kv.pull(keys, out=b)
    assert all((x == 1 + 2 * n).all() for row in b for x in row)
    kv.push(keys, [[np.ones(SHAPE)] * 4] * 3)
    kv.pull(keys, out=b)
    assert all((x == 1 + 10 * n).all() for row in b for x in row)
    # The updater ran once per push of each key, on its owner only.
    everyone = comm.allgather(calls)
    assert sorted(k for c in everyone for k in c) == [3, 5, 5, 7, 7, 9, 9]
    for rank, ran in enumerate(everyone):
        assert all(kv.plan[k].owner == rank for k in ran)


def test_devices_per_rank_may_differ(kv, comm):
    kv.init("g", np.zeros(4, np.float32))
    kv.push("g", [np.full(4, 1.0 + comm.rank, np.float32)] * (comm.rank + 1))
    expect = sum((r + 1) * (1.0 + r) for r in range(comm.size))
    assert (pulled(kv, "g", (4,), np.float32) == expect).all()


def test_keys_in_any_order(kv, comm):
    keys = list(range(6))
    order = keys[::-1] if comm.rank % 2 else keys
    kv.init(order, [np.full(3, float(k)) for k in order])
    kv.push(order, [np.full(3, float(k * (comm.rank + 1))) for k in order])
    outs = [np.zeros(3) for _ in order]
    kv.pull(order, out=outs)
    total = sum(r + 1 for r in range(comm.size))
    for k, o in zip(order, outs):
        assert (o == k * total).all()


def test_pushpull_and_broadcast(kv, comm):
    n = comm.size
    kv.init(0, np.zeros(SHAPE))
    v = np.full(SHAPE, 1.0 + comm.rank)
    kv.pushpull(0, v)
    assert (v == sum(1.0 + r for r in range(n))).all()
    out = [np.zeros(SHAPE), np.zeros(SHAPE)]
    kv.pushpull(0, [np.ones(SHAPE)] * 2, out=out)
    assert all((o == 2 * n).all() for o in out)
    outs = [np.zeros(SHAPE) for _ in range(2)]
    kv.broadcast(11, np.full(SHAPE, 9.0 + comm.rank), out=outs)
    assert all((o == 9).all() for o in outs)


def test_str_keys(kv, comm):
    kv.init(["w", "b"], [np.ones(3), np.ones(2)])
    kv.push(["b", "w"], [np.ones(2), np.ones(3)])
    assert (pulled(kv, "w", (3,)) == comm.size).all()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_dtypes(kv_split, comm, dtype):
    for key, size in ((1, 5), (2, 23)):  # key 2 is split over the owners
        kv_split.init(key, np.zeros(size, dtype))
        kv_split.push(key, np.arange(size, dtype=dtype) + comm.rank)
        out = np.zeros(size, dtype)
        kv_split.pull(key, out=out)
        expect = sum(np.arange(size) + r for r in range(comm.size)).astype(dtype)
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, expect)


def test_float16_sum_rounds_once(kv, comm):
    kv.init(1, np.zeros(1, np.float16))
    value = 2048 if comm.rank == 0 else 1
    kv.push(1, [np.full(1, value, np.float16), np.full(1, 1, np.float16), np.zeros(1, np.float16)])
    expect = np.float16(np.float32(2048 + 2 * comm.size - 1 if comm.size > 1 else 2049))
    assert pulled(kv, 1, (1,), np.float16)[0] == expect


def test_split_arrays_default_updater(kv_split, comm):
    size = 10 * comm.size + 7
    kv_split.init("big", np.zeros((size,), np.float32))
    placement = kv_split.plan["big"]
    assert placement.split == (comm.size > 1)
    kv_split.push("big", np.arange(size, dtype=np.float32) * (comm.rank + 1))
    total = sum(r + 1 for r in range(comm.size))
    np.testing.assert_array_equal(pulled(kv_split, "big", (size,), np.float32),
                                  np.arange(size, dtype=np.float32) * total)


def test_split_arrays_updater_runs_once_per_shard(kv_split, comm):
    shape = (4, 13)
    kv_split.init(["big", "small"], [np.ones(shape), np.ones(3)])
    seen = []

    def update(key, value, stored):
        seen.append((key, value.size, float(value.sum())))
        stored -= 0.5 * value

    kv_split.set_updater(update)
    grad = np.arange(52, dtype=np.float64).reshape(shape)
    kv_split.push(["big", "small"], [grad, np.ones(3)])
    out = np.zeros(shape)
    kv_split.pull("big", out=out)
    np.testing.assert_allclose(out, 1 - 0.5 * grad * comm.size)
    everyone = [s for part in comm.allgather(seen) for s in part]
    placement = kv_split.plan["big"]
    big_calls = sorted(s for s in everyone if s[0] == "big")
    assert len(big_calls) == len(placement.shards)
    assert sum(s[1] for s in big_calls) == 52
    assert sum(s[2] for s in big_calls) == pytest.approx(grad.sum() * comm.size)
    assert len([s for s in everyone if s[0] == "small"]) == 1
    # Only the owners ran it: each rank ran exactly its shards.
    mine = sorted(s[1] for s in seen if s[0] == "big")
    assert mine == sorted(s.size for s in placement.shards if s.owner == comm.rank)


def test_pull_after_updater_without_new_push_moves_nothing_wrong(kv, comm):
    kv.init(1, np.zeros(3))
    kv.set_updater(lambda k, v, s: s.__iadd__(v))
    kv.push(1, np.ones(3))
    assert (pulled(kv, 1, (3,)) == comm.size).all()
    assert (pulled(kv, 1, (3,)) == comm.size).all()
    kv.push(1, np.ones(3))
    assert (pulled(kv, 1, (3,)) == 2 * comm.size).all()


def test_plan_is_the_same_on_every_rank(kv_split, comm):
    keys = [f"p{i}" for i in range(12)]
    sizes = [(i * 7) % 31 + 1 for i in range(12)]
    kv_split.init(keys, [np.zeros(s, np.float32) for s in sizes])
    shards = {k: kv_split.plan[k].shards for k in keys}
    assert all(s == shards for s in comm.allgather(shards))


def test_subcommunicator(make_store, comm):
    sub = comm.Split(comm.rank % 2, comm.rank)
    kv = make_store(comm=sub)
    assert kv.num_workers == sub.size and kv.rank == sub.rank
    kv.init(1, np.zeros(2))
    kv.push(1, np.full(2, float(comm.rank)))
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert (pulled(kv, 1, (2,)) == sum(members)).all()
    kv.barrier()
    sub.Free()


def test_barrier_waits_for_every_rank(kv, comm, tmp_path_factory):
    """No rank leaves the barrier before the last one has entered it."""
    import os
    import time
    base = comm.bcast(str(tmp_path_factory.mktemp("barrier")) if comm.rank == 0 else None)
    marks = [os.path.join(base, f"entered-{n}") for n in range(2)]
    for mark, wait in zip(marks, (kv.barrier, kv._barrier)):  # _barrier: MXNet's spelling
        if comm.rank == comm.size - 1:
            time.sleep(0.2)  # arrives late, and says so just before entering
            open(mark, "w").close()
        wait()
        assert os.path.exists(mark)


def test_bad_comm():
    with pytest.raises(TypeError, match="intra-communicator"):
        mpikv.create("dist_sync", comm="world")


def test_a_late_rank_is_waited_for_and_calls_go_on(make_store, comm):
    """Ranks waiting past the announcement time (a quarter of the timeout) tell the
    others they are there; the call still completes and later calls are unaffected."""
    import time
    kv = make_store(timeout=4)
    kv.init([1, 2], [np.zeros(3), np.zeros(3)])
    for step in range(3):
        if comm.rank == 0 and step == 1:
            time.sleep(1.5)   # past the 1 s announcement: the others announce themselves
        out = np.zeros(3)
        kv.pushpull(1, np.full(3, step + 1.0), out=out)
        assert (out == comm.size * (step + 1)).all()
    kv.push([1, 2], [np.ones(3), np.ones(3)])
    out = np.zeros(3)
    kv.pull(2, out=out)
    assert (out == comm.size).all()


@pytest.mark.parametrize("bad", ["shape", "dtype", "priority", "readonly_out", "op"])
def test_repeated_one_key_call_errors_everywhere(make_store, comm, bad):
    """A repeated one-key call runs on its remembered route; a rank whose call differs
    (and so takes the general path) still makes every rank raise the same error,
    and nothing is applied."""
    kv = make_store()
    kv.init(1, np.zeros(4, np.float32))
    out = np.zeros(4, np.float32)
    for _ in range(2):   # the second call runs on the remembered route
        kv.pushpull(1, np.ones(4, np.float32), out=out)
    assert (out == comm.size).all()
    value, dst, priority = np.full(4, 5, np.float32), np.zeros(4, np.float32), 0
    last = comm.rank == comm.size - 1
    if last and bad == "shape":
        value = np.ones(5, np.float32)
    if last and bad == "dtype":
        value = np.ones(4, np.float64)
    if last and bad == "priority":
        priority = 3
    if last and bad == "readonly_out":
        dst.flags.writeable = False
    if comm.size == 1 and bad in ("priority", "op"):
        pytest.skip("needs two ranks to differ")
    expected = {"shape": errors.ShapeError, "dtype": errors.DTypeError,
                "priority": errors.MismatchError, "readonly_out": errors.ValueTypeError,
                "op": errors.MismatchError}[bad]
    if last and bad == "op":
        call = lambda: kv.push(1, value, priority=priority)  # noqa: E731
    else:
        call = lambda: kv.pushpull(1, value, out=dst, priority=priority)  # noqa: E731
    message = raises_everywhere(comm, expected, call)
    assert "nothing was applied" in message
    stored = np.zeros(4, np.float32)
    kv.pull(1, out=stored)
    assert (stored == comm.size).all()   # still the last good sum
    kv.pushpull(1, np.full(4, 2, np.float32), out=out)   # and the route still works
    assert (out == 2 * comm.size).all()


@pytest.mark.parametrize("option,value,default", [
    ("bigarray_bound", 10, None), ("bucket_bytes", 64, None), ("reducer", "reduce_bcast", None),
    ("shared_memory", False, None),
])
def test_store_options_that_differ_between_ranks_are_an_error_everywhere(
        make_store, comm, option, value, default):
    kwargs = {option: value if comm.rank == 0 else default}
    if comm.size == 1:  # nothing to differ from: the store is made
        make_store(**kwargs)
        return
    message = raises_everywhere(comm, mpikv.MismatchError,
                                lambda: make_store(**kwargs))
    assert f"different store options: {option} is" in message and "rank 0" in message


def test_a_bad_option_on_one_rank_is_an_error_everywhere(comm):
    bound = -1 if comm.rank == comm.size - 1 else None
    message = raises_everywhere(comm, mpikv.InputError,
                                lambda: mpikv.create("dist_sync", bigarray_bound=bound))
    assert (f"rank {comm.size - 1}: bigarray_bound (MPIKV_BIGARRAY_BOUND) must be at least"
            in message)


def test_a_key_this_rank_cannot_read_is_an_input_error_everywhere(comm, kv):
    kv.init(1, np.zeros(2))
    key = 10 ** 5000 if comm.rank == 0 else 1  # too long to turn into text
    message = raises_everywhere(comm, errors.InputError,
                                lambda: kv.push(key, np.ones(2)))
    assert "push: " in message and "its arguments cannot be read (ValueError" in message
    assert comm.size == 1 or "rank 0" in message
    # The ranks are still in step: the next push pairs with the others' next push.
    kv.push(1, np.full(2, 3.0))
    out = np.zeros(2)
    kv.pull(1, out=out)
    assert (out == 3.0 * comm.size).all()
