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
dtype, element count, root, reduce op) is agreed: ranks that call different
collectives, or the same one on different shapes, get the same
:class:`~mpikv.errors.MismatchError` on every rank, naming each rank's call,
where MPI would hang or move garbage. The agreement is one ``Allreduce`` of two
integers, the fingerprint's minimum and maximum.

A rank that never comes to a collective (uneven data, a rank stuck) ends the
job after ``MPIKV_TIMEOUT`` seconds (600 by default), naming the collective, as
the store's calls do.

``all_reduce``'s sums (and averages) of float32, float64, int32 and int64 go
through the store's strategies and its tuning table
(:mod:`mpikv.store.group_sums`: the ring on a slow link, shared memory on a node,
as a store's buckets); the other reduce ops and collectives are MPI's
(``MPI_SUM`` and the other reduce ops); 16-bit floats are summed in float32 and
rounded once (as the store does: MPI has no 16-bit float type).
CUDA tensors are staged through host memory. Point to point (``send``,
``recv``) is not agreed (nothing to agree between two ranks before a match).
"""

import concurrent.futures
import functools
import hashlib
import threading

import numpy as np
import torch
import torch.distributed as dist

from . import tensors
from .. import errors, flight
from ..store import config
from ..transport.watchdog import Watchdog

NAME = "mpikv"

_SIXTEEN = (torch.float16, torch.bfloat16)


def _ops():
    R = dist.ReduceOp
    return {R.SUM: "sum", R.AVG: "sum", R.PRODUCT: "prod", R.MIN: "min", R.MAX: "max",
            R.BAND: "band", R.BOR: "bor", R.BXOR: "bxor"}


class Work(dist.Work):
    """A collective in flight: :meth:`wait` blocks until it is done (raising its
    error), :meth:`get_future` completes on the group's thread."""

    def __init__(self, future, result):
        super().__init__()
        self._future, self._result = future, result

    def wait(self, timeout=None):
        del timeout   # (the store's watchdog bounds a hang, not a wait here)
        self._future.wait()
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - the answer is whether it failed
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def get_future(self):
        return self._future

    def result(self):
        self.wait()
        return self._result


_host = tensors.host_tensor
_buffer = tensors.wire_array


def _agreed(method):
    """A collective whose argument checks (an InputError) become the agreed refusal of
    the call on every rank: no rank raises before the ranks agree."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        opts = [a for a in (*args, *kwargs.values()) if hasattr(a, "asyncOp")]
        self._blocking.value = bool(opts) and not opts[-1].asyncOp
        try:
            return method(self, *args, **kwargs)
        except errors.InputError as exc:
            return self._run((method.__name__, "refused"), lambda: None, None, problem=str(exc))
        finally:
            self._blocking.value = False
    return call


class ProcessGroupMPIKV(dist.ProcessGroup):
    """A process group over an MPI communicator (see the module's docstring).

    Args:
        wire: the group's :class:`~mpikv.transport.group.GroupComm` (its ranks, in
            group order).
        timeout: the group's timeout (a ``datetime.timedelta``), kept for torch.
    """

    def __init__(self, wire, timeout=None, sums=None):
        super().__init__(wire.rank, wire.size)
        self.wire = wire
        #: the store's strategies for all_reduce's sums (a GroupSums), or None: MPI's
        self.sums = sums
        self.timeout = timeout
        # A rank that never comes ends the job after the store's timeout (MPIKV_TIMEOUT,
        # 600 s), naming the collective, as a store's call does; never a silent wait.
        self._watchdog = Watchdog(config.resolve().timeout, wire.rank)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpikv-pg")
        self._lock = threading.Lock()
        self._closed = False
        self._calls = 0
        # A blocking call with nothing queued runs on the caller's thread (no handoff to
        # the group's thread to wait for). One thread at a time calls MPI on the group's
        # communicator (_mpi), in the order the calls were made.
        self._blocking = threading.local()
        self._blocking.value = False
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

    def _run(self, description, action, result=None, problem=None):
        """``action()`` on the group's thread after the ranks agreed on ``description``
        (None: not agreed); returns its :class:`Work`. ``problem``: why this rank
        refuses the call, raised (as every rank's) on every rank instead."""
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

        with self._lock:
            if self._closed:
                raise errors.InputError("the mpikv process group is shut down")
            self._queued += 1
            inline = self._queued == 1 and getattr(self._blocking, "value", False)
            if not inline:
                self._pool.submit(run)
        if inline:
            run()
        return Work(future, result)

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
        listed = "; ".join(f"rank {r}: {_say(c)}" for r, c in enumerate(calls))
        raise errors.MismatchError(f"the ranks of the mpikv process group made different "
                                   f"collective calls ({listed})")

    def _reduce_op(self, op, dtype):
        op = getattr(op, "op", op)   # (options hold a ReduceOp, whose .op is the RedOpType)
        if op not in _ops():
            raise errors.InputError(f"the mpikv backend does not take {op}")
        if _kind(op) == dist.ReduceOp.AVG and not dtype.is_floating_point:
            raise errors.InputError("ReduceOp.AVG needs a floating point tensor")
        if dtype == torch.bool or dtype.is_complex:
            raise errors.InputError(f"the mpikv backend does not reduce {dtype} tensors")
        return _ops()[op]

    # -- collectives (each @_agreed: a bad argument on one rank is refused on all) ---

    @_agreed
    def allreduce(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        (tensor,) = tensors
        mpi_op = self._reduce_op(op, tensor.dtype)

        def run():
            self._allreduce_into(tensor, mpi_op, _kind(op) == dist.ReduceOp.AVG)
        return self._run(("allreduce", _shape(tensor), str(_kind(op))), run, tensors)

    def _allreduce_into(self, tensor, mpi_op, average):
        host = _host(tensor)
        work = host.float() if tensor.dtype in _SIXTEEN else host
        buf = _buffer(work)
        if mpi_op == "sum" and self.sums is not None and self.sums.takes(buf):
            self.sums.allreduce_(buf, ("torch.distributed all_reduce", []))
        else:
            self.wire.allreduce_(buf, mpi_op)
        if average:
            work.div_(self.size())
        if work is not host:
            host.copy_(work)
        if host.data_ptr() != tensor.data_ptr():
            tensor.copy_(host)

    def allreduce_coalesced(self, tensors, opts=None):
        works = [self.allreduce([t], opts) for t in tensors]
        return works[-1] if works else self.barrier()

    @_agreed
    def broadcast(self, tensors, opts=None):
        (tensor,) = tensors
        root = 0 if opts is None else opts.rootRank

        def run():
            host = _host(tensor)
            self.wire.bcast_(_buffer(host), root)
            if host.data_ptr() != tensor.data_ptr():
                tensor.copy_(host)
        return self._run(("broadcast", _shape(tensor), root), run, tensors)

    @_agreed
    def reduce(self, tensors, opts=None):
        (tensor,) = tensors
        op, root = (dist.ReduceOp.SUM, 0) if opts is None else (opts.reduceOp, opts.rootRank)
        mpi_op = self._reduce_op(op, tensor.dtype)

        def run():
            host = _host(tensor)
            work = host.float() if tensor.dtype in _SIXTEEN else host
            self.wire.reduce_(_buffer(work), mpi_op, root)
            if self.wire.rank == root:
                if _kind(op) == dist.ReduceOp.AVG:
                    work.div_(self.size())
                if work is not host:
                    host.copy_(work)
                if host.data_ptr() != tensor.data_ptr():
                    tensor.copy_(host)
        return self._run(("reduce", _shape(tensor), str(_kind(op)), root), run, tensors)

    @_agreed
    def allgather(self, output_tensors, input_tensors, opts=None):
        (outs,), (tensor,) = output_tensors, input_tensors
        self._check_list("allgather", outs, tensor)

        def run():
            gathered = torch.empty((self.size(),) + tuple(tensor.shape), dtype=tensor.dtype)
            self.wire.allgather(_buffer(_host(tensor)), _buffer(gathered))
            for out, part in zip(outs, gathered):
                out.copy_(part)
        return self._run(("allgather", _shape(tensor)), run, output_tensors)

    @_agreed
    def _allgather_base(self, output, tensor, opts=None):
        if output.numel() != tensor.numel() * self.size() or output.dtype != tensor.dtype:
            raise errors.InputError(f"all_gather_into_tensor: the output must hold "
                                    f"{self.size()} x {tensor.numel()} {tensor.dtype} "
                                    f"elements, not {output.numel()} {output.dtype}")

        return self._run(("allgather_into_tensor", _shape(tensor)),
                         lambda: self._allgather_into(output, tensor), [output])

    def _allgather_into(self, output, tensor):
        host = _host(output)
        self.wire.allgather(_buffer(_host(tensor)), _buffer(host))
        if host.data_ptr() != output.data_ptr():
            output.copy_(host.view(output.shape))

    allgather_into_tensor = all_gather_single = _allgather_base

    @_agreed
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        (out,), (ins,) = output_tensors, input_tensors
        self._check_list("reduce_scatter", ins, out)
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._reduce_scatter(out, torch.stack([_host(t) for t in ins]), op,
                                    output_tensors)

    @_agreed
    def _reduce_scatter_base(self, output, tensor, opts=None):
        if tensor.numel() != output.numel() * self.size() or output.dtype != tensor.dtype:
            raise errors.InputError(f"reduce_scatter_tensor: the input must hold "
                                    f"{self.size()} x {output.numel()} {output.dtype} "
                                    f"elements, not {tensor.numel()} {tensor.dtype}")
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._reduce_scatter(output, tensor, op, [output])

    reduce_scatter_tensor = reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter(self, output, stacked, op, result):
        mpi_op = self._reduce_op(op, output.dtype)

        def run():
            self._reduce_scatter_into(output, stacked, mpi_op, _kind(op) == dist.ReduceOp.AVG)
        return self._run(("reduce_scatter", _shape(output), str(_kind(op))), run, result)

    def _reduce_scatter_into(self, output, stacked, mpi_op, average):
        src = _host(stacked)
        src = src.float() if src.dtype in _SIXTEEN else src
        mine = torch.empty(output.numel(), dtype=src.dtype)
        self.wire.reduce_scatter_block(_buffer(src).reshape(-1), _buffer(mine), mpi_op)
        if average:
            mine.div_(self.size())
        output.copy_(mine.view(output.shape))

    # torch's functional collectives (DTensor's full_tensor() and redistribute, a
    # resharding checkpoint load) call these two, with one pair or several.
    @_agreed
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check_pairs("all_gather_into_tensor", outputs, inputs,
                          lambda o, i: o.numel() == i.numel() * self.size())

        def run():
            for output, tensor in zip(outputs, inputs):
                self._allgather_into(output, tensor)
        return self._run(("allgather_into_tensor_coalesced",
                          tuple(_shape(t) for t in inputs)), run, outputs)

    @_agreed
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check_pairs("reduce_scatter_tensor", outputs, inputs,
                          lambda o, i: i.numel() == o.numel() * self.size())
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        mpi_ops = [self._reduce_op(op, t.dtype) for t in outputs]
        average = _kind(op) == dist.ReduceOp.AVG

        def run():
            for output, tensor, mpi_op in zip(outputs, inputs, mpi_ops):
                self._reduce_scatter_into(output, tensor, mpi_op, average)
        return self._run(("reduce_scatter_tensor_coalesced", tuple(_shape(t) for t in outputs),
                          str(_kind(op))), run, outputs)

    @_agreed
    def gather(self, output_tensors, input_tensors, opts=None):
        (tensor,) = input_tensors
        root = 0 if opts is None else opts.rootRank
        mine = self.wire.rank == root
        if mine:
            self._check_list("gather", output_tensors[0], tensor)

        def run():
            gathered = (torch.empty((self.size(),) + tuple(tensor.shape), dtype=tensor.dtype)
                        if mine else None)
            self.wire.gather(_buffer(_host(tensor)), _buffer(gathered) if mine else None, root)
            if mine:
                for out, part in zip(output_tensors[0], gathered):
                    out.copy_(part)
        return self._run(("gather", _shape(tensor), root), run, output_tensors)

    @_agreed
    def scatter(self, output_tensors, input_tensors, opts=None):
        (out,) = output_tensors
        root = 0 if opts is None else opts.rootRank
        mine = self.wire.rank == root
        if mine:
            self._check_list("scatter", input_tensors[0], out)

        def run():
            src = torch.stack([_host(t) for t in input_tensors[0]]) if mine else None
            host = torch.empty_like(out, device="cpu").contiguous()
            self.wire.scatter(_buffer(src) if mine else None, _buffer(host), root)
            out.copy_(host)
        return self._run(("scatter", _shape(out), root), run, output_tensors)

    @_agreed
    def all_to_all_single(self, output, tensor, output_split_sizes, input_split_sizes,
                          opts=None):
        p = self.size()
        rows_in = _splits(input_split_sizes, tensor, p, "input")
        rows_out = _splits(output_split_sizes, output, p, "output")
        row = tensor[0].numel() if tensor.dim() and tensor.shape[0] else 0
        row = row or (output[0].numel() if output.dim() and output.shape[0] else 1)

        def run():
            host = _host(output)
            send = [int(r) * row for r in rows_in]
            recv = [int(r) * row for r in rows_out]
            self.wire.alltoallv(_buffer(_host(tensor)).reshape(-1), send,
                                _buffer(host).reshape(-1), recv)
            if host.data_ptr() != output.data_ptr():
                output.copy_(host)
        # The splits differ between ranks by design: only their dtype and row shape agree.
        return self._run(("all_to_all_single", str(tensor.dtype), tuple(tensor.shape[1:])),
                         run, [output])

    alltoall_base = all_to_all_single

    @_agreed
    def alltoall(self, output_tensors, input_tensors, opts=None):
        def run():
            me = self.wire.rank
            hosts = [_host(out) for out in output_tensors]
            self.wire.exchange([_buffer(_host(src)) for src in input_tensors],
                               [_buffer(h) for h in hosts])
            for r, (out, host) in enumerate(zip(output_tensors, hosts)):
                out.copy_(input_tensors[r] if r == me else host)
        dtypes = {str(t.dtype) for t in input_tensors}
        return self._run(("all_to_all", tuple(sorted(dtypes))), run, output_tensors)

    @_agreed
    def barrier(self, opts=None):
        return self._run(("barrier",), self.wire.barrier, [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()

    # -- point to point --------------------------------------------------------------

    def send(self, tensors, dst, tag):
        (tensor,) = tensors
        return self._run(None, lambda: self.wire.send(_buffer(_host(tensor)), dst, tag),
                         tensors)

    def recv(self, tensors, src, tag):
        (tensor,) = tensors

        def run():
            host = _host(tensor)
            self.wire.recv(_buffer(host), src, tag)
            if host.data_ptr() != tensor.data_ptr():
                tensor.copy_(host)
        return self._run(None, run, tensors)

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

    def _check_pairs(self, op, outputs, inputs, sized):
        if len(outputs) != len(inputs) or any(
                o.dtype != i.dtype or not sized(o, i) for o, i in zip(outputs, inputs)):
            raise errors.InputError(f"{op}: outputs {[_shape(t) for t in outputs]} do not "
                                    f"match inputs {[_shape(t) for t in inputs]} at "
                                    f"{self.size()} ranks")

    def _check_list(self, op, tensors, like):
        if len(tensors) != self.size() or any(
                t.shape != like.shape or t.dtype != like.dtype for t in tensors):
            raise errors.InputError(f"{op}: needs {self.size()} tensors of {like.dtype} "
                                    f"{tuple(like.shape)}, one per rank")


def _kind(op):
    return getattr(op, "op", op)


def _shape(tensor):
    return (str(tensor.dtype), tuple(tensor.shape))


def _say(description):
    op, *rest = description
    return f"{op}{tuple(rest)}"


def _splits(sizes, tensor, p, what):
    if not sizes:
        if tensor.shape[0] % p:
            raise errors.InputError(f"all_to_all_single: the {what}'s first dimension "
                                    f"{tensor.shape[0]} does not divide by {p} ranks")
        return [tensor.shape[0] // p] * p
    if len(sizes) != p or sum(sizes) != tensor.shape[0]:
        raise errors.InputError(f"all_to_all_single: {what} split sizes {list(sizes)} do not "
                                f"cover the {what}'s {tensor.shape[0]} rows in {p} parts")
    return list(sizes)


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
