"""Reduction strategies: one abstract base, one module per strategy, a lazy factory.

| name | push with the default updater | push to the owners (updater, optimizer) |
| --- | --- | --- |
| ``allreduce`` | ``Allreduce`` in pieces | the same (owners use their blocks) |
| ``reduce_bcast`` | ``Reduce`` + ``Bcast`` per piece, roots taking turns | ``Reduce`` of each owner's block |
| ``reduce_bcast_blocks`` | ``Reduce`` of each rank's block to it, ``Bcast`` of each | ``Reduce`` of each owner's block |
| ``reduce_scatter`` | ``Reduce_scatter`` + ``Allgatherv`` | ``Reduce_scatter`` by owner blocks |
| ``shared`` | node shared memory (MPI-3 window), ``Allreduce`` across nodes | the same |
| ``hierarchical`` | ``Reduce`` in the node, ``Allreduce`` across nodes, ``Bcast`` in the node | ``Reduce`` in the node, ``Reduce_scatter`` of the nodes' parts across nodes, ``Scatterv`` in the node |
| ``ring`` | a ring of ``Sendrecv`` to near-equal blocks, ``Allgatherv`` | the ring to the owners' blocks |

Chosen by the store's state, not the table: ``compressed:2bit``,
``compressed:fp16``, ``compressed:bf16`` (:mod:`.compressed`, after
``set_gradient_compression``) and ``window`` (a key list's zero-copy buffers
in node shared memory, :class:`.shared.WindowReducer`).

Wrappers: ``copy+NAME`` copies an out-of-place input into the destination and
runs ``NAME`` in place; ``staged:NAME`` carries GPU buffers through pinned
host memory when MPI is not CUDA-aware. Which strategy moves which bucket is
decided by the tuning table (:mod:`mpikv.tuning.table`), once per bucket layout:
its column is in place or out of place when every rank gets the sum, and
``to_owners`` when only the owners do, on host or (where measured) GPU buffers.
"""

import importlib

from .base import Blocks, Reducer, even_blocks  # noqa: F401

#: name -> "module.Class", imported on first use.
STRATEGIES = {
    "allreduce": "allreduce.AllreduceReducer",
    "reduce_bcast": "reduce_bcast.ReduceBcastReducer",
    "reduce_bcast_blocks": "reduce_bcast_blocks.ReduceBcastBlocksReducer",
    "reduce_scatter": "reduce_scatter.ReduceScatterReducer",
    "shared": "shared.SharedMemoryReducer",
    "hierarchical": "hierarchical.HierarchicalReducer",
    "ring": "ring.RingReducer",
}
NAMES = tuple(STRATEGIES)
COPY = "copy+"


def strategy_class(name):
    """The class of a strategy name (imports its module)."""
    try:
        path = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown reduction strategy {name!r}; use one of "
                         f"{', '.join(NAMES)} (or copy+NAME)") from None
    module, cls = path.rsplit(".", 1)
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def check_name(name):
    """Raises ValueError unless ``name`` is a strategy or ``copy+`` one."""
    strategy_class(name[len(COPY):] if name.startswith(COPY) else name)


def usable(name, transport):
    """Whether ``name`` can run on ``transport`` (the same answer on every rank)."""
    base = name[len(COPY):] if name.startswith(COPY) else name
    return strategy_class(base).usable(transport)


def make(name, transport, piece_bytes):
    """A new reducer for ``name`` (``copy+NAME`` included)."""
    if name.startswith(COPY):
        from .copy import CopyFirstReducer
        return CopyFirstReducer(make(name[len(COPY):], transport, piece_bytes))
    return strategy_class(name)(transport, piece_bytes)


class Chooser:
    """Picks the reducer of each bucket: the one place that answers "how is it summed?".

    Compressed when compression is set (:mod:`mpikv.reducers.compressed`),
    else the window's when the bucket's zero-copy buffers live in node shared
    memory (:class:`~mpikv.reducers.shared.WindowReducer`), else the tuning
    table's strategy (one instance per name); GPU buffers are staged around
    any of them (:class:`~mpikv.reducers.staged.StagedReducer`).

    Args:
        transport: the store's transport.
        table: a :class:`mpikv.tuning.table.Table`.
        piece_bytes: the largest message of one collective.
    """

    def __init__(self, transport, table, piece_bytes):
        self.transport = transport
        self.table = table
        self.piece_bytes = piece_bytes
        #: the :class:`~mpikv.reducers.compressed.Compression` once set, else None
        self.compression = None
        self._made = {}
        self._staging = None

    def compress(self, config, per_device):
        """Compresses every bucket chosen from now on; residuals stay across changes.

        Args:
            config: a :func:`mpikv.arrays.compression.parse_params` result.
            per_device: each device value is a sender (the ``device`` store):
                the engine then compresses while it fills a bucket, and the
                ranks' sum is the table's.
        """
        if self.compression is None:
            from .compressed import Compression
            self.compression = Compression(config, per_device)
        else:
            self.compression.configure(config)

    def forget(self):
        """Drops the strategies made and the compression (the store is closed)."""
        self._made.clear()
        self.compression = None

    def get(self, bucket, nbytes, in_place, device=False, window=None, owners=False):
        """The reducer of one bucket.

        Args:
            bucket: the :class:`mpikv.core.fusion.Bucket` (compressed sums keep
                residuals per key).
            nbytes: its size in bytes (the table's row).
            in_place: the table's column; the same on every rank.
            device: whether its buffers are on a GPU (the table's ``device:``
                columns where measured).
            window: the bucket's :class:`~mpikv.transport.shm.SharedArena` when
                its zero-copy buffers are that window's segments and the sum
                goes to every rank, else None.
            owners: the sum goes to the owners only (an updater or optimizer
                runs there): the table's ``to_owners`` column.
        """
        comp = self.compression
        if comp is not None and not comp.per_device:
            from .compressed import CompressedReducer
            found = CompressedReducer(comp, self.transport, bucket)
        elif window is not None:
            from .shared import WindowReducer
            found = WindowReducer(self.transport, window)
        else:
            return self._strategy(nbytes, in_place, device, owners)
        return self._staged(found) if device else found

    def _strategy(self, nbytes, in_place, device, owners):
        name = self.table.choose(nbytes, in_place, owners, device)
        if (device and strategy_class(name.removeprefix(COPY)).host_only
                and not self.table.measured_on_device() and self._stage().direct):
            # A host column's winner that stages every GPU buffer, where MPI takes
            # them as they are and nothing was timed on the GPU: the direct default.
            name = "allreduce" if in_place or owners else COPY + "allreduce"
        if not usable(name, self.transport):
            # A forced or cached name this layout cannot run (shared memory with one
            # rank per node): the same answer on every rank, so the same fallback.
            name = "allreduce" if in_place or owners else COPY + "allreduce"
        key = (name, device)
        found = self._made.get(key)
        if found is None:
            found = make(name, self.transport, self.piece_bytes)
            self._made[key] = self._staged(found) if device else found
        return self._made[key]

    def _staged(self, reducer):
        from .staged import StagedReducer
        return StagedReducer(reducer, self._stage())

    def _stage(self):
        if self._staging is None:
            # The transport's own where it has one (MPITransport): one decision, one
            # fallback and one pool of host buffers for the store's device buffers.
            staging = getattr(self.transport, "staging", None)
            if staging is None:
                from ..transport.staging import Staging
                staging = Staging()
            self._staging = staging
        return self._staging
