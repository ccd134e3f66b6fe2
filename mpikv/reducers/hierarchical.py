"""Hierarchical: ``Reduce`` within each node, ``Allreduce`` across the nodes' leaders,
``Bcast`` within each node (Horovod's hierarchical allreduce); to the owners,
``Reduce`` within each node, ``Reduce_scatter`` across the leaders by node (each
node gets only what its ranks own), ``Scatterv`` of the owners' blocks in the node."""

from ..transport.spans import node_spans
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
            for a, b in self.pieces_of(dst):
                piece = dst[a:b]
                nodes.reduce_to_leader(piece, None if src is None else src[a:b])
                if leader and nodes.nodes > 1:
                    nodes.allreduce_across_(piece)
                nodes.bcast_from_leader_(piece)

    def reduce_to_owners(self, dst, src, blocks, what):
        # Between nodes each leader sends the whole buffer once and gets back only its
        # node's part: half an Allreduce's traffic on the link at two nodes.
        nodes = self.transport.nodes
        with self.transport.guard(what):
            for a, b in self.pieces_of(dst):
                nodes.reduce_to_leader(dst[a:b], None if src is None else src[a:b])
            if nodes.local_rank == 0 and nodes.nodes > 1:
                step = max(1, self.piece_bytes // dst.itemsize // nodes.nodes)
                nodes.reduce_scatter_across_(dst, node_spans(blocks, nodes.members), step)
            nodes.scatter_from_leader_(dst, blocks)
