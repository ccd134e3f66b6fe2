"""What every reduction strategy does: sum a flat buffer over the ranks."""

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Blocks:
    """Per rank, the elements of its block of a buffer and where it starts (rank order)."""

    counts: tuple
    displs: tuple


def even_blocks(size, ranks):
    """``size`` elements cut into ``ranks`` near-equal blocks, in rank order."""
    cuts = [size * r // ranks for r in range(ranks + 1)]
    return Blocks(tuple(b - a for a, b in zip(cuts, cuts[1:])), tuple(cuts[:-1]))


def pieces(size, step):
    """``(start, stop)`` ranges of at most ``step`` elements covering ``size``."""
    step = max(1, step)
    return [(a, min(a + step, size)) for a in range(0, size, step)] or [(0, 0)]


class Reducer(ABC):
    """Sums flat, contiguous buffers over the ranks of a transport.

    Every method is collective: all ranks call it with buffers of the same
    size and dtype. ``src=None`` means in place (``dst`` holds the input);
    otherwise ``src`` is read and never written, and must not overlap ``dst``.
    ``what`` is ``(operation, keys)``, for the watchdog's message.

    Args:
        transport: a :class:`mpikv.transport.base.Transport`.
        piece_bytes: the largest message one collective moves; longer buffers
            go in pieces (Open MPI summed 97.5 MiB about 2 times faster in
            4 MiB pieces than whole).
    """

    #: the name the tuner, the options and ``mpikv info`` use.
    name = None
    #: whether it reads buffers on the host only (GPU buffers are then always staged).
    host_only = False
    #: whether :meth:`allreduce` of a buffer equals :meth:`allreduce` of its pieces
    #: one after the other, the same MPI calls on every rank: a staged device
    #: buffer may then go in pieces whose copies overlap MPI
    #: (:mod:`mpikv.transport.pipeline`). Never for :meth:`reduce_to_owners`,
    #: whose blocks are the whole buffer's.
    elementwise = False

    def __init__(self, transport, piece_bytes):
        self.transport = transport
        self.piece_bytes = piece_bytes

    @classmethod
    def usable(cls, transport):
        """Whether the strategy can run on ``transport`` (the same answer on every rank)."""
        return True

    def pieces_of(self, buf):
        """The ``(start, stop)`` element ranges of ``buf`` that one collective moves each."""
        return pieces(buf.size, self.piece_bytes // buf.itemsize)

    @abstractmethod
    def allreduce(self, dst, src, what):
        """Every rank's ``dst`` becomes the sum over ranks of ``src`` (or of ``dst``)."""

    def reduce_to_owners(self, dst, src, blocks, what):
        """Rank r's block of ``dst`` (see :class:`Blocks`) becomes the sum of that block.

        Other blocks of ``dst`` are left undefined. The default sums everything
        everywhere, which serves the owners too.
        """
        self.allreduce(dst, src, what)

    def __repr__(self):
        return f"<reducer {self.name}>"
