"""``Allreduce``: every rank sends and gets the whole sum, in pieces."""

from .base import Reducer


class AllreduceReducer(Reducer):
    """``MPI_Allreduce`` of each piece, in place or out of place."""

    name = "allreduce"

    def allreduce(self, dst, src, what):
        t = self.transport
        if dst.nbytes <= self.piece_bytes:  # one piece: the common small call, kept short
            if src is None:
                t.allreduce_(dst, what)
            else:
                t.allreduce(src, dst, what)
            return
        for a, b in self._pieces(dst):
            if src is None:
                t.allreduce_(dst[a:b], what)
            else:
                t.allreduce(src[a:b], dst[a:b], what)
