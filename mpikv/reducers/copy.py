"""Out of place as a copy, then any strategy in place."""

import numpy as np

from ..arrays import backends
from .base import Reducer


class CopyFirstReducer(Reducer):
    """Copies ``src`` into ``dst``, then sums ``dst`` in place with ``inner``.

    In-place collectives beat out-of-place ones by 20-50 % at 1 MiB and
    above on both Open MPI and MPICH, enough to pay for the copy; the tuner
    measures both (``copy+NAME`` against ``NAME`` out of place).
    """

    def __init__(self, inner):
        super().__init__(inner.transport, inner.piece_bytes)
        self.inner = inner
        self.name = f"copy+{inner.name}"
        self.host_only = inner.host_only
        self.elementwise = inner.elementwise

    @classmethod
    def usable(cls, transport):
        return True

    def allreduce(self, dst, src, what):
        self._copy(dst, src)
        self.inner.allreduce(dst, None, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        self._copy(dst, src)
        self.inner.reduce_to_owners(dst, None, blocks, what)

    @staticmethod
    def _copy(dst, src):
        if src is None:
            return
        backends.copyto(dst, src)
        if type(dst) is not np.ndarray:
            # A device copy is a queued kernel; a CUDA-aware MPI that the inner strategy
            # calls straight (hierarchical's node calls) would read dst before it ran.
            backends.synchronize(dst)
