"""The MPI side of a torch.distributed process group (:mod:`mpikv.torch.process_group`).

A :class:`GroupComm` is a duplicate of the group's ranks' communicator, moving
numpy arrays (the torch side hands it views of host tensors). Reduce ops are
named (``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"band"``, ``"bor"``,
``"bxor"``) so that the torch side needs no mpi4py.
"""

import numpy as np
from mpi4py import MPI

from . import ulfm

_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
        "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
#: tag of all_to_all's pairwise messages (point to point uses its own: P2P + tag)
A2A, P2P = 32101, 1 << 16


class GroupComm:
    """A communicator of its own over ``ranks`` of ``MPI.COMM_WORLD`` (all: None).

    Collective over those ranks (``MPI_Comm_create_group``).
    """

    def __init__(self, ranks=None):
        # under --ft, heartbeats from the first group on (a script whose only MPI is
        # torch's "mpikv" backend), as from a store's creation
        ulfm.heartbeat_for_launch()
        world = MPI.COMM_WORLD
        if not ranks or list(ranks) == list(range(world.Get_size())):
            self.comm = world.Dup()
        else:
            self.comm = world.Create_group(world.Get_group().Incl(list(ranks)))
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def agree(self, digest, problem):
        """Whether every rank's ``digest`` (a 56-bit int) is the same, and every rank's
        ``problem`` (a str or None).

        Returns:
            ``(same, problems)``: ``problems`` is every rank's list when any rank
            has one, else None.
        """
        mine = np.array([digest, -digest, problem is not None], np.int64)
        both = np.empty(3, np.int64)
        self.comm.Allreduce(mine, both, op=MPI.MAX)
        problems = self.comm.allgather(problem) if both[2] else None
        return bool(both[0] == -both[1] == digest), problems

    def allgather_object(self, value):
        return self.comm.allgather(value)

    def allreduce_(self, buf, op):
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=_OPS[op])

    def reduce_(self, buf, op, root):
        if self.rank == root:
            self.comm.Reduce(MPI.IN_PLACE, buf, op=_OPS[op], root=root)
        else:
            self.comm.Reduce(buf, None, op=_OPS[op], root=root)

    def bcast_(self, buf, root):
        self.comm.Bcast(buf, root=root)

    def allgather(self, src, dst):
        self.comm.Allgather(src, dst)

    def reduce_scatter_block(self, src, dst, op):
        self.comm.Reduce_scatter_block(src, dst, op=_OPS[op])

    def gather(self, src, dst, root):
        self.comm.Gather(src, dst, root=root)

    def scatter(self, src, dst, root):
        self.comm.Scatter(src, dst, root=root)

    def alltoallv(self, src, send_counts, dst, recv_counts):
        self.comm.Alltoallv([src, list(send_counts)], [dst, list(recv_counts)])

    def exchange(self, sends, recvs):
        """``sends[r]`` to rank ``r`` and ``recvs[r]`` from it, for every other rank."""
        requests = []
        for r, (src, dst) in enumerate(zip(sends, recvs)):
            if r != self.rank:
                requests.append(self.comm.Isend(src, dest=r, tag=A2A))
                requests.append(self.comm.Irecv(dst, source=r, tag=A2A))
        MPI.Request.Waitall(requests)

    def send(self, buf, dest, tag):
        self.comm.Send(buf, dest=dest, tag=P2P + tag)

    def recv(self, buf, source, tag):
        self.comm.Recv(buf, source=source, tag=P2P + tag)

    def barrier(self):
        self.comm.Barrier()

    def free(self):
        self.comm.Free()


__all__ = ["GroupComm"]
