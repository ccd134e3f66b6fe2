"""``Reduce`` + ``Bcast`` of the whole buffer, piece by piece, roots taking turns."""

from .base import Reducer


class ReduceBcastReducer(Reducer):
    """Each piece is reduced to one rank and broadcast from it; the root of piece i
    is rank ``i % size``, so the summing work is spread over the ranks."""

    name = "reduce_bcast"
    # Each piece of the buffer is summed by calls of its own already.
    elementwise = True

    def allreduce(self, dst, src, what):
        t = self.transport
        for i, (a, b) in enumerate(self.pieces_of(dst)):
            root = i % t.size
            if src is None:
                t.reduce_(dst[a:b], root, what)
            else:
                t.reduce(src[a:b], dst[a:b], root, what)
            t.bcast_(dst[a:b], root, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        reduce_blocks(self, dst, src, blocks, what)


def reduce_blocks(reducer, dst, src, blocks, what):
    """Sums each rank's block of the buffer into that rank, piece by piece."""
    t = reducer.transport
    for rank, (count, displ) in enumerate(zip(blocks.counts, blocks.displs)):
        if not count:
            continue
        block = dst[displ:displ + count]
        for a, b in reducer.pieces_of(block):
            if src is None:
                t.reduce_(block[a:b], rank, what)
            else:
                t.reduce(src[displ + a:displ + b], block[a:b], rank, what)
