"""Counting the bytes a store's collectives move, for tests and ``bench compression``.

:func:`counting` puts a :class:`CountingComm` in front of a store's MPI
communicator for the length of a ``with`` block; nothing is counted, and
nothing costs more, outside one.

What is counted is the payload each collective must deliver to this rank
(bytes received), which does not depend on the algorithm MPI picks, except
for reductions, counted as their bandwidth-optimal algorithms move them
(a reduce-scatter, then a gather where every rank needs the sums):

| collective | bytes this rank receives (``n``: the buffer's bytes, ``P`` ranks) |
| --- | --- |
| ``Alltoallv`` | what every other rank sends it |
| ``Allgatherv`` | every block but its own |
| ``Bcast`` | ``n``, except on the root |
| ``Reduce_scatter`` | its block from each of the ``P - 1`` others |
| ``Allreduce`` | ``2 (P - 1) n / P`` |
| ``Reduce`` | ``(P - 1) n / P``, twice that on the root |
"""

import contextlib
from collections import Counter


def _nbytes(spec):
    """Bytes of a buffer or of an mpi4py buffer spec ``[buf, (counts, displs), type]``."""
    buf = spec[0] if isinstance(spec, (list, tuple)) else spec
    return int(buf.nbytes)


def _counts(spec):
    """``(counts, itemsize)`` of an mpi4py vector spec ``[buf, (counts, displs), type]``."""
    return list(spec[1][0]), int(spec[0].itemsize)


class CountingComm:
    """An mpi4py communicator that counts the data its collectives bring to this rank.

    Every attribute it does not count is the wrapped communicator's.

    Attributes:
        bytes: bytes received so far (see the module's table).
        calls: collective name -> calls made.
    """

    def __init__(self, comm):
        self._comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.bytes = 0
        self.calls = Counter()

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _add(self, name, nbytes):
        self.calls[name] += 1
        self.bytes += int(round(nbytes))

    def Allreduce(self, sendbuf, recvbuf, *args, **kwargs):  # noqa: N802 - mpi4py's name
        self._comm.Allreduce(sendbuf, recvbuf, *args, **kwargs)
        p = self.size
        self._add("Allreduce", 2 * (p - 1) * _nbytes(recvbuf) / p)

    def Reduce(self, sendbuf, recvbuf, *args, root=0, **kwargs):  # noqa: N802
        self._comm.Reduce(sendbuf, recvbuf, *args, root=root, **kwargs)
        p = self.size
        n = _nbytes(recvbuf if self.rank == root else sendbuf)
        self._add("Reduce", (p - 1) * n / p * (2 if self.rank == root else 1))

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, *args, **kwargs):  # noqa: N802
        self._comm.Reduce_scatter(sendbuf, recvbuf, recvcounts, *args, **kwargs)
        self._add("Reduce_scatter", (self.size - 1) * _nbytes(recvbuf))

    def Bcast(self, buf, root=0):  # noqa: N802
        self._comm.Bcast(buf, root=root)
        self._add("Bcast", 0 if self.rank == root else _nbytes(buf))

    def Allgatherv(self, sendbuf, recvbuf):  # noqa: N802
        self._comm.Allgatherv(sendbuf, recvbuf)
        counts, itemsize = _counts(recvbuf)
        self._add("Allgatherv", (sum(counts) - counts[self.rank]) * itemsize)

    def Alltoallv(self, sendbuf, recvbuf):  # noqa: N802
        self._comm.Alltoallv(sendbuf, recvbuf)
        counts, itemsize = _counts(recvbuf)
        self._add("Alltoallv", (sum(counts) - counts[self.rank]) * itemsize)


@contextlib.contextmanager
def counting(kv):
    """Counts the bytes ``kv``'s collectives bring to this rank inside the block.

    Yields a :class:`CountingComm` (``.bytes``, ``.calls``). A local store
    moves nothing: it yields a counter that stays at 0. Waits for the
    store's background calls on entry and exit, so every counted call
    started and ended inside the block.
    """
    kv.wait()
    transport = kv._transport
    real = getattr(transport, "comm", None)
    if real is None:
        yield _Nothing()
        return
    counter = CountingComm(real)
    transport.comm = counter
    try:
        yield counter
    finally:
        kv.wait()
        transport.comm = real


class _Nothing:
    bytes = 0
    calls = Counter()


__all__ = ["CountingComm", "counting"]
