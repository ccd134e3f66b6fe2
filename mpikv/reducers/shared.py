"""Node shared memory: inputs copied into an MPI-3 shared window, summed from the peers'
segments in place, the sum read straight into the destination."""

import numpy as np

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
