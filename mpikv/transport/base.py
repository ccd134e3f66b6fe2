"""The operations a store needs from its peers, named after their MPI calls."""

from abc import ABC, abstractmethod

#: what :meth:`Transport.agree` found: ranks differ or one has an input error
DIFFER = 0
#: every rank made the same call
AGREED = 1
#: some ranks have joined (:meth:`mpikv.KVStore.join`): the records decide
JOINED = 2


class Transport(ABC):
    """Collective operations on flat, contiguous numpy buffers, in place.

    Every method is collective: all ranks call it in the same order. ``what``
    is ``(operation, keys)`` of the store call, for the message if it times out.
    """

    rank = 0
    size = 1
    library = "none"
    threaded = False   # whether data may move on a worker thread
    agreements = 0     # agreements so far (the same count on every rank)
    #: what to do when this rank waits past the timeout for ranks that do not arrive
    #: (the caller's words, from the store's context; :meth:`Protocol.set_context`)
    late_hint = None

    @abstractmethod
    def agree(self, digest, has_error, what):
        """Compares a call across ranks.

        Returns:
            :data:`AGREED` when every rank has the same digest and no input
            error, :data:`JOINED` when some rank has joined (then every rank
            gathers the records to decide), else :data:`DIFFER`.
        """

    def close(self):
        """Releases what the transport holds (after every rank's last call on it)."""

    def world_rank(self, rank):
        """The ``COMM_WORLD`` rank of the transport's ``rank`` (None if it has none)."""
        return rank

    def wait_joined(self, ticket, what):
        """A joined rank's side of the next :meth:`agree` of the others.

        Args:
            ticket: a positive int, larger for a later join; the largest
                ticket of the last agreement names the last rank to join.

        Returns:
            ``(whether some rank has not joined, the largest ticket)``.
        """
        return False, ticket

    @abstractmethod
    def allgather_records(self, record, what):
        """Returns every rank's (JSON-able) record, in rank order."""

    def bcast_record(self, record, root, what):
        """Returns ``root``'s (JSON-able) record on every rank (tuples come back as lists)."""
        return record

    def count_bytes(self):
        """A context manager that counts the bytes the data collectives bring to this rank.

        Yields an object with ``bytes`` and ``calls`` (collective name -> calls);
        see :mod:`mpikv.transport.counting` for what is counted. Nothing is
        counted, and nothing costs more, outside the block. This default moves
        nothing, so its counter stays at 0. The caller makes sure no collective
        runs on another thread meanwhile.
        """
        from .counting import nothing_counted
        return nothing_counted()

    @abstractmethod
    def allreduce_(self, buf, what):
        """Sums ``buf`` over ranks; every rank gets the sum."""

    @abstractmethod
    def reduce_(self, buf, root, what):
        """Sums ``buf`` over ranks into ``buf`` on ``root``."""

    @abstractmethod
    def reduce_scatter_(self, buf, counts, displs, what):
        """Sums ``buf`` over ranks; rank r gets its block ``buf[displs[r]:+counts[r]]``.

        The blocks lie in rank order. Other blocks of ``buf`` are left undefined.
        """

    @abstractmethod
    def bcast_(self, buf, root, what):
        """Copies ``buf`` from ``root`` to every rank."""

    @abstractmethod
    def allgatherv_(self, buf, counts, displs, what):
        """Each rank's ``buf[displs[r]:displs[r]+counts[r]]`` goes to every rank."""

    @abstractmethod
    def barrier(self, what):
        """Waits until every rank has arrived."""

    def alltoallv(self, send, scounts, sdispls, recv, rcounts, rdispls, what):
        """Rank r gets ``send[sdispls[r]:+scounts[r]]`` of every rank s, at
        ``recv[rdispls[s]:+rcounts[s]]`` (host buffers of one dtype; counts in elements).

        Only compressed pushes use it (:mod:`mpikv.reducers.compressed`). One rank sends
        its block to itself.
        """
        recv[rdispls[0]:rdispls[0] + rcounts[0]] = send[sdispls[0]:sdispls[0] + scounts[0]]

    def pass_along(self, header, data, what, out=None):
        """Sends ``header`` (picklable) and ``data`` (a 1-d uint8 host array) to the
        next rank, ``(rank + 1) % size``, and returns the previous rank's
        ``(header, data)``, its data received into ``out`` if that has its size.
        One rank gets its own back."""
        return header, data

    # Out of place: ``src`` is read, ``dst`` written. The defaults copy, then run
    # in place (a local store's collectives are identities anyway).
    def reduce(self, src, dst, root, what):
        """``dst`` on ``root`` becomes the sum of ``src``; ``dst`` elsewhere is untouched."""
        if self.rank == root:
            _copy(dst, src)
        self.reduce_(dst if self.rank == root else src, root, what)

    def reduce_scatter(self, src, dst, counts, displs, what):
        """Rank r's block ``dst[displs[r]:+counts[r]]`` becomes the sum of that block of ``src``."""
        _copy(dst, src)
        self.reduce_scatter_(dst, counts, displs, what)

    def guard(self, what):
        """A context manager under which a raw MPI call may block (the watchdog's)."""
        import contextlib
        return contextlib.nullcontext()

    def shared_arena(self, size, dtype):
        """A node-local shared bucket (see :mod:`mpikv.transport.shm`), or None."""
        return None

    def describe(self):
        """A dict of facts for ``info`` and logs."""
        return {"transport": type(self).__name__, "rank": self.rank, "size": self.size}


def _copy(dst, src):
    from ..arrays.backends import copyto
    copyto(dst, src)
