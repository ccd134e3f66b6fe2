"""``Allreduce``: every rank sends and gets the whole sum, in pieces."""

import numpy as np

from ..arrays import backends
from .base import Reducer


class AllreduceReducer(Reducer):
    """``MPI_Allreduce`` of each piece, always with ``MPI_IN_PLACE``.

    MPI wants ``MPI_IN_PLACE`` on every rank of an ``Allreduce`` or on none, and
    whether a rank's input is its destination depends on that rank's arrays, so
    an out-of-place input is copied into the destination piece by piece first.
    """

    name = "allreduce"
    # Each piece of the buffer is summed by calls of its own already.
    elementwise = True

    def allreduce(self, dst, src, what):
        t = self.transport
        copy = (np.copyto if type(dst) is np.ndarray and type(src) is np.ndarray
                else backends.copyto)
        if dst.nbytes <= self.piece_bytes:  # one piece: the common small call, kept short
            if src is not None:
                copy(dst, src)
            t.allreduce_(dst, what)
            return
        for a, b in self.pieces_of(dst):
            if src is not None:
                copy(dst[a:b], src[a:b])
            t.allreduce_(dst[a:b], what)
