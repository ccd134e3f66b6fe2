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
