"""The MPI transport: mpi4py collectives on an intra-communicator.

All of mpikv's MPI calls live here. The store's traffic runs on a duplicate
of the user's communicator, so it never matches the user's own messages.
"""

import json
import os
import time
from types import SimpleNamespace

import numpy as np

from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from . import cuda, ulfm
from .pipeline import wants_pieces
from .staging import Staging
from .base import AGREED, DIFFER, JOINED, Transport
from .watchdog import (TIMEOUT_EXIT_CODE, Watchdog, abort, format_what, install_exception_hook,
                       start_listener)

_AGREE_TAG = 7
#: tag of :meth:`MPITransport.pass_along` (on the data communicator)
_PASS_TAG = 8
# The agreement's words: digest (2), its complement (2), then these.
_ERROR, _JOINED, _ACTIVE, _TICKET = 4, 5, 6, 7
_WORDS = 8

# The coordinator (rank 0) gives up first and names the missing ranks; the
# others wait a little longer so that its message is the one printed.
_GRACE = 0.25


class MPITransport(Transport):
    """Collectives over ``comm`` (default ``MPI.COMM_WORLD``).

    Args:
        comm: an mpi4py intra-communicator.
        options: resolved :class:`mpikv.store.config.Options`.
        node_of: ``rank -> node number`` to group the ranks into nodes by, in
            place of the machine's shared-memory domains (tests let the ranks
            of one machine act as several nodes); None: the real nodes.
    """

    def __init__(self, comm, options, node_of=None):
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intra-communicator, not {type(comm).__name__}")
        # Creation is watched too: a rank that never comes (it failed before its
        # store, say) ends the job at the timeout instead of hanging the others.
        self._watchdog = Watchdog(options.timeout, comm.Get_rank())
        try:
            self._make(comm, options, node_of)
        except BaseException:
            self._watchdog.stop()
            raise

    def _make(self, comm, options, node_of):
        try:
            self._make_comms(comm, options, node_of)
        except MPI.Exception as exc:
            # A rank of ``comm`` lost while the store was being made (the survivors'
            # communicator of an earlier loss, say): the same RankLostError on every
            # survivor, whose .comm makes the next try.
            if not (getattr(options, "fault_tolerant", False) and ulfm.is_failure(exc)):
                raise
            ulfm.lost_while_making(comm, exc, options.timeout,
                                   [c for c in (getattr(self, "comm", None),
                                                getattr(self, "agree_comm", None)) if c])

    def _make_comms(self, comm, options, node_of):
        # Each collective of the creation under the watchdog (re-armed per step).
        step = self._watchdog.watch(("create", []))
        with step:
            self.comm = comm.Dup()
        # Agreement runs in the caller's thread while the store's worker thread
        # may be inside a data collective: separate communicators keep them apart.
        with step:
            self.agree_comm = comm.Dup()
        # Under --ft every rank needs heartbeats, fault-tolerant store or not.
        ulfm.heartbeat_for_launch()
        # ULFM: the same answer (or error) on every rank, before any other collective.
        try:
            with step:
                self.fault_tolerant = ulfm.agree_on_support(
                    self.agree_comm, getattr(options, "fault_tolerant", False))
        except Exception:
            self.comm.Free()
            self.agree_comm.Free()
            raise
        self._recovery = None
        if self.fault_tolerant:
            ulfm.set_errors_return(self.comm, self.agree_comm)
            self._recovery = ulfm.Recovery(self._ft_comms, self.agree_comm, self.world_rank,
                                           options.timeout, format_what,
                                           lambda: self._seq)
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        # Whether MPI takes GPU buffers: probed once per process, the same on every
        # rank (one small Allreduce; staged where any rank stages), per kind of call.
        with step:
            self.cuda = cuda.agree(cuda.detect, self._min_over_ranks)
        #: How device buffers of reductions reach MPI (the store's reducers stage
        #: through it too); :attr:`pull_staging` for pulls and broadcasts.
        self.staging = Staging(detect=lambda: self.cuda.for_op(cuda.REDUCE))
        self.pull_staging = Staging(detect=lambda: self.cuda.for_op(cuda.PULL),
                                    stager=self.staging.stager)
        # Staged elementwise calls go in pieces of this size: an agreed option
        # (factory.AGREED_OPTIONS), so every rank makes the same MPI calls.
        self.staging.piece_bytes = self.pull_staging.piece_bytes = options.staging_piece
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self._world_ranks = group.Translate_ranks(list(range(self.size)), world)
        group.Free()
        world.Free()
        self.timeout = options.timeout
        self.piece_bytes = options.bucket_bytes
        self.library = MPI.Get_library_version().replace("\x00", "").strip()
        if self._recovery is not None:
            self._watchdog.on_failure = self._recovery.check
        self._vecs = {}    # (digest, error) -> the agreement's input words
        self._out = np.zeros(_WORDS, np.uint64)
        self._seq = 0      # agreements so far: the same count on every rank
        self._sent = []    # arrival announcements still in flight
        self._arrived = (0, set())   # (agreement number, ranks that announced it)
        # The coordinator (rank 0) gives up first and names the missing ranks;
        # the others wait a little longer so that its message is the one printed.
        self._late = SimpleNamespace(
            early=min(1.0, self.timeout / 4), announce=self._announce, expire=self._expire,
            limit=self.timeout if self.rank == 0 else self.timeout * (1 + _GRACE) + 1.0)
        install_exception_hook(options.abort_on_exception)
        self._nodes = None
        with step:
            if node_of is not None:
                from .shm import NodeGroup
                self._nodes = NodeGroup(self.comm, node=self.comm.Split(node_of(self.rank),
                                                                        self.rank))
            elif self.size > 1:
                # Made now, on every rank: a first use decided by one rank's own state
                # (which route a call takes) must never be the collective that makes it.
                self.nodes  # noqa: B018
        if self._nodes is not None and self.fault_tolerant:
            ulfm.set_errors_return(self._nodes.node, self._nodes.across)
            # No shared windows (the shared and window reducers, zero-copy buffers in
            # them): Open MPI warns that its 'osc' module 'sm' "is not tested for
            # post-failure operation" and may abort, crash or deadlock the survivors.
            self._nodes.usable = False
        # The flight-recorder exchange's communicator (collective: a Dup of comm for
        # the first store over these ranks) and the thread that answers requests.
        with step:
            start_listener(comm, self._world_ranks)

    def _ft_comms(self):
        """Every communicator of the store (a lost rank revokes them all)."""
        comms = [self.comm, self.agree_comm]
        if self._nodes is not None:
            comms += [self._nodes.node, self._nodes.across]
        return comms

    @property
    def lost(self):
        """A fault-tolerant store's agreed loss (the arguments of its
        :class:`mpikv.RankLostError`, a dict), or None (no rank lost, or not fault
        tolerant)."""
        return None if self._recovery is None else self._recovery.lost

    def _min_over_ranks(self, vec):
        out = np.empty_like(vec)
        self.agree_comm.Allreduce(vec, out, op=MPI.MIN)
        return out

    # -- node-local shared memory --------------------------------------------
    @property
    def nodes(self):
        """The :class:`~mpikv.transport.shm.NodeGroup` (made at first use: collective)."""
        if self._nodes is None:
            from .shm import NodeGroup
            self._nodes = NodeGroup(self.comm)
        return self._nodes

    def shared_arena(self, size, dtype):
        """A bucket of ``size`` elements in a node-local shared window, or None
        where the shared path cannot be used (the same answer on every rank)."""
        if self.size == 1 or not self.nodes.usable:
            return None
        from .shm import SharedArena
        return SharedArena(self.nodes, size, dtype)

    # -- agreement -------------------------------------------------------
    @property
    def agreements(self):
        """Agreements so far: the same count on every rank."""
        return self._seq

    def agree(self, digest, has_error, what):
        """One small ``Allreduce`` (MAX) tells every rank at once whether all agree.

        Each rank contributes its digest, the digest's complement and its error
        flag; equal maxima of a word and of its complement mean every rank had
        the same word. A joined rank contributes zeros there (neutral under
        MAX) and raises the "joined" word. A call that waits long (a rank is
        late) tells every other rank that it has arrived, so that on a timeout
        each rank can name the ranks that never did.
        """
        vec = self._vecs.get((digest, has_error))
        if vec is None:
            vec = np.zeros(_WORDS, np.uint64)
            vec[:2] = np.frombuffer(digest, np.uint64)
            np.invert(vec[:2], out=vec[2:4])
            vec[_ERROR] = 1 if has_error else 0
            vec[_ACTIVE] = 1
            if len(self._vecs) > 4096:
                self._vecs.clear()
            self._vecs[(digest, has_error)] = vec
        out = self._allreduce_max(vec, what)
        if out[_JOINED]:
            return JOINED
        if out[_ERROR]:
            return DIFFER
        return AGREED if out[0] == ~out[2] and out[1] == ~out[3] else DIFFER

    def wait_joined(self, ticket, what):
        vec = np.zeros(_WORDS, np.uint64)
        vec[_JOINED] = 1
        vec[_TICKET] = ticket
        out = self._allreduce_max(vec, what)
        return bool(out[_ACTIVE]), int(out[_TICKET])

    def _allreduce_max(self, vec, what):
        try:
            return self._allreduce_max_once(vec, what)
        except MPI.Exception as exc:
            if self._recovery is not None:
                self._recovery.check(exc, what)   # a lost rank: RankLostError
            raise

    def _allreduce_max_once(self, vec, what):
        out = self._out
        self._seq += 1
        if not self._seq & 255:
            self._drain_announcements()
        # The end of a process waits for the others as MPI_Finalize would: another
        # rank may work on for long (rank 0's final evaluation) before it ends too.
        # (Blocking or not as the other ranks' agreements: a nonblocking collective
        # does not match a blocking one.)
        unlimited = what[0] == "exit"
        if self.threaded:
            # Blocking is 2 us faster than polling; the watchdog thread announces
            # this rank and names the missing ones if the others are late.
            dog = self._watchdog
            if not unlimited:
                dog.start()
                dog.agreement = [time.monotonic(), what, self._late]
            try:
                self.agree_comm.Allreduce(vec, out, op=MPI.MAX)
            finally:
                dog.agreement = None
        else:
            request = self.agree_comm.Iallreduce(vec, out, op=MPI.MAX)
            if not request.Test():
                self._wait(request, what, unlimited)
        return out

    def _wait(self, request, what, unlimited=False):
        """Polls a late agreement; announces arrival, then names the missing on
        timeout (never, if ``unlimited``)."""
        start = time.monotonic()
        early = self._late.early
        limit = float("inf") if unlimited else self._late.limit
        announced = False
        while not request.Test():
            waited = time.monotonic() - start
            # Yield rather than sleep at first: time.sleep() rounds up to ~60 us,
            # which would dominate a fast call; yielding still lets oversubscribed
            # ranks have the core. Past 10 ms, the call is not fast anyway.
            if waited < 0.01:
                os.sched_yield()
                continue
            time.sleep(0.0005)
            if not announced and waited > early:
                self._announce()
                announced = True
            if waited > limit:
                self._late.expire(what)

    def _expire(self, what):
        ranks = self._missing()
        who = f"; rank(s) {', '.join(map(str, ranks))} did not arrive" if ranks else ""
        # A rank that went on to other work (a torch.distributed call, say) is as
        # one that ended its process: the caller's words say what to do.
        hint = f" If a rank went on to other work: {self.late_hint}." if self.late_hint else ""
        abort(f"mpikv: rank {self.rank}: {format_what(what)} did not start within "
              f"{self.timeout:g} s{who}; ending the job.{hint} create(timeout=) or "
              f"MPIKV_TIMEOUT sets the limit.", TIMEOUT_EXIT_CODE)

    def _drain_announcements(self):
        """Receives and drops announcements of agreements that completed after all
        (they would pile up in MPI's queue of unexpected messages)."""
        try:
            self._drain_announcements_once()
        except MPI.Exception as exc:
            if not (self.fault_tolerant and ulfm.is_failure(exc)):
                raise   # a lost rank: the call's own collective reports it

    def _drain_announcements_once(self):
        status, buf = MPI.Status(), np.zeros(1, np.int64)
        if self._arrived[0] != self._seq:
            self._arrived = (self._seq, set())
        while self.agree_comm.Iprobe(source=MPI.ANY_SOURCE, tag=_AGREE_TAG, status=status):
            self.agree_comm.Recv(buf, source=status.Get_source(), tag=_AGREE_TAG)
            if buf[0] == self._seq:  # this agreement's: kept for _missing
                self._arrived[1].add(status.Get_source())
        self._sent = [(req, b) for req, b in self._sent if not req.Test()]

    def _announce(self):
        """Tells every other rank that this one is waiting in agreement number ``_seq``."""
        self._drain_announcements()
        for rank in range(self.size):
            if rank != self.rank:
                buf = np.array([self._seq], np.int64)
                try:
                    self._sent.append((self.agree_comm.Isend(buf, dest=rank, tag=_AGREE_TAG),
                                       buf))
                except MPI.Exception as exc:
                    if not (self.fault_tolerant and ulfm.is_failure(exc)):
                        raise   # a lost rank: the agreement itself reports it

    def _missing(self):
        """The ranks that have not announced the current agreement (a short grace first)."""
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            self._drain_announcements()
            time.sleep(0.01)
        arrived = self._arrived[1] | {self.rank}
        return [r for r in range(self.size) if r not in arrived]

    def allgather_records(self, record, what):
        with self._watchdog.watch(what):
            texts = self.agree_comm.allgather(json.dumps(record))
        return [json.loads(t) for t in texts]

    def bcast_record(self, record, root, what):
        with self._watchdog.watch(what):
            text = self.agree_comm.bcast(json.dumps(record) if self.rank == root else None,
                                         root=root)
        return json.loads(text)

    def world_rank(self, rank):
        world = self._world_ranks[rank]
        return None if world == MPI.UNDEFINED else world

    @property
    def mpi_version(self):
        """The MPI standard the library implements, ``"major.minor"`` (for the tuning cache)."""
        return "%d.%d" % MPI.Get_version()

    def count_bytes(self):
        """Counts what the data collectives on :attr:`comm` bring to this rank
        (:class:`~mpikv.transport.counting.CountingComm`); node shared-memory
        traffic is not counted."""
        from .counting import counting_comm
        return counting_comm(self)

    # -- data ------------------------------------------------------------
    def _device(self, call, buf, what, copy_in=True, copy_back=True, staging=None,
                pieces=False):
        """Runs a blocking collective on a GPU buffer: straight to a CUDA-aware MPI,
        or staged through pinned host memory (and staged for good if MPI refuses).
        ``staging``: :attr:`pull_staging` for pulls and broadcasts, else reductions'.
        ``pieces``: the call is elementwise (``Allreduce``, ``Reduce``, ``Bcast``),
        so a large staged buffer may go in pieces whose copies overlap MPI."""
        with self._watchdog.watch(what):
            (staging or self.staging).run(lambda b, _: call(b), buf, copy_in=copy_in,
                                          copy_back=copy_back, pieces=pieces)

    # Allreduce, Reduce and Bcast go through the staging whatever the buffer: a large
    # one goes in the staging's pieces on every rank, host or GPU, so ranks whose
    # values live in different places still make the same MPI calls.
    def allreduce_(self, buf, what):
        return self._device(lambda b: self.comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM),
                            buf, what, pieces=True)

    def reduce(self, src, dst, root, what):
        if (type(src) is not np.ndarray or type(dst) is not np.ndarray
                or wants_pieces(src.nbytes, self.staging.piece_bytes)):
            return super().reduce(src, dst, root, what)
        with self._watchdog.watch(what):
            self.comm.Reduce(src, dst if self.rank == root else None, op=MPI.SUM, root=root)

    def reduce_scatter(self, src, dst, counts, displs, what):
        """Rank r's block ``dst[displs[r]:+counts[r]]`` becomes the sum of that block of ``src``."""
        r = self.rank
        if type(src) is not np.ndarray or type(dst) is not np.ndarray:
            from ..arrays.backends import copyto
            copyto(dst, src)
            return self.reduce_scatter_(dst, counts, displs, what)
        with self._watchdog.watch(what):
            self.comm.Reduce_scatter(src, dst[displs[r]:displs[r] + counts[r]],
                                     recvcounts=list(counts), op=MPI.SUM)

    def guard(self, what):
        return self._watchdog.watch(what)

    def reduce_(self, buf, root, what):
        mine = self.rank == root
        return self._device(
            lambda b: self.comm.Reduce(MPI.IN_PLACE if mine else b, b if mine else None,
                                       op=MPI.SUM, root=root), buf, what, copy_back=mine,
            pieces=True)

    def reduce_scatter_(self, buf, counts, displs, what):
        mine = buf[displs[self.rank]:displs[self.rank] + counts[self.rank]]
        # In place, MPI would leave the result at the start of buf, over other blocks'
        # input; a separate receive buffer keeps the block where it belongs.
        block = np.empty(mine.size, mine.dtype)
        if type(buf) is not np.ndarray:
            from ..arrays.backends import copyto
            self._device(lambda b: self.comm.Reduce_scatter(b, block, recvcounts=list(counts),
                                                            op=MPI.SUM), buf, what, copy_back=False)
            copyto(mine, block)
            return
        with self._watchdog.watch(what):
            self.comm.Reduce_scatter(buf, block, recvcounts=list(counts), op=MPI.SUM)
        mine[...] = block

    def bcast_(self, buf, root, what):
        return self._device(lambda b: self.comm.Bcast(b, root=root), buf, what,
                            copy_in=self.rank == root, copy_back=self.rank != root,
                            staging=self.pull_staging, pieces=True)

    def allgatherv_(self, buf, counts, displs, what):
        def gather(b):
            self.comm.Allgatherv(MPI.IN_PLACE, [b, (counts, displs), from_numpy_dtype(b.dtype)])
        if type(buf) is not np.ndarray:
            return self._device(gather, buf, what, staging=self.pull_staging)
        with self._watchdog.watch(what):
            gather(buf)

    def close(self):
        """Ends the watchdog and frees the two communicators. Node shared-memory
        windows stay until exit (:func:`mpikv.transport.shm.free_all`): buffers
        handed out from them may still be in use."""
        self._watchdog.stop()
        if self.lost is not None:
            return   # revoked: nothing to free collectively (the process ends with os._exit)
        self._drain_announcements()
        # MPI_Comm_free lets operations still pending (announcements) complete.
        self.comm.Free()
        self.agree_comm.Free()

    def barrier(self, what):
        with self._watchdog.watch(what):
            self.comm.Barrier()

    def alltoallv(self, send, scounts, sdispls, recv, rcounts, rdispls, what):
        kind = from_numpy_dtype(send.dtype)
        with self._watchdog.watch(what):
            self.comm.Alltoallv([send, (list(scounts), list(sdispls)), kind],
                                [recv, (list(rcounts), list(rdispls)), kind])

    def pass_along(self, header, data, what, out=None):
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        with self._watchdog.watch(what):
            theirs, nbytes = self.comm.sendrecv((header, data.nbytes), dest=nxt,
                                                sendtag=_PASS_TAG, source=prev,
                                                recvtag=_PASS_TAG)
            # (a buffer used before: a new one would fault in every page, every step)
            got = out if out is not None and out.nbytes == nbytes else np.empty(nbytes, np.uint8)
            self.comm.Sendrecv([data, MPI.BYTE], dest=nxt, sendtag=_PASS_TAG,
                               recvbuf=[got, MPI.BYTE], source=prev, recvtag=_PASS_TAG)
        return theirs, got

    def describe(self):
        facts = super().describe()
        facts["mpi_library"] = self.library
        facts["cuda"] = self.staging.describe()
        facts["cuda_paths"] = self.cuda.paths
        facts["timeout_s"] = self.timeout
        facts["fault_tolerant"] = self.fault_tolerant
        return facts
