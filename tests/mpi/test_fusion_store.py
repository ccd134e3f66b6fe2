"""Fused buckets, every reduction strategy, and zero-copy gradient buffers, with values."""

import os

import numpy as np
import pytest

import mpikv
from mpikv import errors, optimizer
from mpikv.reducers import NAMES

from .conftest import TEST_TIMEOUT, raises_everywhere

pytestmark = pytest.mark.mpi

# 30 small keys of mixed sizes and dtypes, and two split ones (bound 100).
KEYS = list(range(32))
SHAPES = [(3 + i % 5, 2) if i < 30 else (15, 11) for i in KEYS]
DTYPES = [np.float32 if i % 3 else np.float64 for i in KEYS]


def _options(**kw):
    """The options of the stores here: 200-byte buckets (many buckets, and keys that
    fill one alone)."""
    kw.setdefault("reducer", os.environ.get("MPIKV_REDUCER", "allreduce"))
    return dict(bigarray_bound=100, bucket_bytes=200, **kw)


def _grads(rank, step=0):
    return [np.full(s, (rank + 1) * (k + 1 + step), d) for k, s, d in zip(KEYS, SHAPES, DTYPES)]


def _total(comm, k, step=0):
    return sum(r + 1 for r in range(comm.size)) * (k + 1 + step)


@pytest.fixture(params=NAMES)
def algorithm(request, monkeypatch):
    monkeypatch.setenv("MPIKV_REDUCER", request.param)
    return request.param


def test_fused_push_pull_every_algorithm(make_store, comm, algorithm):
    kv = make_store(**_options())
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    kv.push(KEYS, _grads(comm.rank))
    outs = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]
    kv.pull(KEYS, out=outs)
    for k, o in zip(KEYS, outs):
        assert (o == _total(comm, k)).all(), (algorithm, k)
    # A different key list (a subset, another order) still works.
    sub = KEYS[::-3]
    grads = _grads(comm.rank, 1)
    kv.pushpull(sub, [grads[k] for k in sub])
    out = np.zeros(SHAPES[sub[0]], DTYPES[sub[0]])
    kv.pull(sub[0], out=out)
    assert (out == _total(comm, sub[0], 1)).all()


def test_fused_owner_path_every_algorithm(make_store, comm, algorithm):
    kv = make_store(**_options())
    kv.init(KEYS, [np.ones(s, d) for s, d in zip(SHAPES, DTYPES)])
    kv.set_optimizer(optimizer.SGD(learning_rate=0.5))
    kv.push(KEYS, _grads(comm.rank))
    outs = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]
    kv.pull(KEYS, out=outs)
    for k, o in zip(KEYS, outs):
        np.testing.assert_allclose(o, 1 - 0.5 * _total(comm, k), err_msg=f"{algorithm} {k}")
    # Pull of a subset after a push of all: stale keys come back one by one.
    kv.push(KEYS, _grads(comm.rank))
    out = np.zeros(SHAPES[5], DTYPES[5])
    kv.pull(5, out=out)
    np.testing.assert_allclose(out, 1 - 1.0 * _total(comm, 5))


def test_updater_in_fused_buckets_runs_once_per_key_on_its_owner(make_store, comm):
    kv = make_store(**_options())
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    ran = []
    kv.set_updater(lambda key, value, stored: (ran.append(key), stored.__iadd__(value)))
    kv.push(KEYS, _grads(comm.rank))
    everyone = [k for part in comm.allgather(ran) for k in part]
    shards = {k: len(kv.plan[k].shards) for k in KEYS}
    assert sorted(everyone) == sorted(k for k in KEYS for _ in range(shards[k]))
    outs = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]
    kv.pull(KEYS, out=outs)
    assert all((o == _total(comm, k)).all() for k, o in zip(KEYS, outs))


def test_zero_copy_pushpull_leaves_the_sum_in_the_buffers(make_store, comm):
    kv = make_store(**_options())
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    bufs = kv.gradient_buffers(KEYS)
    assert [b.shape for b in bufs] == SHAPES and [b.dtype for b in bufs] == [
        np.dtype(d) for d in DTYPES]
    for step in range(3):
        for b, g in zip(bufs, _grads(comm.rank, step)):
            b[...] = g
        kv.pushpull(KEYS, bufs)
        for k, b in zip(KEYS, bufs):
            assert (b == _total(comm, k, step)).all()
    # The store kept the sum too.
    out = np.zeros(SHAPES[7], DTYPES[7])
    kv.pull(7, out=out)
    assert (out == _total(comm, 7, 2)).all()
    # Buffers are stable: asking again gives the same arrays.
    assert all(a is b for a, b in zip(kv.gradient_buffers(KEYS), bufs))


def test_zero_copy_with_optimizer_and_mixed_inputs(make_store, comm):
    kv = make_store(**_options())
    kv.init(KEYS, [np.ones(s, d) for s, d in zip(SHAPES, DTYPES)])
    kv.set_optimizer(optimizer.SGD(learning_rate=0.5))
    bufs = kv.gradient_buffers(KEYS)
    for b, g in zip(bufs, _grads(comm.rank)):
        b[...] = g
    # One key given as a fresh array instead of its buffer: that bucket is copied.
    values = list(bufs)
    values[4] = bufs[4].copy()
    kv.push(KEYS, values)
    outs = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]
    kv.pull(KEYS, out=outs)
    for k, o in zip(KEYS, outs):
        np.testing.assert_allclose(o, 1 - 0.5 * _total(comm, k))


def test_zero_copy_refuses_float16_and_unknown_keys(make_store, comm):
    kv = make_store(**_options())
    kv.init([1, 2], [np.zeros(3, np.float16), np.zeros(3, np.float32)])
    with pytest.raises(errors.DTypeError, match="float16"):
        kv.gradient_buffers([1, 2])
    with pytest.raises(errors.UnknownKeyError):
        kv.gradient_buffers([9])
    buf = kv.gradient_buffers(2)
    buf[...] = 1
    kv.pushpull(2, buf)
    assert (buf == comm.size).all()


def test_bad_reducer_name_is_an_error():
    with pytest.raises(ValueError, match="allreduce"):
        mpikv.create("dist_sync", reducer="spiral")
    with pytest.raises(ValueError, match="MPIKV_REDUCER"):
        from mpikv.store import config
        config.resolve(environ={"MPIKV_REDUCER": "spiral"})
    assert config.resolve(environ={"MPIKV_ALGORITHM": "reduce_scatter"}).reducer == "reduce_scatter"


def test_pushpull_of_one_big_key_sums_in_the_callers_array(make_store, comm):
    kv = make_store(**_options())  # bound 100: the key is split over the owners
    kv.init("w", np.zeros(500, np.float32))
    value = np.full(500, comm.rank + 1.0, np.float32)
    kv.pushpull("w", value)
    total = sum(r + 1 for r in range(comm.size))
    assert (value == total).all()
    # The store kept its own copy of the sum: changing the array changes nothing.
    value[:] = -1
    out = np.zeros(500, np.float32)
    kv.pull("w", out=out)
    assert (out == total).all()
    # A view that is not contiguous goes through the bucket copy, with the same result.
    big = np.full(1000, comm.rank + 1.0, np.float32)
    kv.pushpull("w", big[::2])
    assert (big[::2] == total).all() and (big[1::2] == comm.rank + 1).all()


def test_zero_copy_buffers_use_node_shared_memory(make_store, comm):
    kv = make_store(**_options())
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    bufs = kv.gradient_buffers(KEYS)
    # One node here: shared windows whenever there is more than one rank.
    assert kv.uses_shared_memory(KEYS) == (comm.size > 1)
    for step in range(3):
        for b, g in zip(bufs, _grads(comm.rank, step)):
            b[...] = g
        kv.pushpull(KEYS, bufs)
        for k, b in zip(KEYS, bufs):
            assert (b == _total(comm, k, step)).all(), (step, k)
    # Given copies instead of the buffers, the same shared path runs.
    kv.pushpull(KEYS, [g.copy() for g in _grads(comm.rank, 5)])
    assert all((b == _total(comm, k, 5)).all() for k, b in zip(KEYS, bufs))


def test_shared_memory_off_and_hierarchical_nodes(comm):
    if comm.size < 4:
        pytest.skip("needs 4 ranks to act as 2 nodes of 2")
    from mpikv.store import config
    from mpikv.tuning import table as tuning
    from mpikv.store.kvstore import KVStore
    from mpikv.transport.mpi import MPITransport
    # Pairs of ranks act as nodes: node-local sums, then an Allreduce across "nodes".
    options = config.resolve(timeout=TEST_TIMEOUT, bigarray_bound=100, bucket_bytes=200,
                             autotune=False)
    t = MPITransport(comm, options, node_of=lambda rank: rank // 2)
    assert t.nodes.nodes == comm.size // 2 and t.nodes.usable == (comm.size % 2 == 0)
    kv = KVStore("dist_sync", t, options, tuning.forced("allreduce", "test"))
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    bufs = kv.gradient_buffers(KEYS)
    for b, g in zip(bufs, _grads(comm.rank)):
        b[...] = g
    kv.pushpull(KEYS, bufs)
    assert all((b == _total(comm, k)).all() for k, b in zip(KEYS, bufs))


def test_shared_memory_can_be_turned_off(make_store, comm):
    kv = make_store(**_options(shared_memory=False))
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    bufs = kv.gradient_buffers(KEYS)
    assert not kv.uses_shared_memory(KEYS)
    for b, g in zip(bufs, _grads(comm.rank)):
        b[...] = g
    kv.pushpull(KEYS, bufs)
    assert all((b == _total(comm, k)).all() for k, b in zip(KEYS, bufs))


def test_one_array_given_for_two_keys_is_not_summed_twice(make_store, comm):
    kv = make_store(bucket_bytes=16)  # a bucket per key
    kv.init([1, 2], [np.zeros(4, np.float32)] * 2)
    a = np.ones(4, np.float32)
    kv.pushpull([1, 2], [a, a])
    o = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    kv.pull([1, 2], out=o)
    assert (o[0] == comm.size).all() and (o[1] == comm.size).all()


def test_a_cached_key_list_does_not_admit_equal_non_int_keys(make_store, comm):
    kv = make_store(**_options())
    kv.init([1, 2], [np.zeros(3, np.float32)] * 2)
    vals = [np.ones(3, np.float32)] * 2
    kv.push([1, 2], vals)
    kv.push([1, 2], vals)  # now read through the cache
    for bad in ([1.0, 2], [True, 2]):
        raises_everywhere(comm, errors.KeyTypeError, lambda: kv.push(bad, vals))
    zero = kv.gradient_buffers([1, 2])
    kv.pushpull([1, 2], zero)
    raises_everywhere(comm, errors.KeyTypeError, lambda: kv.pushpull([1.0, 2], zero))


def test_priority_values(make_store, comm):
    kv = make_store(**_options())
    kv.init(3, np.zeros(4, np.float32))
    kv.push(3, np.ones(4, np.float32), priority=np.int64(-1))  # numpy ints are ints
    for bad in ("high", 2.5, True):
        msg = raises_everywhere(comm, errors.InputError,
                                lambda: kv.push(3, np.ones(4, np.float32), priority=bad))
        assert "priority must be an int" in msg
    if comm.size > 1:
        p = np.int64(1) if comm.rank == 1 else 1
        kv.push(3, np.ones(4, np.float32), priority=p)  # equal values agree


def test_zero_copy_then_checkpoint_load_gives_the_store_its_own_memory(make_store, comm,
                                                                       mpi_tmp_path):
    kv = make_store(**_options())
    keys = [0, 1]
    kv.init(keys, [np.zeros(4, np.float32)] * 2)
    bufs = kv.gradient_buffers(keys)
    for b in bufs:
        b[:] = 1
    kv.push(keys, bufs)  # the buffers are now the stored values
    path = str(mpi_tmp_path / "zc")
    kv.save_checkpoint(path)
    kv.load_checkpoint(path)
    bufs[0][:] = 123  # the next gradient
    out = np.zeros(4, np.float32)
    kv.pull(0, out=out)
    assert (out == comm.size).all()
    for b in bufs:
        b[:] = 2
    kv.pushpull(keys, bufs)
    assert all((b == 2 * comm.size).all() for b in bufs)


def test_per_key_priorities_follow_the_keys_not_the_list_order(make_store, comm):
    kv = make_store(bucket_bytes=16)  # a bucket per key
    kv.init([0, 1], [np.zeros(4, np.float32), np.zeros(8, np.float32)])
    keys = [0, 1] if comm.rank % 2 == 0 else [1, 0]
    prio = {0: 5, 1: 7}
    vals = {0: np.full(4, 1, np.float32), 1: np.full(8, 100, np.float32)}
    kv.push(keys, [vals[k] for k in keys], priority=[prio[k] for k in keys])
    o = [np.zeros(4, np.float32), np.zeros(8, np.float32)]
    kv.pull([0, 1], out=o)
    assert (o[0] == comm.size).all() and (o[1] == 100 * comm.size).all()


def test_cached_key_list_still_rejects_a_2d_array_as_the_value_list(make_store, comm):
    kv = make_store(**_options())
    kv.init([0, 1], [np.zeros(4, np.float32)] * 2)
    kv.push([0, 1], [np.ones(4, np.float32)] * 2)
    kv.push([0, 1], [np.ones(4, np.float32)] * 2)
    raises_everywhere(comm, errors.InputError, lambda: kv.push([0, 1], np.ones((2, 4), np.float32)))


def test_missing_values_on_a_known_key_list_are_an_error_everywhere(make_store, comm):
    kv = make_store(**_options())
    kv.init([0, 1], [np.zeros(4, np.float32)] * 2)
    kv.push([0, 1], [np.ones(4, np.float32)] * 2)
    raises_everywhere(comm, errors.ValueTypeError, lambda: kv.push([0, 1], None))
    bufs = kv.gradient_buffers([0, 1])
    kv.pushpull([0, 1], bufs)
    raises_everywhere(comm, errors.ValueTypeError,
                      lambda: kv.pushpull([0, 1], None if comm.rank == comm.size - 1 else bufs))


def test_shared_buffers_given_crosswise_still_sum_right(make_store, comm):
    kv = make_store(**_options())
    kv.init([0, 1], [np.zeros(4, np.float32)] * 2)
    bufs = kv.gradient_buffers([0, 1])
    bufs[0][:] = 1
    bufs[1][:] = 10
    other = np.full(4, 100, np.float32)
    kv.push([0, 1], [[other, bufs[0]], bufs[1]])  # a device list holding the key's own buffer
    o = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    kv.pull([0, 1], out=o)
    assert (o[0] == 101 * comm.size).all() and (o[1] == 10 * comm.size).all()
    bufs[0][:] = 1
    bufs[1][:] = 10
    kv.push([0, 1], [bufs[1], bufs[0]])  # swapped between the keys
    kv.pull([0, 1], out=o)
    assert (o[0] == 10 * comm.size).all() and (o[1] == comm.size).all()


@pytest.mark.parametrize("name", NAMES)
def test_ranks_whose_inputs_take_different_routes_still_match(make_store, comm, name):
    """One key, summed from the caller's array where it can be: one rank sums in
    its own array (out=None), one into an output, one from a non-contiguous
    array (packed first). The strategy must call the same collectives on all."""
    kv = make_store(reducer=name, direct_bytes=64, bucket_bytes=256)
    n = 300
    kv.init("w", np.zeros(n, np.float32))
    total = sum(r + 1 for r in range(comm.size))
    for step in range(3):   # the later steps run on the remembered one-key route
        route = (comm.rank + step) % 3
        if route == 0:
            value = np.full(n, comm.rank + 1, np.float32)
            kv.pushpull("w", value)
            got = value
        elif route == 1:
            got = np.zeros(n, np.float32)
            kv.pushpull("w", np.full(n, comm.rank + 1, np.float32), out=got)
        else:
            wide = np.full((n, 2), comm.rank + 1, np.float32)
            got = np.zeros(n, np.float32)
            kv.pushpull("w", wide[:, 0], out=got)   # not contiguous
        assert (got == total).all(), (name, step, route)
    out = np.zeros(n, np.float32)
    kv.pull("w", out=out)
    assert (out == total).all()


def test_columns_naming_different_strategies_still_match(make_store, comm, tmp_path_factory,
                                                         monkeypatch):
    """A cached table whose in-place and out-of-place columns name different
    strategies: ranks whose one-key inputs take different routes must still
    run the same one."""
    from mpikv.store import config
    from mpikv.tuning import table as tuning
    from mpikv.transport.mpi import MPITransport
    cache = comm.bcast(str(tmp_path_factory.mktemp("cache")) if comm.rank == 0 else None)
    monkeypatch.setenv("MPIKV_CACHE_DIR", cache)
    tuning.forget()
    t = MPITransport(comm, config.resolve(timeout=TEST_TIMEOUT, autotune=False))
    key = tuning.cache_key(t)
    table = tuning.Table({**{(tuning.IN_PLACE, s): "reduce_bcast" for s in tuning.SIZES},
                          **{(tuning.OUT_OF_PLACE, s): "reduce_scatter" for s in tuning.SIZES}},
                         "hand-made")
    if comm.rank == 0:
        assert tuning.write_cache(tuning.cache_path(key), key, table) is None
    comm.Barrier()
    kv = make_store(autotune=False, direct_bytes=64)
    assert "hand-made" in kv.tuning_table.source or comm.size == 1
    n = 300
    kv.init("w", np.zeros(n, np.float32))
    total = sum(r + 1 for r in range(comm.size))
    for step in range(3):
        value = np.full(n, comm.rank + 1, np.float32)
        if (comm.rank + step) % 2:
            kv.pushpull("w", value)            # in the caller's array
            got = value
        else:
            got = np.zeros(n, np.float32)
            kv.pushpull("w", value, out=got)   # into the store, then out
        assert (got == total).all(), step


def test_stores_on_sub_communicators_whose_layout_only_some_ranks_have_met(comm, monkeypatch):
    """Rank 0 has resolved the tuning table of a 2-rank layout (with rank 2), rank 1
    has not: a store on ranks 0 and 1 must still be made (rank 0 once skipped the
    table's broadcast, and rank 1 waited in it forever)."""
    from mpikv.tuning import table as tuning
    if comm.size < 3:
        pytest.skip("needs three ranks")
    tuning.forget()
    first = comm.Split(0 if comm.rank in (0, 2) else MPI_UNDEFINED(), comm.rank)
    if comm.rank in (0, 2):
        mpikv.create("dist_sync", comm=first, timeout=20, autotune=False).barrier()
    second = comm.Split(0 if comm.rank in (0, 1) else MPI_UNDEFINED(), comm.rank)
    if comm.rank in (0, 1):
        kv = mpikv.create("dist_sync", comm=second, timeout=20, autotune=False)
        kv.init("a", np.zeros(2))
        kv.pushpull("a", np.ones(2))
        out = np.zeros(2)
        kv.pull("a", out=out)
        assert out.tolist() == [2.0, 2.0]
    comm.Barrier()


def MPI_UNDEFINED():
    from mpi4py import MPI
    return MPI.UNDEFINED


def test_a_push_of_other_arrays_leaves_the_gradient_buffers_alone(make_store, comm):
    """Before the buffers were ever pushed, a push of copies leaves them as they are and
    keeps the sum in the store's own memory, at every rank count (on more than one rank
    it once went through the buffers' shared window: they held the sum and became the
    stored values, so writing the next gradients into them changed what pull gave)."""
    kv = make_store(**_options())
    kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
    bufs = kv.gradient_buffers(KEYS)
    for b, g in zip(bufs, _grads(comm.rank, 1)):
        b[...] = g
    kv.pushpull(KEYS, [g.copy() for g in _grads(comm.rank, 5)])
    for k, b, g in zip(KEYS, bufs, _grads(comm.rank, 1)):
        np.testing.assert_array_equal(b, g, err_msg=f"buffer of key {k}")
    for b in bufs:
        b[...] = -1
    outs = [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)]
    kv.pull(KEYS, out=outs)
    for k, out in zip(KEYS, outs):
        assert (out == _total(comm, k, 5)).all(), k
    # Pushing the buffers themselves then sums them where they lie, as before.
    for b, g in zip(bufs, _grads(comm.rank, 2)):
        b[...] = g
    kv.pushpull(KEYS, bufs)
    assert all((b == _total(comm, k, 2)).all() for k, b in zip(KEYS, bufs))
