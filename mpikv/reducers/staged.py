"""GPU staging around any strategy: device buffers go to MPI directly where it is
CUDA-aware, else through pinned host buffers."""

from .. import backends, cuda
from .base import Reducer


class StagedReducer(Reducer):
    """Wraps a strategy for device buffers (host buffers pass straight through).

    With a CUDA-aware MPI the GPU's stream is synchronised and the device
    buffers go to the wrapped strategy as they are; if MPI then refuses a
    device buffer, the process stages from then on (:data:`mpikv.cuda.FALLBACK`,
    as :func:`mpikv.backends.device_collective` does). Otherwise the input is
    copied to a pinned host buffer, summed there, and copied back.

    Args:
        inner: the wrapped :class:`Reducer`.
        aware: whether MPI takes device buffers (:func:`mpikv.cuda.detect`).
        stager: a :class:`mpikv.backends.Stager`.
    """

    def __init__(self, inner, aware, stager):
        super().__init__(inner.transport, inner.piece_bytes)
        self.inner = inner
        self.name = f"staged:{inner.name}"
        self.aware = aware
        self.stager = stager

    def allreduce(self, dst, src, what):
        self._run(self.inner.allreduce, dst, src, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        self._run(lambda d, s, w: self.inner.reduce_to_owners(d, s, blocks, w), dst, src, what)

    def _run(self, fn, dst, src, what):
        if not backends.is_device(dst) and (src is None or not backends.is_device(src)):
            return fn(dst, src, what)
        if self.aware and not self.inner.host_only and not cuda.FALLBACK.happened:
            for buf in (dst, src):
                if backends.is_device(buf):
                    self.stager._synchronize(buf)
            errors = backends._mpi_errors()
            try:
                return fn(dst, src, what)
            except errors as exc:
                cuda.FALLBACK.record(f"{type(exc).__name__}: {exc}")
        st = self.stager
        host_src = None if src is None else (st.to_host(src) if backends.is_device(src)
                                             else src)
        host_dst = st.to_host(dst) if src is None else st.acquire(dst.dtype, dst.size)
        try:
            fn(host_dst, host_src, what)
            st.to_device(host_dst, dst)
        finally:
            st.release(host_dst)
            if host_src is not None and host_src is not src:
                st.release(host_src)
