"""Out of place as a copy, then any strategy in place."""

from .. import backends
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
        if src is not None:
            backends.copyto(dst, src)
        self.inner.allreduce(dst, None, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        if src is not None:
            backends.copyto(dst, src)
        self.inner.reduce_to_owners(dst, None, blocks, what)
