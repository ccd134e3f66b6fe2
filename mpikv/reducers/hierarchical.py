"""Hierarchical: ``Reduce`` within each node, ``Allreduce`` across the nodes' leaders,
``Bcast`` within each node (Horovod's hierarchical allreduce)."""

from mpi4py import MPI

from .base import Reducer


class HierarchicalReducer(Reducer):
    """Only one rank per node (node rank 0) sends data between nodes, once per piece."""

    name = "hierarchical"

    @classmethod
    def usable(cls, transport):
        return transport.size > 1 and hasattr(transport, "nodes")

    def allreduce(self, dst, src, what):
        nodes = self.transport.nodes
        node, leader = nodes.node, nodes.local_rank == 0
        with self.transport.guard(what):
            for a, b in self._pieces(dst):
                piece = dst[a:b]
                if src is None:
                    node.Reduce(MPI.IN_PLACE if leader else piece, piece if leader else None,
                                op=MPI.SUM, root=0)
                else:
                    node.Reduce(src[a:b], piece if leader else None, op=MPI.SUM, root=0)
                if leader and nodes.nodes > 1:
                    nodes.across.Allreduce(MPI.IN_PLACE, piece, op=MPI.SUM)
                node.Bcast(piece, root=0)
