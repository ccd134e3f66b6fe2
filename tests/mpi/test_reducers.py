"""Every reduction strategy against one table of cases (ChainerMN's test_communicator style).

Each case sums known values over the ranks with one strategy, in place or out
of place, whole or to the owners' blocks, and checks every element on every
rank. Small pieces (``PIECE`` bytes) make the strategies cut buffers.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpikv.arrays import compression
from mpikv.store import config
from mpikv import reducers
from mpikv.core.fusion import plan_buckets
from mpikv.core.plan import OwnershipPlan
from mpikv.reducers.shared import WindowReducer
from mpikv.reducers import Blocks, even_blocks
from mpikv.transport.mpi import MPITransport

from .conftest import TEST_TIMEOUT

pytestmark = pytest.mark.mpi

PIECE = 64  # bytes: 16 float32 per collective, so most cases go in pieces
#: the table's strategies, then those the store's state picks (compression, the
#: zero-copy buffers' shared window)
COMPRESSED = ["compressed:2bit", "compressed:fp16", "compressed:bf16"]
NAMES = (list(reducers.NAMES) + [reducers.COPY + n for n in reducers.NAMES] + COMPRESSED
         + ["window"])
#: 2-bit's threshold: every test value is at least 1, so each rank sends +T
T = 0.5
# (elements, dtype)
CASES = [(1, np.float32), (7, np.float64), (100, np.float32), (1000, np.int64),
         (333, np.int32), (4096, np.float32), (3, np.float32)]   # 3: some blocks empty
#: how ranks act as nodes: "real" (the machine's), "pairs" (ranks 0-1, 2-3, ...: nodes
#: own runs of blocks), "strided" (even ranks, odd ranks: a node's blocks are apart)
NODES = {"real": None, "pairs": lambda rank: rank // 2, "strided": lambda rank: rank % 2}
#: what only the node layout changes: the other strategies run under "real" and "pairs"
NODE_AWARE = {"hierarchical", "shared", "window"}


def _transport(nodes="real"):
    # "pairs", "strided": ranks of this machine act as nodes: the across-node paths run.
    t = MPITransport(MPI.COMM_WORLD, config.resolve(timeout=TEST_TIMEOUT, bucket_bytes=PIECE,
                                                    autotune=False), node_of=NODES[nodes])
    t.placement = nodes
    # On several hosts (scripts/cluster.sh) a made-up node may span two of them: its
    # shared-memory window cannot exist there.
    hosts = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    t.one_host_per_node = all(len({hosts[r] for r in node}) == 1 for node in t.nodes.members)
    return t


@pytest.fixture(scope="module", params=list(NODES))
def transport(request):
    return _transport(request.param)


def _values(rank, n, dtype):
    return (np.arange(n) % 13 + 3 * rank + 1).astype(dtype)


def _total(size, n, dtype, name=None):
    """The sum every strategy must give: exact (the values are small integers, which
    16 bits hold too), and for 2-bit, what every rank sent, +T each."""
    if name == "compressed:2bit":
        return np.full(n, size * T, dtype)
    return sum(_values(r, n, dtype) for r in range(size)).astype(dtype)


def _reducer(name, transport, n=1, dtype=np.float32):
    """A reducer for ``name`` that sums ``n`` elements of ``dtype``, or a skip."""
    if (getattr(transport, "placement", "real") == "strided"
            and name.removeprefix(reducers.COPY) not in NODE_AWARE):
        pytest.skip("the node layout changes nothing for this strategy")
    if name.removeprefix(reducers.COPY) in ("shared", "window") and not getattr(
            transport, "one_host_per_node", True):
        pytest.skip("these made-up nodes span hosts: no shared memory across them")
    if name in COMPRESSED:
        if dtype != np.float32:
            pytest.skip("compression takes float32 only")
        chooser = reducers.Chooser(transport, None, PIECE)
        chooser.compress(compression.parse_params(
            {"type": name.split(":")[1], "threshold": T}), per_device=False)
        return chooser.get(_bucket(n, transport.size), n * 4, False)
    if name == "window":
        if not WindowReducer.usable(transport):
            pytest.skip(f"no node shared memory here ({transport.size} ranks)")
        return WindowReducer(transport, transport.shared_arena(n, dtype))
    if not reducers.usable(name, transport):
        pytest.skip(f"{name} cannot run here ({transport.size} ranks)")
    return reducers.make(name, transport, PIECE)


def _bucket(n, size):
    """One key's bucket of ``n`` elements (compressed sums keep residuals per key)."""
    placed = OwnershipPlan(size, bigarray_bound=n + 1).add([("k", n, 4)])
    (bucket,) = plan_buckets([("k", np.dtype(np.float32), placed["k"])], size)
    return bucket


def _buffers(red, mine, in_place):
    """``(dst, src)``: in place, the window's zero-copy case sums in its segment."""
    if isinstance(red, WindowReducer):
        segment = red.arena.mine
        if in_place:
            segment[...] = mine
            return segment, None
        segment[...] = -5   # a rank's own buffer: must be left as it was
    src = None if in_place else mine.copy()
    return (mine.copy() if in_place else np.full(mine.size, -99, mine.dtype)), src


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,dtype", CASES)
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_allreduce(transport, name, n, dtype, in_place):
    red = _reducer(name, transport, n, dtype)
    mine = _values(transport.rank, n, dtype)
    dst, src = _buffers(red, mine, in_place)
    red.allreduce(dst, src, ("test", []))
    np.testing.assert_array_equal(dst, _total(transport.size, n, dtype, name))
    if src is not None:
        np.testing.assert_array_equal(src, mine)  # the input is only read
    if isinstance(red, WindowReducer) and not in_place:
        np.testing.assert_array_equal(red.arena.mine, np.full(n, -5, dtype))


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
    red = _reducer(name, transport, n, dtype)
    blocks = _owner_blocks(n, transport.size, scrambled)
    mine = _values(transport.rank, n, dtype)
    dst, src = _buffers(red, mine, in_place)
    red.reduce_to_owners(dst, src, blocks, ("test", []))
    r = transport.rank
    lo, hi = blocks.displs[r], blocks.displs[r] + blocks.counts[r]
    np.testing.assert_array_equal(dst[lo:hi], _total(transport.size, n, dtype, name)[lo:hi])


@pytest.mark.parametrize("name", reducers.NAMES)
def test_staged_wrapper_on_host_buffers_is_the_strategy(transport, name):
    from mpikv.transport.staging import Staging
    from mpikv.reducers.staged import StagedReducer
    red = StagedReducer(_reducer(name, transport), Staging())
    dst = _values(transport.rank, 50, np.float32)
    red.allreduce(dst, None, ("test", []))
    np.testing.assert_array_equal(dst, _total(transport.size, 50, np.float32))


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="reduce_scatter"):
        reducers.make("spiral", SimpleNamespace(size=1), PIECE)
    with pytest.raises(ValueError):
        reducers.check_name("copy+spiral")
