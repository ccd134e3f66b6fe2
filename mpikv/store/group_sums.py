"""A process group's sums through the store's strategies and tuner (issue 42).

The ``"mpikv"`` torch backend (:mod:`mpikv.torch.process_group`) sums
``all_reduce``'s (and ``reduce_scatter``'s) float32, float64, int32 and int64
tensors as a store sums a bucket (or sums one to its owners): a transport of its
own over the group's ranks, the tuning table (cached per layout, probed once
where none is cached, ``MPIKV_AUTOTUNE``), and the
strategy the table names for the size (ring, hierarchical, shared memory, MPI's
own ``Allreduce``, each in pieces). Other dtypes and reduce ops go through MPI's
``Allreduce`` on the group's communicator.
"""

import dataclasses
import hashlib

import numpy as np

from . import config
from .. import errors
from ..arrays.backends import is_device
from ..reducers import Chooser
from ..reducers.base import Blocks
from ..transport import make_transport
from ..tuning import table as tuning

#: the dtypes the strategies sum (MPI's own types, no conversion)
SUMMED = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


class GroupSums:
    """The store's sums over the ranks of ``wire`` (a :class:`~mpikv.transport.group.GroupComm`).

    Collective over those ranks. The settings are the environment's (``MPIKV_REDUCER``,
    ``MPIKV_AUTOTUNE``, ``MPIKV_BUCKET_BYTES``, ``MPIKV_SHARED_MEMORY``,
    ``MPIKV_TIMEOUT``), agreed at creation: ranks that differ get the same
    :class:`~mpikv.errors.InputError`.
    """

    def __init__(self, wire):
        options = dataclasses.replace(config.resolve(), fault_tolerant=False)
        said = (options.reducer, options.autotune, options.bucket_bytes,
                options.shared_memory)
        digest = int.from_bytes(hashlib.blake2b(repr(said).encode(), digest_size=7).digest(),
                                "little")
        same, _ = wire.agree(digest, None)
        if not same:
            every = wire.allgather_object(said)
            raise errors.InputError(
                "the ranks of the mpikv process group have different settings (reducer, "
                "autotune, bucket bytes, shared memory): " +
                "; ".join(f"rank {r}: {s}" for r, s in enumerate(every)))
        self.transport = make_transport("mpi", wire.comm, options)
        self.table = tuning.resolve(self.transport, options.reducer, options.autotune)
        self.chooser = Chooser(self.transport, self.table, options.bucket_bytes)

    def takes(self, buf):
        """Whether :meth:`allreduce_` sums ``buf`` (else MPI's ``Allreduce`` must)."""
        return buf.dtype in SUMMED and buf.flags.c_contiguous

    def strategy(self, nbytes):
        """The name of the strategy that sums ``nbytes`` in place."""
        return self.table.choose(nbytes, True)

    def allreduce_(self, buf, what):
        """Every rank's ``buf`` (a contiguous numpy or cupy array) becomes the sum over
        the ranks; a GPU buffer goes to MPI direct or staged, as a store's
        (:class:`~mpikv.reducers.staged.StagedReducer`)."""
        flat = buf.reshape(-1)
        self.chooser.get(None, flat.nbytes, True, device=is_device(flat)).allreduce(
            flat, None, what)

    def strategy_to_owners(self, nbytes):
        """The name of the strategy that reduce-scatters ``nbytes``."""
        return self.table.choose(nbytes, True, True)

    def reduce_scatter(self, dst, src, what):
        """Rank r's block r of ``dst`` (``dst.size / ranks`` elements each, in rank order)
        becomes the sum over the ranks of that block of ``src`` (which is only read);
        ``dst``'s other blocks are left undefined. Both contiguous numpy or cupy arrays
        of one dtype and size; a GPU buffer goes direct or staged, as a store's."""
        p = self.transport.size
        n = dst.size // p
        blocks = Blocks((n,) * p, tuple(range(0, n * p, n)))
        self.chooser.get(None, dst.nbytes, True, device=is_device(dst), owners=True) \
            .reduce_to_owners(dst.reshape(-1), src.reshape(-1), blocks, what)

    def close(self):
        """Frees the transport's communicators (collective)."""
        self.chooser.forget()
        self.transport.close()


__all__ = ["SUMMED", "GroupSums"]
