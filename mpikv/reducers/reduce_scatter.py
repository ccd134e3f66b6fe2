"""``Reduce_scatter`` to the blocks' ranks, then ``Allgatherv`` of the blocks."""

from .base import Reducer, even_blocks
from .reduce_bcast import reduce_blocks


class ReduceScatterReducer(Reducer):
    """One ``Reduce_scatter`` and one ``Allgatherv`` over near-equal blocks (or,
    for the owners, one ``Reduce_scatter`` over their blocks)."""

    name = "reduce_scatter"

    def allreduce(self, dst, src, what):
        t = self.transport
        blocks = even_blocks(dst.size, t.size)
        self.reduce_to_owners(dst, src, blocks, what)
        t.allgatherv_(dst, blocks.counts, blocks.displs, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        t = self.transport
        if not _rank_ordered(blocks):
            # A split key's shards need not lie in rank order; Reduce_scatter's must.
            return reduce_blocks(self, dst, src, blocks, what)
        if src is None:
            t.reduce_scatter_(dst, blocks.counts, blocks.displs, what)
        else:
            t.reduce_scatter(src, dst, blocks.counts, blocks.displs, what)


def _rank_ordered(blocks):
    offset = 0
    for count, displ in zip(blocks.counts, blocks.displs):
        if count and displ != offset:
            return False
        offset += count
    return True
