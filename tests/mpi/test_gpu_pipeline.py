"""Staging in pieces (``mpikv/transport/pipeline.py``) through ``dist_sync_device`` stores.

Keys of several pieces (``staging_piece`` of a few hundred bytes here), the
three ways of ``tests/mpi/test_gpu.py`` (real cupy, the stand-in staged, the
stand-in direct): every sum must be exact. Staged on the stand-in, the calls
must also have gone in pieces: one copy down per piece.
Run: ``scripts/mpirun.sh -n 3 python -m pytest tests/mpi/test_gpu_pipeline.py --with-mpi``.
"""

import numpy as np
import pytest

from mpikv import errors, optimizer
from mpikv.store import config
from mpikv.transport.mpi import MPITransport
from mpikv.transport.pipeline import piece_ranges

from .. import fakecupy
from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi

PIECE = 256   # bytes: 64 float32 elements a piece


def _tri(n):
    return n * (n + 1) // 2  # the sum of rank + 1 over n ranks


def _staged(cp):
    return getattr(cp, "STAND_IN", False) and not fakecupy._aware()


def _copies_down():
    return fakecupy.events().count("d2h")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("reducer", ["allreduce", "reduce_bcast", "reduce_scatter"])
@pytest.mark.parametrize("how", ["pushpull", "pushpull_async"])
def test_pushpull_of_a_multi_piece_key_is_exact(make_store, cp, comm, dtype, reducer, how):
    n, r = comm.size, comm.rank
    size = 1001   # not a multiple of any piece
    kv = make_store("dist_sync_device", staging_piece=PIECE, reducer=reducer)
    # White-box: the transport a store makes from these options stages in PIECE bytes.
    transport = MPITransport(comm, config.resolve(**kv.options))
    try:
        assert transport.staging.piece_bytes == PIECE
    finally:
        transport.close()
    kv.init("big", cp.zeros(size, dtype))
    # Integers small enough for float16's sums to be exact: rank-dependent, per element.
    base = np.arange(size) % 7
    grad = cp.asarray((base * (r + 1)).astype(dtype))
    grad += 1   # a kernel still queued when the call starts
    before = _copies_down()
    if how == "pushpull":
        kv.pushpull("big", grad)
    else:
        kv.wait(kv.pushpull_async("big", grad))
    want = (base * _tri(n) + n).astype(dtype)
    np.testing.assert_array_equal(grad.get(), want)
    if _staged(cp) and reducer != "reduce_scatter":
        # An elementwise strategy went in pieces: at least one copy down per piece.
        pieces = len(piece_ranges(size, np.dtype(dtype).itemsize, PIECE))
        assert pieces > 1 and _copies_down() - before >= pieces


def test_sgd_pull_and_init_of_a_multi_piece_key_go_in_pieces(make_store, cp, comm):
    # The owner updates and broadcasts (Bcast in pieces); init broadcasts rank 0's value.
    n, r = comm.size, comm.rank
    size = 777
    kv = make_store("dist_sync_device", staging_piece=PIECE)
    before = _copies_down()
    kv.init("w", cp.full(size, 1 if r == 0 else 99, cp.float32))
    pieces = len(piece_ranges(size, 4, PIECE))
    if _staged(cp) and r == 0:
        assert _copies_down() - before == pieces    # the root copies each piece down
    out = cp.zeros(size, cp.float32)
    kv.pull("w", out=out)
    assert out.get().tolist() == [1.0] * size
    kv.set_optimizer(optimizer.SGD(learning_rate=0.5))
    grad = cp.full(size, 1.0, cp.float32)
    kv.pushpull("w", grad, out=out)
    np.testing.assert_array_equal(out.get(), np.full(size, 1 - 0.5 * n, np.float32))


def test_whole_buffer_staging_when_the_piece_is_zero(make_store, cp, comm):
    n, r = comm.size, comm.rank
    kv = make_store("dist_sync_device", staging_piece=0)
    kv.init("big", cp.zeros(1001, cp.float32))
    grad = cp.full(1001, r + 1, cp.float32)
    before = _copies_down()
    kv.pushpull("big", grad)
    assert grad.get().tolist() == [_tri(n)] * 1001
    if _staged(cp):
        assert _copies_down() - before == 1


def test_ranks_must_agree_on_the_piece(make_store, comm):
    if comm.size == 1:
        pytest.skip("one rank has nobody to disagree with")
    piece = PIECE if comm.rank == 0 else 2 * PIECE
    raises_everywhere(comm, errors.MismatchError,
                      lambda: make_store("dist_sync_device", staging_piece=piece))


@pytest.mark.parametrize("reducer", ["allreduce", "reduce_bcast"])
def test_ranks_with_the_key_on_gpu_and_on_host_make_the_same_calls(make_store, cp, comm, reducer):
    """Rank 0 keeps a multi-piece key on its GPU, the others on the host: staged or not,
    each rank cuts Bcast and Allreduce into the same pieces (before, a host rank made
    one call where the GPU rank made several, and the job hung)."""
    n, r = comm.size, comm.rank
    size = 1001
    kv = make_store("dist_sync_device", staging_piece=PIECE, reducer=reducer,
                    autotune=False)
    mine = (np.arange(size) % 7 + r).astype(np.float32)
    value = cp.asarray(mine) if r == 0 else mine.copy()
    kv.init("w", value)
    out = cp.zeros(size, cp.float32) if r == 0 else np.zeros(size, np.float32)
    kv.pushpull("w", value, out=out)
    got = out.get() if r == 0 else out
    want = sum((np.arange(size) % 7 + q).astype(np.float32) for q in range(n))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("reducer", ["allreduce", "reduce_bcast", "reduce_scatter"])
def test_ranks_with_keys_on_gpu_and_on_host_cut_the_same_buckets(make_store, cp, comm, reducer):
    """A device store packs its keys in big buckets, with no key alone (``fusion.sizes``);
    rank 0 holds GPU values, the others host values: the buckets must be the same on
    every rank, or the calls would not match. Keys small and large (above ``direct_bytes``)."""
    n, r = comm.size, comm.rank
    sizes = [3, 700, 50, 2000, 9]
    keys = list(range(len(sizes)))
    kv = make_store("dist_sync_device", staging_piece=PIECE, reducer=reducer,
                    autotune=False, direct_bytes=1024)
    mine = [(np.arange(s) % 5 + r).astype(np.float32) for s in sizes]
    values = [cp.asarray(m) for m in mine] if r == 0 else [m.copy() for m in mine]
    kv.init(keys, values)
    layout = kv._engine.layout(keys)
    # all fused, the 2000-element key too, on every rank (gathered before any assert)
    assert comm.allgather(len(layout.buckets)) == [1] * n
    outs = [cp.zeros(s, cp.float32) if r == 0 else np.zeros(s, np.float32) for s in sizes]
    for _ in range(2):
        kv.pushpull(keys, values, out=outs)
        for s, o in zip(sizes, outs):
            got = o.get() if r == 0 else o
            want = sum((np.arange(s) % 5 + q).astype(np.float32) for q in range(n))
            np.testing.assert_array_equal(got, want)
    host = make_store(autotune=False, direct_bytes=1024)
    host.init(keys, mine)
    assert len(host._engine.layout(keys).buckets) == 3   # 700 and 2000 elements alone


def test_ranks_that_make_different_store_types_cut_the_same_buckets(make_store, comm):
    """A Trainer makes a device store where its parameters are on a GPU, a host store
    elsewhere: one rank's device type makes every rank pack as a device store."""
    n, r = comm.size, comm.rank
    sizes = [3, 700, 50, 2000, 9]
    keys = list(range(len(sizes)))
    kind = "dist_sync_device" if r == n - 1 else "dist_sync"
    kv = make_store(kind, autotune=False, direct_bytes=1024)
    values = [(np.arange(s) % 5 + r).astype(np.float32) for s in sizes]
    kv.init(keys, values)
    assert comm.allgather(len(kv._engine.layout(keys).buckets)) == [1] * n
    outs = [np.zeros(s, np.float32) for s in sizes]
    kv.pushpull(keys, values, out=outs)
    for s, o in zip(sizes, outs):
        np.testing.assert_array_equal(o, sum((np.arange(s) % 5 + q).astype(np.float32)
                                             for q in range(n)))
    kv.close()
