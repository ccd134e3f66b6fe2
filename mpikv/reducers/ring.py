"""A ring of ``Sendrecv``: each owner's block summed hop by hop, for links between hosts.

Across a 1 Gb/s link (two network-namespace hosts, Open MPI 5.0.11 over TCP,
44.7 MB of float32: ``../shared/notes/cluster_anchors.md``) a ring of ``Sendrecv``
reduce-scattered in 216-221 ms, the bandwidth bound being 179 ms, where Open MPI's
default ``Reduce_scatter_block`` took 570-584 ms. Each rank sends and receives
(P - 1)/P of the buffer once, whatever MPI's collective tuning picks.
"""

import numpy as np

from .base import Reducer
from .reduce_scatter import ReduceScatterReducer


class RingReducer(Reducer):
    """``reduce_to_owners``: P - 1 steps; at step k rank r sends its partial sum of
    block r - k - 1 to rank r + 1 and adds rank r - 1's partial of block r - k - 2
    into its own, so that after the last step it holds the whole sum of block r.
    ``allreduce``: the same over near-equal blocks, then ``Allgatherv``."""

    name = "ring"
    # The blocks are the whole buffer's: no pieces of it sum alone.
    elementwise = False
    # It adds received blocks with numpy: a GPU buffer is staged around it.
    host_only = True

    @classmethod
    def usable(cls, transport):
        return transport.size > 1 and hasattr(transport, "comm")

    allreduce = ReduceScatterReducer.allreduce   # to the owners, then Allgatherv

    def reduce_to_owners(self, dst, src, blocks, what):
        t = self.transport
        n, r = t.size, t.rank
        if src is not None:
            dst[...] = src
        counts, displs = blocks.counts, blocks.displs
        scratch = np.empty(max(counts), dst.dtype)
        right, left = (r + 1) % n, (r - 1) % n
        step = max(1, self.piece_bytes // dst.itemsize)
        with t.guard(what):
            for k in range(n - 1):
                out, into = (r - k - 1) % n, (r - k - 2) % n
                send = dst[displs[out]:displs[out] + counts[out]]
                mine = dst[displs[into]:displs[into] + counts[into]]
                # In pieces of at most piece_bytes, as many on every rank (the
                # longest block's): a rank's sent and received blocks differ in size.
                for a in range(0, scratch.size, step):
                    s, m = send[a:a + step], mine[a:a + step]
                    got = scratch[:m.size]
                    t.comm.Sendrecv(s, dest=right, sendtag=k, recvbuf=got, source=left,
                                    recvtag=k)
                    np.add(m, got, out=m)
