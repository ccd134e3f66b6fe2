"""Every reduction strategy against one table of cases (ChainerMN's test_communicator style).

Each case sums known values over the ranks with one strategy, in place or out
of place, whole or to the owners' blocks, and checks every element on every
rank. Small pieces (``PIECE`` bytes) make the strategies cut buffers.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpikv import config, reducers
from mpikv.reducers import Blocks, even_blocks
from mpikv.transport.mpi import MPITransport
from mpikv.transport.shm import NodeGroup

from .conftest import TEST_TIMEOUT

pytestmark = pytest.mark.mpi

PIECE = 64  # bytes: 16 float32 per collective, so most cases go in pieces
NAMES = list(reducers.NAMES) + [reducers.COPY + n for n in reducers.NAMES]
# (elements, dtype)
CASES = [(1, np.float32), (7, np.float64), (100, np.float32), (1000, np.int64),
         (333, np.int32), (4096, np.float32)]


def _transport(nodes="real"):
    t = MPITransport(MPI.COMM_WORLD, config.resolve(timeout=TEST_TIMEOUT, bucket_bytes=PIECE,
                                                    autotune=False))
    if nodes == "pairs":  # ranks 0-1, 2-3, ... act as nodes: the across-node paths run
        comm = t.comm
        t._nodes = NodeGroup(comm, node=comm.Split(comm.rank // 2, comm.rank))
    return t


@pytest.fixture(scope="module", params=["real", "pairs"])
def transport(request):
    return _transport(request.param)


def _values(rank, n, dtype):
    return (np.arange(n) % 13 + 3 * rank + 1).astype(dtype)


def _total(size, n, dtype):
    return sum(_values(r, n, dtype) for r in range(size)).astype(dtype)


def _reducer(name, transport):
    if not reducers.usable(name, transport):
        pytest.skip(f"{name} cannot run here ({transport.size} ranks)")
    return reducers.make(name, transport, PIECE)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,dtype", CASES)
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_allreduce(transport, name, n, dtype, in_place):
    red = _reducer(name, transport)
    mine = _values(transport.rank, n, dtype)
    src = None if in_place else mine.copy()
    dst = mine.copy() if in_place else np.full(n, -99, dtype)
    red.allreduce(dst, src, ("test", []))
    np.testing.assert_array_equal(dst, _total(transport.size, n, dtype))
    if src is not None:
        np.testing.assert_array_equal(src, mine)  # the input is only read


def _owner_blocks(n, size, scrambled):
    """Blocks in rank order (a fused bucket) or scrambled (a split key's shards)."""
    blocks = even_blocks(n, size)
    if not scrambled or size == 1:
        return blocks
    # Rank r takes the block of rank size-1-r: displacements out of rank order.
    order = list(reversed(range(size)))
    counts = [blocks.counts[order[r]] for r in range(size)]
    displs = [blocks.displs[order[r]] for r in range(size)]
    return Blocks(tuple(counts), tuple(displs))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,dtype", CASES)
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("scrambled", [False, True], ids=["rank_order", "scrambled"])
def test_reduce_to_owners(transport, name, n, dtype, in_place, scrambled):
    red = _reducer(name, transport)
    blocks = _owner_blocks(n, transport.size, scrambled)
    mine = _values(transport.rank, n, dtype)
    src = None if in_place else mine.copy()
    dst = mine.copy() if in_place else np.full(n, -99, dtype)
    red.reduce_to_owners(dst, src, blocks, ("test", []))
    r = transport.rank
    lo, hi = blocks.displs[r], blocks.displs[r] + blocks.counts[r]
    np.testing.assert_array_equal(dst[lo:hi], _total(transport.size, n, dtype)[lo:hi])


@pytest.mark.parametrize("name", reducers.NAMES)
def test_staged_wrapper_on_host_buffers_is_the_strategy(transport, name):
    from mpikv.reducers.staged import StagedReducer
    red = StagedReducer(_reducer(name, transport), aware=False, stager=None)
    dst = _values(transport.rank, 50, np.float32)
    red.allreduce(dst, None, ("test", []))
    np.testing.assert_array_equal(dst, _total(transport.size, 50, np.float32))


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="reduce_scatter"):
        reducers.make("ring", SimpleNamespace(size=1), PIECE)
    with pytest.raises(ValueError):
        reducers.check_name("copy+ring")
