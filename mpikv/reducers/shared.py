"""Node shared memory: buffers in an MPI-3 shared window, summed from the peers'
segments in place, the sum read straight into the destination.

Two strategies: ``shared`` copies a bucket into a scratch window of its own;
``window`` sums the zero-copy gradient buffers, which are window segments.
"""

import numpy as np

from ..arrays import backends

from .base import Reducer


class SharedMemoryReducer(Reducer):
    """Each rank sums one slice of the buffer from every node peer's segment
    (:class:`mpikv.transport.shm.SharedArena`); across nodes the slices go
    through ``Allreduce``. Usable where every node runs the same number (more
    than one) of the store's ranks. The window is scratch, grown as needed."""

    name = "shared"
    host_only = True

    def __init__(self, transport, piece_bytes):
        super().__init__(transport, piece_bytes)
        self._arenas = {}   # dtype -> SharedArena

    @classmethod
    def usable(cls, transport):
        return transport.size > 1 and hasattr(transport, "nodes") and transport.nodes.usable

    def _arena(self, dtype, size):
        arena = self._arenas.get(dtype)
        if arena is None or arena.size < size:
            if arena is not None:
                arena.free()   # collective, like the allocation: same place on every rank
            from ..transport.shm import SharedArena
            arena = self._arenas[dtype] = SharedArena(self.transport.nodes, size, dtype)
        return arena

    def allreduce(self, dst, src, what):
        arena = self._arena(np.dtype(dst.dtype), dst.size)
        np.copyto(arena.mine[:dst.size], dst if src is None else src)
        with self.transport.guard(what):
            arena.allreduce(dst.size, out=dst)


class WindowReducer(Reducer):
    """A key list's zero-copy buckets in node shared memory: each rank's gradient
    buffer is its segment of the bucket's window, summed where it lies.

    Every rank of a push of such a key list comes here (the same collectives
    whether or not its own input is its buffer). A rank whose buffers are the
    destination (it pushed exactly them, or they became its stored values)
    sums in place; a rank that pushed other arrays into stored values of their
    own lends its segment to carry them and gets its buffer back as it was,
    so such a push leaves the buffers alone, as it does on one rank.

    Args:
        transport: the store's transport.
        arena: the bucket's :class:`mpikv.transport.shm.SharedArena`.
    """

    name = "window"
    host_only = True

    def __init__(self, transport, arena):
        super().__init__(transport, 0)
        self.arena = arena

    @classmethod
    def usable(cls, transport):
        return SharedMemoryReducer.usable(transport)

    def allreduce(self, dst, src, what):
        arena = self.arena
        mine = arena.mine
        n = dst.size
        if backends.same_memory(dst, mine):
            # The buffers are (or now hold) the stored values: the sum goes there.
            if src is not None:
                np.copyto(mine, src)
            with self.transport.guard(what):
                arena.allreduce()
            return
        kept = mine.copy()
        np.copyto(mine[:n], dst if src is None else src)
        out = dst if not np.may_share_memory(dst, mine) else np.empty_like(dst)
        try:
            with self.transport.guard(what):
                arena.allreduce(n, out=out)
        finally:
            np.copyto(mine, kept)
        if out is not dst:
            np.copyto(dst, out)

