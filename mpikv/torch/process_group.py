"""``torch.distributed`` over MPI, from pip: the ``"mpikv"`` process-group backend.

``import mpikv.torch`` registers it; ``mpikv.torch.init_process_group("mpikv")``
(no torchrun, no master address: the ranks are MPI's) makes the default group,
and ``dist.new_group(ranks)`` more, each over an MPI communicator of its own
(its ranks' group of ``MPI.COMM_WORLD``). torch's own ``"mpi"`` backend exists
only in source builds of torch.

An ``async_op=True`` collective runs on one thread of the group's and returns
a work whose future completes there, overlapped with the caller, as gloo's; a
blocking one with nothing queued runs on the caller's thread. One thread at a
time calls MPI on the group's communicator, in the order the script made the
calls. Before its data moves, each collective's description (operation,
dtype, shape, root, reduce op) is agreed in one ``Allreduce``: ranks that call
different collectives get the same :class:`~mpikv.errors.MismatchError` on
every rank, naming each rank's call, where MPI would hang or move garbage.

A rank that never comes to a collective (uneven data, a rank stuck) ends the
job after ``MPIKV_TIMEOUT`` seconds (600 by default), naming the collective, as
the store's calls do.

``all_reduce``'s and ``reduce_scatter``'s sums (and averages) of float32, float64,
int32 and int64 go through the store's strategies and its tuning table
(:mod:`mpikv.store.group_sums`: the ring on a slow link, shared memory on a node,
as a store's buckets); the other reduce ops and collectives are MPI's; 16-bit
floats are summed in float32 and rounded once (MPI has no 16-bit float type).
CUDA tensors go to a CUDA-aware MPI as they are, else through host memory, as a
store's device buffers (:mod:`mpikv.torch.pg_buffers`). torch's functional
collectives (DTensor's) reach the group through its ``*_coalesced`` methods.
Point to point (``send``, ``recv``) is not agreed (nothing to agree between two
ranks before a match).
"""

import concurrent.futures
import hashlib
import threading

import torch
import torch.distributed as dist

from .. import errors, flight
from ..store import config
from ..transport.watchdog import Watchdog
from .pg_buffers import Buffers
from .pg_work import (Work, agreed, check_list, check_lists, check_pairs, kind, reduce_op_of,
                      root_of, say, shape, splits)

NAME = "mpikv"

_SIXTEEN = (torch.float16, torch.bfloat16)


class ProcessGroupMPIKV(dist.ProcessGroup):
    """A process group over an MPI communicator (see the module's docstring).

    Args:
        wire: the group's :class:`~mpikv.transport.group.GroupComm` (its ranks, in
            group order).
        timeout: the group's timeout (a ``datetime.timedelta``), kept for torch.
        sums: the store's strategies for all_reduce's sums (a
            :class:`~mpikv.store.group_sums.GroupSums`), or None: MPI's.
        buffers: how tensors reach MPI (default: a :class:`~mpikv.torch.pg_buffers.Buffers`
            of the group's own).
    """

    def __init__(self, wire, timeout=None, sums=None, buffers=None):
        super().__init__(wire.rank, wire.size)
        self.wire = wire
        self.sums = sums
        self.buffers = Buffers() if buffers is None else buffers
        self.timeout = timeout
        # A rank that never comes ends the job after the store's timeout (MPIKV_TIMEOUT,
        # 600 s), naming the collective, as a store's call does; never a silent wait.
        self._watchdog = Watchdog(config.resolve().timeout, wire.rank)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpikv-pg")
        self._lock = threading.Lock()
        self._closed = False
        self._calls = 0
        #: per thread: whether the call being made is blocking (:func:`~.pg_work.agreed`).
        #: A blocking call with nothing queued runs on the caller's thread (no handoff to
        #: the group's thread to wait for). One thread at a time calls MPI on the group's
        #: communicator (_mpi), in the order the calls were made.
        self.blocking = threading.local()
        self.blocking.value = False
        self._mpi = threading.Lock()
        self._queued = 0

    def getBackendName(self):  # noqa: N802 - torch's name
        return NAME

    # torch's C++ group keeps its name in its backends, and a Python group has none.
    _name, _desc = "", ""

    def _set_group_name(self, name):
        self._name = name

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_name(self):
        return self._name

    @property
    def group_desc(self):
        return self._desc

    @property
    def name(self):
        return NAME

    # -- running ------------------------------------------------------------------

    def _run(self, description, action, result=None, problem=None, moved=()):
        """``action()`` on the group's thread after the ranks agreed on ``description``
        (None: not agreed); returns its :class:`~.pg_work.Work`. ``problem``: why this
        rank refuses the call, raised (as every rank's) on every rank instead.
        ``moved``: the tensors the action reads or writes (their GPUs' queued work
        comes first)."""
        future = torch.futures.Future()

        op = description[0] if description else "point to point"
        what = (f"torch.distributed {op} on the mpikv process group", [])
        self._calls += 1
        # In the flight recorder beside the stores' calls: a job that ends shows it.
        entry = flight.RECORDER.begin(f"torch.distributed group {self._name!r}", self._calls,
                                      op, [], 0, 0)

        def run():
            try:
                with self._mpi, self._watchdog.watch(what):
                    if description is not None:
                        self._agree(description, problem)
                        flight.agreed(entry)
                    action()
                flight.ended(entry)
                future.set_result(result)
            except BaseException as exc:  # noqa: BLE001 - raised by wait() on the caller
                flight.failed(entry, type(exc).__name__)
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._queued -= 1

        self.buffers.ordered([t for t in moved if t is not None])
        with self._lock:
            if self._closed:
                raise errors.InputError("the mpikv process group is shut down")
            self._queued += 1
            inline = self._queued == 1 and getattr(self.blocking, "value", False)
            if not inline:
                self._pool.submit(run)
        if inline:
            run()
        return Work(future, result)

    def refuse(self, op, problem):
        """``op`` refused on this rank for ``problem``: every rank's call raises."""
        return self._run((op, "refused"), lambda: None, None, problem=problem)

    def _agree(self, description, problem=None):
        digest = int.from_bytes(hashlib.blake2b(repr(description).encode(), digest_size=7)
                                .digest(), "little")
        same, problems = self.wire.agree(digest, problem)
        if problems is not None:
            raise errors.InputError("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems)
                                              if p is not None))
        if same:
            return
        calls = self.wire.allgather_object(description)
        listed = "; ".join(f"rank {r}: {say(c)}" for r, c in enumerate(calls))
        raise errors.MismatchError(f"the ranks of the mpikv process group made different "
                                   f"collective calls ({listed})")

    # -- collectives (each @agreed: a bad argument on one rank is refused on all) ----

    @agreed
    def allreduce(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        (tensor,) = tensors
        mpi_op = reduce_op_of(op, tensor.dtype)
        return self._run(("allreduce", shape(tensor), str(kind(op))),
                         lambda: self._allreduce_into(tensor, mpi_op,
                                                      kind(op) == dist.ReduceOp.AVG),
                         tensors, moved=tensors)

    def _allreduce_into(self, tensor, mpi_op, average):
        work = (tensor.float() if tensor.dtype in _SIXTEEN else tensor).contiguous()
        buf = self.buffers.view(work) if mpi_op == "sum" and self.sums is not None else None
        if buf is not None and self.sums.takes(buf):
            # (the store's transport moves a GPU buffer direct or staged itself)
            self.sums.allreduce_(buf, ("torch.distributed all_reduce", []))
        else:
            self.buffers.run(lambda b, _: self.wire.allreduce_(b, mpi_op), work)
        self._finish(tensor, work, average)

    def _finish(self, tensor, work, average):
        if average:
            work.div_(self.size())
        if work is not tensor:
            tensor.copy_(work)
        self.buffers.settle([tensor])

    def allreduce_coalesced(self, tensors, opts=None):
        works = [self.allreduce([t], opts) for t in tensors]
        return works[-1] if works else self.barrier()

    @agreed
    def broadcast(self, tensors, opts=None):
        (tensor,) = tensors
        root = root_of("broadcast", opts, self.size())
        return self._run(("broadcast", shape(tensor), root),
                         lambda: self.buffers.run(lambda b, _: self.wire.bcast_(b, root), tensor),
                         tensors, moved=tensors)

    @agreed
    def reduce(self, tensors, opts=None):
        (tensor,) = tensors
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        root = root_of("reduce", opts, self.size())
        mpi_op = reduce_op_of(op, tensor.dtype)

        def run():
            work = (tensor.float() if tensor.dtype in _SIXTEEN else tensor).contiguous()
            self.buffers.run(lambda b, _: self.wire.reduce_(b, mpi_op, root), work)
            if self.wire.rank == root:
                self._finish(tensor, work, kind(op) == dist.ReduceOp.AVG)
        return self._run(("reduce", shape(tensor), str(kind(op)), root), run, tensors,
                         moved=tensors)

    @agreed
    def allgather(self, output_tensors, input_tensors, opts=None):
        (outs,), (tensor,) = output_tensors, input_tensors
        check_list("allgather", outs, tensor, self.size())

        def run():
            gathered = tensor.new_empty((self.size(),) + tuple(tensor.shape))
            self._allgather_into(gathered, tensor)
            for out, part in zip(outs, gathered):
                out.copy_(part)
            self.buffers.settle(outs)
        return self._run(("allgather", shape(tensor)), run, output_tensors,
                         moved=[tensor, *outs])

    @agreed
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` takes rank r's
        ``input_list[i]``."""
        p = self.size()
        check_lists(output_lists, input_list, p)

        def run():
            for i, tensor in enumerate(input_list):
                gathered = tensor.new_empty((p,) + tuple(tensor.shape))
                self._allgather_into(gathered, tensor)
                for outs, part in zip(output_lists, gathered):
                    outs[i].copy_(part)
            self.buffers.settle([o for outs in output_lists for o in outs])
        return self._run(("allgather_coalesced", tuple(shape(t) for t in input_list)), run,
                         output_lists, moved=[*input_list, *(o for outs in output_lists
                                                             for o in outs)])

    @agreed
    def _allgather_base(self, output, tensor, opts=None):
        check_pairs("all_gather_into_tensor", [output], [tensor], self.size())
        return self._run(("allgather_into_tensor", shape(tensor)),
                         lambda: self._allgather_into(output, tensor), [output],
                         moved=[output, tensor])

    def _allgather_into(self, output, tensor):
        self.buffers.run(lambda d, s: self.wire.allgather(s, d), output, tensor, copy_in=False)

    allgather_into_tensor = all_gather_single = _allgather_base

    @agreed
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        (out,), (ins,) = output_tensors, input_tensors
        check_list("reduce_scatter", ins, out, self.size())
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._reduce_scatter(out, ins, op, output_tensors)

    @agreed
    def _reduce_scatter_base(self, output, tensor, opts=None):
        check_pairs("reduce_scatter_tensor", [output], [tensor], self.size())
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._reduce_scatter(output, tensor, op, [output])

    reduce_scatter_tensor = reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter(self, output, inputs, op, result):
        """``inputs``: one tensor of ranks x ``output``, or a list of one per rank."""
        mpi_op = reduce_op_of(op, output.dtype)
        parts = inputs if isinstance(inputs, (list, tuple)) else [inputs]

        def run():
            stacked = torch.stack(list(parts)) if len(parts) > 1 else parts[0]
            self._reduce_scatter_into(output, stacked, mpi_op, kind(op) == dist.ReduceOp.AVG)
        return self._run(("reduce_scatter", shape(output), str(kind(op))), run, result,
                         moved=[output, *parts])

    def _reduce_scatter_into(self, output, stacked, mpi_op, average):
        src = (stacked.float() if stacked.dtype in _SIXTEEN else stacked).contiguous()
        view = self.buffers.view(src) if mpi_op == "sum" and self.sums is not None else None
        if view is not None and self.sums.takes(view):
            # to the owners as a store's bucket: the ring across a link, where Open MPI's
            # Reduce_scatter_block took 2.6 x as long (docs/torch.md)
            whole = torch.empty_like(src).reshape(-1)
            self.sums.reduce_scatter(self.buffers.view(whole), view,
                                     ("torch.distributed reduce_scatter", []))
            mine = whole.view(self.size(), -1)[self.wire.rank]
        else:
            mine = src.new_empty(output.numel())
            self.buffers.run(lambda d, s: self.wire.reduce_scatter_block(s, d, mpi_op),
                             mine, src, copy_in=False)
        self._finish(output, mine.view(output.shape), average)

    # torch's functional collectives (DTensor's full_tensor() and redistribute, a
    # resharding checkpoint load) call these two, with one pair or several.
    @agreed
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        check_pairs("all_gather_into_tensor", outputs, inputs, self.size())

        def run():
            for output, tensor in zip(outputs, inputs):
                self._allgather_into(output, tensor)
        return self._run(("allgather_into_tensor_coalesced",
                          tuple(shape(t) for t in inputs)), run, outputs,
                         moved=[*outputs, *inputs])

    @agreed
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        check_pairs("reduce_scatter_tensor", outputs, inputs, self.size())
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        mpi_ops = [reduce_op_of(op, t.dtype) for t in outputs]
        average = kind(op) == dist.ReduceOp.AVG

        def run():
            for output, tensor, mpi_op in zip(outputs, inputs, mpi_ops):
                self._reduce_scatter_into(output, tensor, mpi_op, average)
        return self._run(("reduce_scatter_tensor_coalesced", tuple(shape(t) for t in outputs),
                          str(kind(op))), run, outputs, moved=[*outputs, *inputs])

    @agreed
    def gather(self, output_tensors, input_tensors, opts=None):
        (tensor,) = input_tensors
        root = root_of("gather", opts, self.size())
        mine = self.wire.rank == root
        outs = output_tensors[0] if mine else []
        if mine:
            check_list("gather", outs, tensor, self.size())

        def run():
            gathered = tensor.new_empty((self.size(),) + tuple(tensor.shape)) if mine else None
            if mine:
                self.buffers.run(lambda d, s: self.wire.gather(s, d, root), gathered, tensor,
                                 copy_in=False)
                for out, part in zip(outs, gathered):
                    out.copy_(part)
                self.buffers.settle(outs)
            else:
                self.buffers.run(lambda s, _: self.wire.gather(s, None, root), tensor)
        return self._run(("gather", shape(tensor), root), run, output_tensors,
                         moved=[tensor, *outs])

    @agreed
    def scatter(self, output_tensors, input_tensors, opts=None):
        (out,) = output_tensors
        root = root_of("scatter", opts, self.size())
        mine = self.wire.rank == root
        ins = input_tensors[0] if mine else []
        if mine:
            check_list("scatter", ins, out, self.size())

        def run():
            if mine:
                self.buffers.run(lambda d, s: self.wire.scatter(s, d, root), out,
                                 torch.stack(list(ins)), copy_in=False)
            else:
                self.buffers.run(lambda d, _: self.wire.scatter(None, d, root), out,
                                 copy_in=False)
        return self._run(("scatter", shape(out), root), run, output_tensors,
                         moved=[out, *ins])

    @agreed
    def all_to_all_single(self, output, tensor, output_split_sizes, input_split_sizes,
                          opts=None):
        p = self.size()
        rows_in = splits(input_split_sizes, tensor, p, "input")
        rows_out = splits(output_split_sizes, output, p, "output")
        row = tensor[0].numel() if tensor.dim() and tensor.shape[0] else 0
        row = row or (output[0].numel() if output.dim() and output.shape[0] else 1)
        send = [int(r) * row for r in rows_in]
        recv = [int(r) * row for r in rows_out]

        def run():
            self.buffers.run(lambda d, s: self.wire.alltoallv(s.reshape(-1), send,
                                                              d.reshape(-1), recv),
                             output, tensor, copy_in=False)
        # The splits differ between ranks by design: only their dtype and row shape agree.
        return self._run(("all_to_all_single", str(tensor.dtype), tuple(tensor.shape[1:])),
                         run, [output], moved=[output, tensor])

    alltoall_base = all_to_all_single

    @agreed
    def alltoall(self, output_tensors, input_tensors, opts=None):
        def run():
            me = self.wire.rank
            # (through host memory: one MPI call per pair of ranks, nonblocking)
            hosts = [self.buffers.host_buffer(out) for out in output_tensors]
            self.wire.exchange([self.buffers.host_array(t) for t in input_tensors],
                               [array for _, array in hosts])
            for r, (out, (host, _)) in enumerate(zip(output_tensors, hosts)):
                if r == me:
                    out.copy_(input_tensors[r])
                else:
                    self.buffers.written(host, out)
            self.buffers.settle(output_tensors)
        dtypes = {str(t.dtype) for t in input_tensors}
        return self._run(("all_to_all", tuple(sorted(dtypes))), run, output_tensors,
                         moved=[*output_tensors, *input_tensors])

    @agreed
    def barrier(self, opts=None):
        return self._run(("barrier",), self.wire.barrier, [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()

    # -- point to point (staged through host memory) --------------------------------

    def send(self, tensors, dst, tag):
        (tensor,) = tensors
        array = self.buffers.host_array(tensor)   # (the values at the call)
        return self._run(None, lambda: self.wire.send(array, dst, tag), tensors)

    def recv(self, tensors, src, tag):
        (tensor,) = tensors

        def run():
            host, array = self.buffers.host_buffer(tensor)
            self.wire.recv(array, src, tag)
            self.buffers.written(host, tensor)
        return self._run(None, run, tensors, moved=tensors)

    # -- the end ---------------------------------------------------------------------

    def shutdown(self):
        """Waits for the collectives in flight, then frees the communicator."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._watchdog.stop()
        if self.sums is not None:
            self.sums.close()
        self.wire.free()

    abort = shutdown



def create(opts, backend_options=None):
    """torch's creator of the backend (extended API): the group's ranks' communicator."""
    del backend_options
    from ..store.group_sums import GroupSums
    from ..transport.group import GroupComm
    wire = GroupComm(list(opts.global_ranks_in_group))
    try:
        sums = GroupSums(wire)
    except BaseException:
        wire.free()
        raise
    return ProcessGroupMPIKV(wire, opts.timeout, sums)


def backend_of(group=None):
    """The :class:`ProcessGroupMPIKV` behind a torch group (default: the default group).

    Raises:
        InputError: the group is not on the ``"mpikv"`` backend.
    """
    found = dist.group.WORLD if group is None else group
    # torch hands back a Python backend's own object as the group
    if not isinstance(found, ProcessGroupMPIKV):
        raise errors.InputError(f"this group is {type(found).__name__}, not mpikv's backend")
    return found


_registered = []


def register():
    """Registers the ``"mpikv"`` backend with torch (once; ``import mpikv.torch`` does)."""
    if not _registered:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])
        _registered.append(NAME)


__all__ = ["NAME", "ProcessGroupMPIKV", "Work", "backend_of", "create", "register"]
