"""``Reduce`` of each rank's block to it, then ``Bcast`` of each block from it."""

from .base import Reducer, even_blocks
from .reduce_bcast import reduce_blocks


class ReduceBcastBlocksReducer(Reducer):
    """Per-owner blocks: rank r sums block r (near-equal blocks when every rank
    wants the whole sum; the owners' blocks when only the owners do)."""

    name = "reduce_bcast_blocks"

    def allreduce(self, dst, src, what):
        t = self.transport
        blocks = even_blocks(dst.size, t.size)
        reduce_blocks(self, dst, src, blocks, what)
        for rank, (count, displ) in enumerate(zip(blocks.counts, blocks.displs)):
            block = dst[displ:displ + count]
            for a, b in self.pieces_of(block) if count else ():
                t.bcast_(block[a:b], rank, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        reduce_blocks(self, dst, src, blocks, what)
