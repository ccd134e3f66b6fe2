"""Counting the bytes a store's collectives move, for tests and ``bench compression``.

:meth:`Transport.count_bytes <mpikv.transport.base.Transport.count_bytes>`
puts a :class:`CountingComm` in front of the MPI transport's communicator for
the length of a ``with`` block (:func:`counting_comm`); nothing is counted,
and nothing costs more, outside one. :func:`counting` does it for a store.

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
def counting_comm(transport):
    """Puts a :class:`CountingComm` in front of ``transport.comm`` inside the block.

    What :meth:`mpikv.transport.mpi.MPITransport.count_bytes` runs; the
    transport's own communicator comes back on exit.
    """
    real = transport.comm
    counter = CountingComm(real)
    transport.comm = counter
    try:
        yield counter
    finally:
        transport.comm = real


class Nothing:
    """The counter of a transport that moves nothing: ``bytes`` stays 0, ``calls`` empty."""

    def __init__(self):
        self.bytes = 0
        self.calls = Counter()


@contextlib.contextmanager
def nothing_counted():
    """Yields a :class:`Nothing` (:meth:`mpikv.transport.base.Transport.count_bytes`)."""
    yield Nothing()


def counting(kv):
    """Counts the bytes ``kv``'s collectives bring to this rank inside the block.

    The same as ``kv.count_bytes()`` (:meth:`mpikv.store.kvstore.KVStore.count_bytes`),
    kept for the tests and benchmarks that use it. Yields the counter
    (``.bytes``, ``.calls``); a local store moves nothing, and its counter
    stays at 0.
    """
    return kv.count_bytes()


__all__ = ["CountingComm", "Nothing", "counting", "counting_comm", "nothing_counted"]
