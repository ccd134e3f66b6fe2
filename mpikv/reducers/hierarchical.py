"""Hierarchical: ``Reduce`` within each node, ``Allreduce`` across the nodes' leaders,
``Bcast`` within each node (Horovod's hierarchical allreduce)."""

from .base import Reducer


class HierarchicalReducer(Reducer):
    """Only one rank per node (node rank 0) sends data between nodes, once per piece.

    The MPI calls are the node group's (:class:`mpikv.transport.shm.NodeGroup`).
    """

    name = "hierarchical"
    # Each piece of the buffer is summed by calls of its own already.
    elementwise = True

    @classmethod
    def usable(cls, transport):
        return transport.size > 1 and hasattr(transport, "nodes")

    def allreduce(self, dst, src, what):
        nodes = self.transport.nodes
        leader = nodes.local_rank == 0
        with self.transport.guard(what):
            for a, b in self._pieces(dst):
                piece = dst[a:b]
                nodes.reduce_to_leader(piece, None if src is None else src[a:b])
                if leader and nodes.nodes > 1:
                    nodes.allreduce_across_(piece)
                nodes.bcast_from_leader_(piece)
