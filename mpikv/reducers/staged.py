"""GPU staging around any strategy: device buffers go to MPI directly where it is
CUDA-aware, else through pinned host buffers (:mod:`mpikv.transport.staging`)."""

from .base import Reducer


class StagedReducer(Reducer):
    """Wraps a strategy for device buffers (host buffers pass straight through).

    The store's one :class:`~mpikv.transport.staging.Staging` decides: with a
    CUDA-aware MPI the device buffers go to the wrapped strategy as they are
    (and the process stages from then on if MPI refuses one); otherwise the
    input is copied to a pinned host buffer, summed there, and copied back;
    for an ``elementwise`` strategy's ``allreduce``, a large buffer in pieces
    whose copies overlap MPI (:mod:`mpikv.transport.pipeline`).
    A strategy that works on host memory only (``host_only``) is always staged.

    Args:
        inner: the wrapped :class:`Reducer`.
        staging: the store's :class:`mpikv.transport.staging.Staging` (its transport's).
    """

    def __init__(self, inner, staging):
        super().__init__(inner.transport, inner.piece_bytes)
        self.inner = inner
        self.name = f"staged:{inner.name}"
        self.staging = staging

    def allreduce(self, dst, src, what):
        # An elementwise strategy may be staged in pieces whose copies overlap MPI;
        # reduce_to_owners stays whole (its blocks are the whole buffer's).
        self.staging.run(lambda d, s: self.inner.allreduce(d, s, what), dst, src,
                         host_only=self.inner.host_only,
                         pieces=getattr(self.inner, "elementwise", False))

    def reduce_to_owners(self, dst, src, blocks, what):
        self.staging.run(lambda d, s: self.inner.reduce_to_owners(d, s, blocks, what), dst, src,
                         host_only=self.inner.host_only)
