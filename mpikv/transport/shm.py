"""Node-local shared memory: buckets in MPI-3 shared windows, summed straight from peers.

Ranks of one node put a bucket's gradients in their own segment of a shared
window. Each rank then sums its slice of the bucket straight from every
peer's segment, into its own segment (nobody else reads that slice of it);
across nodes, the ranks with the same node-local rank sum their slices with
one ``Allreduce`` (a hierarchical reduction); finally each rank copies the
other slices' sums from their owners' segments. No MPI message carries the
data inside a node.
"""

import atexit

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from ..arrays import backends
from .spans import copy_runs

# In creation order: freeing a window is collective, so every rank must free its
# windows in the same order (they were created collectively, in the same order).
_live = []


@atexit.register
def free_all():
    """Frees every window (collective). Windows must be freed before MPI_Finalize,
    which mpi4py runs at exit after this (it registered first), and only once no
    background call still uses them: stores drain their calls before this runs."""
    for arena in list(_live):
        arena.free()


class NodeGroup:
    """The node-local communicator of a store, and the one across nodes.

    Collective over ``comm``. ``usable`` is False (the same on every rank)
    when nodes hold different numbers of ranks or there is one rank per node:
    the plain MPI path is then used.
    """

    def __init__(self, comm, node=None):
        # ``node``: tests pass a split of one machine's ranks to act as several nodes.
        self.node = node if node is not None else comm.Split_type(MPI.COMM_TYPE_SHARED,
                                                                  key=comm.Get_rank())
        self.local_rank = self.node.Get_rank()
        self.local_size = self.node.Get_size()
        sizes = comm.allgather(self.local_size)
        self.usable = len(set(sizes)) == 1 and self.local_size > 1
        # Ranks with the same node-local rank, one per node.
        self.across = comm.Split(self.local_rank, comm.Get_rank())
        self.nodes = self.across.Get_size()
        # Which ranks of ``comm`` each node holds, nodes in the order of the leaders'
        # ``across`` ranks, ranks in node-rank order: a sum to the owners sends
        # between leaders only what each node's ranks own (see spans.node_spans).
        leaders = comm.allgather(self.node.bcast(comm.Get_rank(), root=0))
        firsts = sorted(set(leaders))
        self.members = [[r for r, lead in enumerate(leaders) if lead == f] for f in firsts]
        self.node_index = firsts.index(leaders[comm.Get_rank()])

    # The steps of a hierarchical sum (:mod:`mpikv.reducers.hierarchical`); host buffers.
    def reduce_to_leader(self, dst, src=None):
        """Sums the node's ``src`` (None: ``dst``, in place) into ``dst`` on node rank 0."""
        leader = self.local_rank == 0
        if src is None:
            self.node.Reduce(MPI.IN_PLACE if leader else dst, dst if leader else None,
                             op=MPI.SUM, root=0)
        else:
            self.node.Reduce(src, dst if leader else None, op=MPI.SUM, root=0)

    def allreduce_across_(self, buf):
        """Sums ``buf`` over the ranks of this node rank, one per node (all of them call it)."""
        self.across.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def bcast_from_leader_(self, buf):
        """Copies node rank 0's ``buf`` to the node's other ranks."""
        self.node.Bcast(buf, root=0)

    # The steps of a hierarchical sum to the owners; the leaders hold their node's sum.
    def reduce_scatter_across_(self, buf, spans, step):
        """Leader of node j: its ``spans[j]`` of ``buf`` become the sum over the leaders.

        In rounds: in round k each node's part contributes its elements
        ``[k * step, (k + 1) * step)``, packed in node order for one
        ``Reduce_scatter`` (a split key's shards or ranks not placed by node
        leave a node's part in several runs; packing serves every placement).
        One call of the whole 64 MiB buffer took 1.34 s on the 2 x 2 cluster at
        1 Gbit/s, in 4 MiB pieces 0.56 s (2026-11-26).

        Args:
            buf: the node's sum (every element), the same size on every leader.
            spans: per node, ``[(start, count)]`` of what its ranks own
                (:func:`~mpikv.transport.spans.node_spans`); other elements are
                left as they were.
            step: elements per node and round (at least 1).
        """
        counts = [sum(c for _, c in s) for s in spans]
        me = self.across.Get_rank()
        kind, dev = backends.kind_of(buf), backends.device_of(buf)
        recv = backends.empty(kind, counts[me], buf.dtype, dev)
        send = backends.empty(kind, min(step, max(counts)) * len(spans), buf.dtype, dev)
        for lo in range(0, max(counts), step):
            sizes = [max(0, min(step, c - lo)) for c in counts]
            at = 0
            for runs, size in zip(spans, sizes):
                copy_runs(send[at:at + size], buf, runs, lo)
                at += size
            _written(send)
            self.across.Reduce_scatter(send[:at], recv[lo:lo + sizes[me]], recvcounts=sizes,
                                       op=MPI.SUM)
        at = 0
        for start, count in spans[me]:
            buf[start:start + count] = recv[at:at + count]
            at += count
        _written(buf)

    def scatter_from_leader_(self, buf, blocks):
        """Each rank of the node gets its block of node rank 0's ``buf`` (``Scatterv``).

        Args:
            buf: on the leader, holds the node's blocks; elsewhere, receives its own.
            blocks: per rank of the store's communicator, ``counts`` and ``displs``.
        """
        ranks = self.members[self.node_index]
        if len(ranks) == 1:
            return
        counts = [blocks.counts[r] for r in ranks]
        displs = [blocks.displs[r] for r in ranks]
        if self.local_rank == 0:
            self.node.Scatterv([buf, (counts, displs), from_numpy_dtype(buf.dtype)],
                               MPI.IN_PLACE, root=0)
        else:
            me = self.local_rank
            self.node.Scatterv(None, buf[displs[me]:displs[me] + counts[me]], root=0)


def _written(buf):
    """A device buffer's copies have run before MPI reads it (CUDA-aware MPI waits
    for no stream); a host buffer needs nothing."""
    if type(buf) is not np.ndarray:
        backends.synchronize(buf)


class SharedArena:
    """A bucket's buffers: one segment per rank of the node, each a numpy view.

    Collective over the node. ``mine`` is this rank's segment (its zero-copy
    gradient buffer); ``segments[r]`` is node rank r's, readable in place.
    """

    def __init__(self, group, size, dtype):
        dtype = np.dtype(dtype)
        self.group = group
        self.size = size
        self.win = MPI.Win.Allocate_shared(max(size, 1) * dtype.itemsize, dtype.itemsize,
                                           comm=group.node)
        self.segments = []
        for r in range(group.local_size):
            buf, _ = self.win.Shared_query(r)
            self.segments.append(np.frombuffer(buf, dtype, count=size))
        self.mine = self.segments[group.local_rank]
        self.mine[...] = 0
        # One passive-target epoch for the window's life: Sync + Barrier order the
        # loads and stores of the ranks (MPI-3's unified memory model).
        self.win.Lock_all(MPI.MODE_NOCHECK)
        _live.append(self)

    def _fence(self):
        self.win.Sync()
        self.group.node.Barrier()
        self.win.Sync()

    def allreduce(self, size=None, out=None):
        """Sums ``mine[:size]`` over every rank of every node (collective).

        The sum lands in ``mine`` or, if given, in ``out`` (a flat array of
        ``size`` elements), read straight from the owners' segments.
        """
        g, n = self.group, self.size if size is None else size
        L, r = g.local_size, g.local_rank
        bounds = [(n * k // L, n * (k + 1) // L) for k in range(L)]
        lo, hi = bounds[r]
        self._fence()                      # every rank's gradients are written
        mine = self.mine[lo:hi]
        for k in range(L):
            if k != r:
                np.add(mine, self.segments[k][lo:hi], out=mine)
        if g.nodes > 1:                    # the same slice on every node
            g.across.Allreduce(MPI.IN_PLACE, mine, op=MPI.SUM)
        self._fence()                      # every slice is summed
        for k, (a, b) in enumerate(bounds):
            if out is not None:
                out[a:b] = self.segments[k][a:b]
            elif k != r:
                self.mine[a:b] = self.segments[k][a:b]
        self._fence()                      # nobody reads our slice any more

    def free(self):
        if self.win is not None:
            self.segments = self.mine = None
            try:
                self.win.Unlock_all()
                self.win.Free()
            except MPI.Exception:
                pass
            self.win = None
            _live.remove(self)
