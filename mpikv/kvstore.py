"""The store: MXNet's KVStore API over a transport.

One class serves every store type. A ``local`` store is the one-rank case of
the same code, over a transport whose collectives do nothing; a ``dist_sync``
store runs over MPI. Every collective call first lets the ranks agree on what
it is (:mod:`mpikv.agreement`), so a bad call raises the same error on every
rank and changes nothing.
"""


import atexit
import contextlib
import dataclasses

import numpy as np

from . import backends, checkpoint, config, errors, mirror, tuning
from ._arrays import is_half
from ._closing import ClosesAfterWith
from ._executor import Handle
from ._logging import get_logger
from ._protocol import Protocol, ReplayedCall
from .agreement import format_ranks
from .calls import Call, CallReader
from .engine import Engine
from .fusion import sizes
from .row_tables import RowTables
from .rowsparse import RowSparse
from .saving import SaveHandle
from .transport import make_transport

#: store type -> transport kind
STORE_TYPES = {
    "local": "local",
    "device": "local",
    "dist_sync": "mpi",
    "dist_sync_device": "mpi",
    "dist_device_sync": "mpi",  # MXNet accepts both spellings
}


def create(name="local", comm=None, timeout=None, bigarray_bound=None, abort_on_exception=None,
           bucket_bytes=None, shared_memory=None, reducer=None, autotune=None, direct_bytes=None,
           staging_piece=None, fault_tolerant=None):
    """Creates a store. Collective over ``comm`` for distributed types.

    Args:
        name: "local", "device", "dist_sync" or "dist_sync_device".
        comm: mpi4py intra-communicator of a distributed store (default
            ``MPI.COMM_WORLD``); every rank of it is a worker and an owner.
        timeout: seconds a collective may wait for the other ranks before the
            job is ended (default ``MPIKV_TIMEOUT`` or 600; 0 means never).
        bigarray_bound: arrays of at least this many elements are split over
            all owners (default ``MPIKV_BIGARRAY_BOUND`` or 1,000,000).
        abort_on_exception: end the whole job when an exception escapes on
            any rank (default ``MPIKV_ABORT_ON_EXCEPTION`` or on).
        bucket_bytes: the largest bucket small keys are fused into (default
            ``MPIKV_BUCKET_BYTES`` or 4 MiB); also the largest piece one
            ``Allreduce`` moves.
        shared_memory: put :meth:`KVStore.gradient_buffers` in node-local MPI
            shared memory and sum them straight from the peers' buffers
            (default ``MPIKV_SHARED_MEMORY`` or on).
        reducer: the reduction strategy: "auto" (the tuning table, see
            :mod:`mpikv.tuning`) or one of :data:`mpikv.reducers.NAMES`
            (default ``MPIKV_REDUCER`` or "auto").
        autotune: with no tuning cache for this MPI and layout, measure the
            strategies for a few seconds at creation (default
            ``MPIKV_AUTOTUNE`` or on); off: the measured default table.
        direct_bytes: keys of at least this many bytes are summed straight
            from the caller's arrays rather than packed into buckets (default
            ``MPIKV_DIRECT_BYTES`` or 256 KiB). ``device`` stores pack every
            key they do not split, in buckets of at least 32 MiB
            (:func:`mpikv.fusion.sizes`).
        staging_piece: device buffers staged through host memory (MPI not
            CUDA-aware) for an ``Allreduce``, ``Reduce`` or ``Bcast`` move in
            pieces of this many bytes, their copies overlapping MPI (default
            ``MPIKV_STAGING_PIECE`` or 4 MiB; 0: whole buffers).
        fault_tolerant: a rank lost during a call of a distributed store is one
            :class:`mpikv.RankLostError` on every survivor (default
            ``MPIKV_FAULT_TOLERANT`` or off); needs a ULFM launch (``scripts/mpirun.sh
            --ft``), else :class:`mpikv.FaultToleranceUnavailableError` on every rank.
            A ``local`` store ignores it. See docs/fault-tolerance.md.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: unknown store type or bad option.
    """
    if not isinstance(name, str):
        raise TypeError(f"store type must be a string, not {type(name).__name__}")
    kind = STORE_TYPES.get(name.lower())
    if kind is None:
        raise ValueError(f"unknown store type {name!r}; valid types: "
                         f"{', '.join(sorted(STORE_TYPES))}")
    if kind == "local" and comm is not None:
        raise ValueError(f"a {name!r} store has no communicator; use a dist_* type with comm=")
    if kind == "local":
        options = config.resolve(timeout, bigarray_bound, abort_on_exception, bucket_bytes,
                                 shared_memory, reducer, autotune, direct_bytes, staging_piece,
                                 fault_tolerant=fault_tolerant)
        transport = make_transport(kind, comm, options)
        device_buckets = "device" in name.lower()
    else:
        # A bad option on one rank must not leave the others waiting in the
        # collectives below: every rank raises, after they compared notes.
        try:
            options, failure = config.resolve(
                timeout, bigarray_bound, abort_on_exception, bucket_bytes, shared_memory,
                reducer, autotune, direct_bytes, staging_piece,
                fault_tolerant=fault_tolerant), None
        except ValueError as exc:
            options, failure = config.Options(), str(exc)
        transport = make_transport(kind, comm, options)
        _drain_at_exit()
        device_buckets = _agree_on_options(transport, options, failure,
                                           "device" in name.lower())
    table = tuning.resolve(transport, options.reducer, options.autotune)
    store = KVStore(name.lower(), transport, options, table, device_buckets)
    if kind == "mpi":
        _OPEN.append(store)
        bucket, direct = sizes(device_buckets, options.bucket_bytes, options.direct_bytes)
        get_logger().info(
            "store %s: %d ranks; strategies from %s (4 MiB in place: %s, out of place: %s); "
            "buckets of %d bytes; %s; timeout %g s; "
            "arrays of %d elements or more split; background calls %s", name, transport.size,
            table.source, table.choose(4 << 20, True), table.choose(4 << 20, False),
            bucket, "every key fused" if direct is None else
            f"keys of {direct} bytes or more unfused", options.timeout,
            options.bigarray_bound, "on a worker thread" if transport.threaded
            else "run inline (MPI is not THREAD_MULTIPLE)")
    return store


_drain_registered = False


def _drain_at_exit():
    """Background calls finish at exit before shared windows are freed and MPI
    finalizes: registered after both (atexit runs the last registered first)."""
    global _drain_registered
    if not _drain_registered:
        import importlib
        importlib.import_module(".transport.shm", __package__)  # registers its hook first
        from ._executor import drain_all
        atexit.register(drain_all)
        # Runs before drain_all, the shared windows' release, the flight-recorder
        # listener's end and MPI's finalization: all registered before it.
        atexit.register(_end_of_process)
        _drain_registered = True


#: the distributed stores not closed yet, in creation order (the same on every rank)
_OPEN = []


def _end_of_process():
    """At the end of the process, every store still open makes one agreed "exit" call.

    When every rank ends its process, the calls agree and nothing is printed.
    A rank still in a call of the store (in a training step, say) gets a
    MismatchError at once that says this rank's process ended, instead of
    waiting for the timeout; here, the same error is printed on standard error
    and the process ends with a nonzero status
    (:func:`mpikv.transport.watchdog.exit_failed`).
    """
    from .transport.world import mpi_running
    if not mpi_running():   # the program finalised MPI itself
        return
    # Newest first: a rank waiting in a call of the others waits, most likely, in
    # the store they made last (the order is the same on every rank).
    for store in list(reversed(_OPEN)):
        try:
            store._protocol.exit(store._finish_saves)
        except Exception as exc:  # noqa: BLE001 - the process must end, not hang
            from .transport.watchdog import exit_failed
            exit_failed(exc, store._options.abort_on_exception)


#: options that change which collectives a store calls: they must be equal on every rank
AGREED_OPTIONS = ("bigarray_bound", "bucket_bytes", "direct_bytes", "shared_memory", "reducer",
                  "autotune", "staging_piece")


def _agree_on_options(transport, options, failure, device):
    """Raises the same error on every rank if an option was bad, or differs, on any rank.

    Returns whether the store packs keys as a ``device`` store does
    (:func:`mpikv.fusion.sizes`): where any rank's type is a device one. Ranks may
    make different types (a Trainer picks one by where its parameters are); their
    buckets must still be the same.
    """
    mine = {"error": failure, "device": device,
            **{name: getattr(options, name) for name in AGREED_OPTIONS}}
    everyone = transport.allgather_records(mine, ("create", []))
    bad = [(r, o["error"]) for r, o in enumerate(everyone) if o["error"]]
    if bad:
        raise errors.InputError("create: " + "; ".join(
            f"{format_ranks([r])}: {text}" for r, text in bad) + "; no store was created")
    differ = []
    for name in AGREED_OPTIONS:
        values = {}
        for rank, o in enumerate(everyone):
            values.setdefault(repr(o[name]), []).append(rank)
        if len(values) > 1:
            differ.append(f"{name} is " + ", ".join(f"{v} on {format_ranks(rs)}"
                                                     for v, rs in values.items()))
    if differ:
        raise errors.MismatchError("create: ranks gave different store options: "
                                   + "; ".join(differ) + "; no store was created")
    return any(o["device"] for o in everyone)


class KVStore(ClosesAfterWith):
    """A key-value store for data-parallel training (use :func:`create`)."""

    def __init__(self, name, transport, options, table, device_buckets=None):
        self._type = name
        self._transport = transport
        self._options = options
        self._engine = Engine(transport, options.bigarray_bound, options.bucket_bytes,
                              device="device" in name, direct_bytes=options.direct_bytes,
                              table=table, device_buckets=device_buckets)
        self._protocol = Protocol(transport, self._engine)
        self._reader = CallReader(self._engine.lookup, lambda: self._engine.key_type)
        self._rows = RowTables(transport)
        self._saves = []   # background saves not yet committed, oldest first
        self._mirror = None   # redundancy="memory": the buddy copies (keep_copy)

    # -- properties ------------------------------------------------------
    @property
    def type(self):
        """The store type given to :func:`create`."""
        return self._type

    @property
    def rank(self):
        """This worker's rank, in ``[0, num_workers)``."""
        return self._transport.rank

    @property
    def num_workers(self):
        """The number of workers (ranks of the communicator)."""
        return self._transport.size

    @property
    def comm(self):
        """The store's own mpi4py communicator (a duplicate of the one given to
        :func:`create`), or None for a local store."""
        return getattr(self._transport, "comm", None)

    @property
    def tuning_table(self):
        """The :class:`mpikv.tuning.Table` that picks each bucket's reduction strategy."""
        return self._engine.chooser.table

    def outdate(self, keys):
        """Marks this rank's copies of ``keys`` as no longer the owners' values: the
        next ``pull`` of each gathers it from its owners, as after a push.

        For a caller that reuses the memory of the parts it does not own (the
        Trainer's ``shard="parameters"``). Local, but every rank must call it
        alike (the pulls it changes are collective), when no pull of these keys
        is in flight.

        Args:
            keys: a list of initialised keys.
        """
        self._engine.outdate(list(keys))

    def uses_shared_memory(self, keys):
        """Whether the zero-copy buffers of this key list live in node shared memory."""
        return self._engine.uses_shared_memory(list(keys))

    @property
    def plan(self):
        """The :class:`mpikv.plan.OwnershipPlan`: who owns each key or shard."""
        return self._engine.plan

    @property
    def optimizer(self):
        """The :class:`mpikv.optimizer.Optimizer` run on the owners, or None.

        The live object: changing its hyperparameters (``set_learning_rate``)
        changes the next push's updates; every rank must change them alike
        (checked at each push).
        """
        return self._engine.optimizer

    @property
    def gradient_compression(self):
        """The parameters :meth:`set_gradient_compression` set (checked and
        completed: ``{'type': '2bit', 'threshold': 0.5}``), or None."""
        comp = self._engine.compression
        return None if comp is None else dict(comp.config)

    def gradient_residual(self, key, device=None):
        """This rank's compression residual of ``key``, shaped like the key.

        Args:
            key: an initialised key.
            device: on a ``device`` store, which of the key's device values
                (each has its own residual); None on a distributed store.

        Returns:
            A float32 copy, or None before the key's first compressed push (and
            for 16-bit compression, which keeps none).
        """
        comp = self._engine.compression
        found = None if comp is None else comp.residual(key, device)
        if found is None:
            return None
        return found.reshape(self._engine.entries[key].array.shape).copy()

    @contextlib.contextmanager
    def count_bytes(self):
        """Counts the bytes this store's collectives bring to this rank inside the block.

        Yields a counter with ``.bytes`` and ``.calls`` (a ``Counter`` per MPI
        operation); a local store moves nothing and counts 0. Waits for the
        store's background calls on entry and exit, so every counted call
        started and ended inside the block.
        """
        self._protocol.wait()
        with self._transport.count_bytes() as counter:
            try:
                yield counter
            finally:
                self._protocol.wait()

    def fail_next_call(self, exc_class, message):
        """Makes this rank's next collective call fail on every rank, nothing applied.

        For adapters (:mod:`mpikv.mxnet`) whose own checks of a call's
        arguments run before the store reads them: a failure found on one rank
        then reaches every rank through the call's agreement, as the store's
        own input errors do, instead of leaving the others waiting.

        Args:
            exc_class: an :class:`~mpikv.errors.MPIKVError` subclass.
            message: the error's text (every rank's message names this rank).
        """
        if not (isinstance(exc_class, type) and issubclass(exc_class, errors.MPIKVError)):
            raise TypeError(f"exc_class must be an MPIKVError subclass, not {exc_class!r}")
        self._protocol.fail_next_call(exc_class, message)

    # -- collective operations ------------------------------------------
    def init(self, key, value):
        """Creates keys; their values are rank 0's.

        Args:
            key: a key (int or str) or a list of keys.
            value: an array per key (a list of arrays: the first is used).
        """
        call = self._read("init", key, value, new_keys=True, need_values=True)
        for k in call.keys:
            if k in self._rows:
                call.fail(errors.DuplicateInitError, k, f"key {k!r} is a row table already")
        self._protocol.collective(call, lambda: self._engine.init(call.op, call.items))

    def push(self, key, value, priority=0):
        """Sums values over devices and ranks and hands the sum to the updater.

        Args:
            key: a key or a list of keys.
            value: per key, an array or a list of arrays (one per device); for a
                row table (:meth:`init_rows`), a :class:`~mpikv.RowSparse`.
            priority: an int, or one int per key: buckets holding keys of
                higher priority move first. Must be the same on every rank.
        """
        if self._is_rows_call(key, value):
            self._push_rows(key, value)
            return
        if not self._protocol.one_key("push", key, value, None, priority,
                                      lambda: self._push_call("push", key, value, priority)):
            self._protocol.run(self._push_call("push", key, value, priority), push=True,
                               remember=(key, None))

    def push_async(self, key, value, priority=0):
        """:meth:`push` in the background; returns a :class:`Handle`.

        Errors in the call are raised here, on every rank. Do not change
        ``value`` until :meth:`wait` returns for the handle.
        """
        return self._protocol.submit(self._push_call("push", key, value, priority), push=True)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copies stored values into ``out``.

        Args:
            key: a key or a list of keys.
            out: per key, an array or a list of arrays, each filled.
            priority: as for :meth:`push`.
            ignore_sparse: accepted for MXNet compatibility.
        """
        del ignore_sparse
        if not self._protocol.one_key("pull", key, None, out, priority,
                                      lambda: self._pull_call(key, out, priority)):
            self._protocol.run(self._pull_call(key, out, priority), pull=True,
                               remember=(key, out))

    def pull_async(self, key, out=None, priority=0):
        """:meth:`pull` in the background; ``out`` is filled when :meth:`wait` returns."""
        return self._protocol.submit(self._pull_call(key, out, priority), pull=True)

    def pushpull(self, key, value, out=None, priority=0):
        """:meth:`push` then :meth:`pull` in one collective call.

        With ``out=None`` the result is written into ``value``.
        """
        if not self._protocol.one_key(
                "pushpull", key, value, value if out is None else out, priority,
                lambda: self._push_call("pushpull", key, value, priority, out)):
            self._protocol.run(self._push_call("pushpull", key, value, priority, out),
                               push=True, pull=True, remember=(key, out))

    def pushpull_async(self, key, value, out=None, priority=0):
        """:meth:`pushpull` in the background; returns a :class:`Handle`."""
        return self._protocol.submit(self._push_call("pushpull", key, value, priority, out),
                                     push=True, pull=True)

    # -- row tables ------------------------------------------------------
    def init_rows(self, key, shape, dtype=np.float32, init=None, row_sparse_weight=False):
        """Creates a row table: ``key``'s rows live on their owners only.

        Rank ``r`` owns the ``r``-th of ``num_workers`` near-equal blocks of rows
        and allocates only those; no rank ever holds the whole table. Push
        :class:`~mpikv.RowSparse` rows to it (:meth:`push`) and read rows with
        :meth:`row_sparse_pull`. Collective.

        Args:
            key: a new key (int or str, as the store's other keys).
            shape: the whole table's shape (rows first).
            dtype: its dtype.
            init: ``init(first_row, stop_row)`` returning this rank's rows, a
                number for every element, or None (zeros).
            row_sparse_weight: the value is row-sparse, as an MXNet
                ``row_sparse`` weight: an optimizer whose MXNet kernel for such
                weights steps only the rows present (Ftrl) does so here too.
        """
        call = Call("init_rows")
        shape = tuple(int(d) for d in np.atleast_1d(shape))
        call.settings.update(key=repr(key), shape=str(shape), dtype=str(np.dtype(dtype)),
                             row_sparse_weight=str(bool(row_sparse_weight)))
        table = None
        if key in self._rows or self._engine.lookup(key) is not None:
            call.fail(errors.DuplicateInitError, key, f"key {key!r} is already initialised")
        elif not shape or min(shape) < 0:
            call.fail(errors.ShapeError, key, f"a row table needs rows: shape {shape}")
        else:   # this rank's rows first: an initializer that fails fails every rank
            try:
                table = self._rows.make(shape, dtype, init, row_sparse_weight)
            except errors.MPIKVError as exc:
                call.fail(type(exc), key, f"row table {key!r}: {exc}")
            except Exception as exc:  # noqa: BLE001 - the user's initializer
                call.fail(errors.InputError, key, f"the initializer of row table {key!r} "
                          f"raised {type(exc).__name__}: {exc}")
        self._protocol.collective(call, lambda: self._rows.install(key, table))

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Copies rows ``row_ids`` of ``key`` into ``out``; only they are fetched.

        As MXNet's: ids may repeat and come in any order. Collective (every rank
        calls it, each with its own ids).

        Args:
            key: a row table's key.
            out: None, a :class:`~mpikv.RowSparse` (it gets the rows, each id
                once, in increasing order) or a dense array of the table's shape
                (those rows filled, the others zeroed).
            row_ids: 1-D integers in ``[0, rows)``.
            priority: accepted for MXNet compatibility.

        Returns:
            the rows as a :class:`~mpikv.RowSparse` (``out`` itself if given one).
        """
        del priority
        call = Call("row_sparse_pull")
        call.settings.update(key=repr(key))
        table = self._rows.tables.get(key)
        ids = None
        if table is None:
            call.fail(errors.UnknownKeyError, key, f"{key!r} is not a row table "
                      f"(make it with init_rows)")
        else:
            try:
                ids = np.asarray([] if row_ids is None else row_ids)
                # (the ids' checks only: rows that read as zeros, with no memory)
                RowSparse(ids.reshape(-1), np.broadcast_to(np.zeros((), table.dtype),
                                                           (ids.size, *table.shape[1:])),
                          table.shape)
                if out is not None and not isinstance(out, RowSparse) and (
                        not isinstance(out, np.ndarray) or out.shape != table.shape):
                    raise errors.ShapeError(f"out must be a RowSparse or an array of the "
                                            f"table's shape {table.shape}")
            except errors.MPIKVError as exc:
                call.fail(type(exc), key, str(exc))
        result = []
        self._protocol.collective(call, lambda: result.append(
            self._rows.pull((call.op, [key]), key, ids)))
        rows = result[0]
        if isinstance(out, RowSparse):
            out.indices, out.data, out.shape = rows.indices, rows.data, rows.shape
            return out
        if out is not None:
            out[...] = 0
            out[rows.indices] = rows.data
        return rows

    def _is_rows_call(self, key, value):
        keys = key if isinstance(key, (list, tuple)) else [key]
        values = value if isinstance(value, (list, tuple)) else [value]
        return any(isinstance(v, RowSparse) for v in values) or any(
            isinstance(k, (int, str)) and k in self._rows for k in keys)

    def _push_rows(self, key, value):
        """A push to row tables: each row to its owner (see :mod:`mpikv.row_tables`)."""
        keys = list(key) if isinstance(key, (list, tuple)) else [key]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        call = Call("push_rows")
        call.settings.update(keys=repr(keys), updater=self._engine.updater_kind)
        if self._engine.optimizer is not None:
            call.settings["optimizer"] = self._engine.optimizer.get_config()
        if len(keys) != len(values):
            call.fail(errors.InputError, None, f"{len(keys)} keys but {len(values)} values")
        for k, v in zip(keys, values):
            table = self._rows.tables.get(k)
            if table is None:
                call.fail(errors.UnknownKeyError, k, f"{k!r} is not a row table (make it with "
                          f"init_rows; dense keys take dense pushes)")
            elif not isinstance(v, RowSparse):
                call.fail(errors.ValueTypeError, k, f"row table {k!r} takes a RowSparse push, "
                          f"not {type(v).__name__}")
            elif v.shape != table.shape:
                call.fail(errors.ShapeError, k, f"the push has shape {v.shape}; row table {k!r} "
                          f"has {table.shape}")
        owners = self._engine.owners
        self._protocol.collective(call, lambda: [
            self._rows.push((call.op, [k]), k, v, owners) for k, v in zip(keys, values)])

    def wait(self, handle=None):
        """Waits for a handle, a list of handles, or (``None``) every call made so far."""
        self._protocol.wait(handle)

    synchronize = wait

    def broadcast(self, key, value, out, priority=0):
        """:meth:`init` with rank 0's ``value``, then :meth:`pull` into ``out``."""
        call = self._read("broadcast", key, value, out, new_keys=True, need_values=True,
                          need_outs=True, settings={"priority": priority})
        def run():
            self._engine.init(call.op, call.items)
            self._engine.pull(call.op, call.items)
        self._protocol.collective(call, run)

    def allreduce_(self, array, tag=None):
        """Sums ``array`` over the ranks, in place; collective.

        For small sums beside the keys (the torch Trainer's per-step status):
        no key, no updater or optimizer, never compressed, not in checkpoints.
        Agreed, watched and recorded as every call; :meth:`fail_next_call`
        applies to it. A rank in :meth:`join` adds zeros (or its ``on_call``'s
        array).

        Args:
            array: a writable, contiguous numpy or cupy array (or a tensor
                that views as one), of the same shape and dtype on every rank.
            tag: a name for what is summed (a string), agreed like the shape:
                ranks summing different things get a MismatchError naming
                them; a joined rank's ``on_call`` sees it in ``settings["tag"]``.
        """
        call = Call("allreduce_")
        if tag is not None:
            call.settings["tag"] = str(tag)
        native = None
        try:
            native = backends.as_native(array, writable=True, what="allreduce_'s array")[1]
        except errors.MPIKVError as exc:
            call.fail(type(exc), None, str(exc))
        if native is not None:
            if not native.flags.c_contiguous:
                call.fail(errors.ValueTypeError, None, "allreduce_'s array is not contiguous")
            call.settings.update(shape=str(tuple(native.shape)), dtype=str(native.dtype))
        self._protocol.collective(call, lambda: self._transport.allreduce_(native, (call.op, [])))

    def barrier(self):
        """Waits until every rank has called ``barrier`` (``MPI_Barrier``)."""
        self._protocol.collective(Call("barrier"), lambda: self._transport.barrier(("barrier", [])))

    _barrier = barrier

    def close(self):
        """Ends the store on every rank (collective, as ``MPI_Comm_free``).

        Waits for this rank's background calls, agrees with the other ranks,
        then releases the store's worker and watchdog threads, its two
        communicators, its optimizer states and scratch buffers. Arrays handed
        out (:meth:`value_buffers`, :meth:`gradient_buffers`) stay valid: node
        shared-memory windows are freed at exit, not here. Any later call
        raises :class:`~mpikv.errors.InputError` on every rank; closing again
        does nothing. ``with mpikv.create(...) as kv:`` closes on leaving the
        block normally (after an exception the store is left open: the other
        ranks may still be in a call).
        """
        if self._saves and not self._protocol.closed:   # the same list on every rank
            self._commit_save(self._saves[-1])
        self._protocol.close(self._release)

    def _release(self):
        if self in _OPEN:
            _OPEN.remove(self)
        self._engine.release()
        self._transport.close()

    def set_context(self, activity, hint=None, exit=None):
        """Says what this rank is doing, in its caller's terms; not collective.

        Each later call carries it in the record the ranks gather when their
        calls differ (it is not compared: ranks in different contexts that make
        the same call agree). When the ranks made different calls and differ
        in context, the :class:`~mpikv.errors.MismatchError` says what each
        rank was doing, the ranks with a hint first, then the hints:
        ``rank 0 called save_checkpoint after step 12 while rank 1 is in step
        13: save_checkpoint is collective: every rank must call it``. The torch
        Trainer sets it for its steps and its collective calls.

        Args:
            activity: words that complete "rank N ...", for one rank ("is in
                step 13"; a leading is/has/was becomes are/have/were for
                several); None forgets the context.
            hint: what to do about a difference, when this rank's call is the
                odd one ("save_checkpoint is collective: every rank must call
                it"), or None.
            exit: ``(activity, hint)`` for the end of the process in this
                context (see below), or None: ``"ended its process"``, no hint.

        At the end of the process every store not closed makes one agreed
        "exit" call, so a rank still in a call of the others gets this error
        within seconds rather than at the timeout.
        """
        self._protocol.set_context(activity, hint, exit)

    def _agree_on(self, op):
        """A call that moves nothing, named ``op`` (the torch Trainer's close): every
        rank must make it (a rank that has joined takes no part). Nothing on a closed
        store (closing is collective: the same on every rank)."""
        if not self._protocol.closed:
            self._protocol.collective(Call(op), lambda: None)

    def join(self, on_call=None, follow_optimizer=True):
        """Takes part in the other ranks' calls with zeros until every rank has joined.

        For uneven data, as Horovod's ``join``: a rank that has run out of
        batches calls it; until every rank has called it, this rank adds
        zeros to the others' pushes, pushpulls and :meth:`allreduce_` calls,
        runs its owner's share of the updates, and takes part in their pulls,
        barriers and ``gather_gradients``. Any other call made by a rank that
        has not joined (init, a save...) is a :class:`MismatchError` on the
        ranks that made it (the joined ranks keep waiting). Collective: it
        returns on every rank once the last rank has joined.

        Args:
            on_call: for a layer above the store that has its own part in the
                others' calls (``mpikv.torch.Trainer.join``): called on this
                thread with a :class:`ReplayedCall` (``op``, ``keys``,
                ``settings``, ``done``, ``array``) before each call this rank
                takes part in, and with the same object after its data moved.
                Before an allreduce_ it may return this rank's array (the
                others' shape and dtype, writable and contiguous; the sum is
                written into it) instead of zeros; otherwise it returns None
                (else ``TypeError``). An exception it raises leaves ``join``
                on this rank only: the others wait, until the exception ends
                the job (``abort_on_exception``) or the timeout does.
            follow_optimizer: a replayed push installs the others' optimizer
                hyperparameters (a ``set_learning_rate`` this rank did not
                see) as a fresh optimizer with this rank's update count and
                states. False keeps this rank's optimizer object, for a caller
                that shares the hyperparameters itself.

        Returns:
            int: the rank that joined last (of ranks that joined in the same
            call of the others, the highest).
        """
        return self._protocol.join(on_call, follow_optimizer)

    # -- local settings --------------------------------------------------
    def set_updater(self, updater):
        """Sets ``updater(key, input, stored)``, run on the owner of each key or shard.

        It must update ``stored`` in place. It runs once per push of a key, with
        the sum over all ranks as ``input``; for an array split over owners, once
        per shard on that shard's owner, with flat 1-D views of that shard. Every
        rank must set an updater before the next push (checked there).
        ``None`` restores the default, which assigns the sum.
        """
        if updater is not None and not callable(updater):
            raise TypeError(f"updater must be callable, not {type(updater).__name__}")
        self._protocol.wait()
        self._engine.set_updater(updater)

    _set_updater = set_updater

    def set_optimizer(self, optimizer):
        """Runs ``optimizer`` on the owners from now on; collective.

        Every rank must pass an optimizer of the same kind and hyperparameters
        (checked). Each rank keeps state only for the keys and shards it owns.

        Args:
            optimizer: an :class:`mpikv.optimizer.Optimizer`.
        """
        from .optimizer import Optimizer
        call = Call("set_optimizer")
        if isinstance(optimizer, Optimizer):
            call.settings["optimizer"] = optimizer.get_config()
        else:
            call.fail(errors.OptimizerError, None, f"set_optimizer needs an "
                      f"mpikv.optimizer.Optimizer, not {type(optimizer).__name__}")
        self._protocol.collective(call, lambda: self._install_optimizer(optimizer))

    def set_gradient_compression(self, compression_params):
        """Compresses the gradients of every later push and pushpull; collective.

        MXNet 1.9's 2-bit compression, ``{'type': '2bit', 'threshold': t}``
        (``threshold`` defaults to 0.5): each sender adds its gradient to its
        residual, sends ``+t`` where that reaches ``t``, ``-t`` where it reaches
        ``-t``, 0 elsewhere (2 bits a value, 16 per 32-bit word), and keeps the
        rest for its next push. ``{'type': 'fp16'}`` and ``{'type': 'bf16'}``
        send float32 gradients as 16 bits, summed in float32 and rounded once.
        ``init`` and ``pull`` are never compressed. As in MXNet, a ``local``
        store refuses; a ``device`` store compresses each device's values, a
        distributed store each rank's (summed over its devices). Only float32
        keys can then be pushed. Every rank must pass the same parameters.

        Args:
            compression_params: a dict with ``'type'`` and, for 2bit, optionally
                ``'threshold'`` (> 0); other keys are ignored, as in MXNet.

        Raises:
            InputError: a bad parameter or a store type that does not compress,
                on every rank, with nothing set.
            MismatchError: the ranks gave different parameters.
        """
        from . import compression
        call = Call("set_gradient_compression")
        config = None
        try:
            config = compression.parse_params(compression_params)
        except errors.MPIKVError as exc:
            call.fail(type(exc), None, str(exc))
        except Exception as exc:  # noqa: BLE001 - nothing may escape before the ranks agree
            call.fail(errors.InputError, None, f"compression_params cannot be read "
                      f"({type(exc).__name__}: {exc})")
        if not compression.supports(self._type):
            call.fail(errors.InputError, None, f"{compression.NOT_SUPPORTED} ({self._type!r}; "
                      f"use 'device' or a dist_* store)")
        call.settings["compression"] = compression.describe(config)
        self._protocol.collective(call, lambda: self._engine.set_compression(
            config, per_device=self._type == "device"))

    def is_capable(self, capability):
        """Whether the store supports ``capability`` ("optimizer" is the one MXNet asks)."""
        return capability.lower() == "optimizer"

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Saves the optimizer state of every key; collective.

        Each owner writes its own part, in parallel; the file loads on any
        number of ranks. Needs a filesystem every rank can see.

        Args:
            fname: path of the manifest (parts go to ``fname + ".parts/"``).
            dump_optimizer: also store the optimizer's kind and
                hyperparameters, so :meth:`load_optimizer_states` can rebuild it.
        """
        call = Call("save_optimizer_states",
                    settings={"fname": str(fname), "dump_optimizer": bool(dump_optimizer)})
        if self._engine.optimizer is None:
            call.fail(errors.OptimizerError, None, "no optimizer is set (use set_optimizer)")
        self._protocol.collective(call, lambda: checkpoint.save(
            self._engine, str(fname), "optimizer_states", False, dump_optimizer, self._rows))

    def load_optimizer_states(self, fname):
        """Loads states saved by :meth:`save_optimizer_states`, on any number of ranks.

        Keys absent from the file start with fresh states. If no optimizer is
        set and the file holds one (``dump_optimizer=True``), it is used.
        """
        call = Call("load_optimizer_states", settings={"fname": str(fname)})
        self._protocol.collective(call, lambda: checkpoint.load(
            self._engine, str(fname), "optimizer_states", False, self._rows))

    def run(self, step_fn, steps, directory, every, *, keep=2, min_workers=1, setup=None,
            redundancy="checkpoint"):
        """Calls ``step_fn(kv, i)`` for each step ``i``, with checkpoints; a lost rank
        costs the steps since the latest one (or, with ``redundancy="memory"``,
        only the step it was lost in), not the job. Collective.

        Loads the newest complete checkpoint of ``directory`` (or saves one of
        step 0), then saves one every ``every`` steps, keeping ``keep``. On a
        fault-tolerant store, a rank lost in any call (background ones
        included) is, on every survivor alike: a new store over the survivors
        (this one's type and options), ``setup(kv)`` on it, the newest complete
        checkpoint loaded, and ``step_fn`` called again from the step after it
        with the new store, whose ``rank`` and ``num_workers`` are the
        survivors'. See docs/fault-tolerance.md.

        Args:
            step_fn: ``step_fn(kv, i)`` makes step ``i`` on the store it is given.
            steps: an int ``N`` (steps from the checkpoint's to ``N - 1``) or the
                step numbers; after a recovery those done are skipped.
            directory: where the checkpoints go (every rank sees it).
            every: save after every this many steps.
            keep: how many complete checkpoints to keep.
            min_workers: the fewest survivors to go on with.
            setup: called with each new store before its checkpoint is loaded
                (``set_updater`` of a Python updater, which no checkpoint holds).
            redundancy: ``"checkpoint"``: go on from the newest checkpoint;
                ``"memory"``: after each step every rank also passes a copy of
                what it owns to the next rank (:meth:`keep_copy`), and the
                survivors go on from the last step they all completed (a rank
                lost with the next rank: from the newest checkpoint).

        Returns:
            The store in use at the end: this one, or the survivors' after a loss.

        Raises:
            MPIKVError: on every survivor, when fewer than ``min_workers`` survive.
        """
        from .elastic import run
        return run(self, step_fn, steps, directory, every, keep, min_workers, setup, create,
                   redundancy)

    def abandon(self):
        """Lets a store that lost a rank go, on this rank alone (no collective call:
        none can be made on it any more).

        Its background checkpoint writes end and are never committed: a checkpoint
        is visible only once committed (:mod:`mpikv.saving`), so none is left
        half-written in its place. Its worker thread is left (a daemon: every call
        of the lost store fails at once).
        """
        for handle in self._saves:
            handle.abandon()
        self._saves.clear()

    @property
    def options(self):
        """The options :func:`create` resolved for this store (its keywords, ``comm``
        aside: keyword -> value), a copy: ``create(kv.type, comm=c, **kv.options)``
        makes a store like this one."""
        return dataclasses.asdict(self._options)

    @property
    def fault_tolerant(self):
        """Whether a lost rank is a :class:`mpikv.RankLostError` on every survivor
        (``create(fault_tolerant=True)`` under a ULFM launch)."""
        return bool(getattr(self._transport, "fault_tolerant", False))

    def keep_copy(self, step, extra=None):
        """Copies what this rank owns after ``step`` steps and passes the copy to the
        next rank, which keeps it (``redundancy="memory"``); collective.

        The two newest copies of this rank's part and of the previous rank's are
        kept. After a loss, :meth:`restore_copies` on the survivors' store writes
        them as a checkpoint of the last step every survivor completed.

        Args:
            step: the steps done (the same on every rank).
            extra: anything picklable kept with the copy (the Trainer's file).
        """
        call = Call("keep_copy", settings={"step": step})
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            call.fail(errors.InputError, None, f"step must be an int >= 0, not {step!r}")

        def keep():
            if self._mirror is None:
                self._mirror = mirror.Mirror(self._engine, self._rows)
            self._mirror.step(step, extra, (call.op, []))
        # Not in the background: a rank that died before its copy left would take
        # that step with it (tried: a loss in the next step went back one further).
        self._protocol.collective(call, keep)

    def restore_copies(self, lost_store, lost, path_of, write_extra=None, older=None):
        """Writes the copies ``lost_store`` kept (:meth:`keep_copy`) as a checkpoint of
        the newest step held whole; collective over this store, the survivors'.

        Args:
            lost_store: the store that lost the ranks (abandoned).
            lost: the :class:`mpikv.RankLostError` every survivor got.
            path_of: ``step -> path`` of the checkpoint.
            write_extra: ``(path, extra)`` run on the survivor holding the lost
                store's rank 0's ``extra``, before the checkpoint is committed.
            older: ``(store, loss)``: an older store whose copies serve where
                ``lost_store``'s hold no step whole (it was made by a recovery
                that a second loss cut short), and everything it lost
                (:func:`mpikv.mirror.combine`), the same on every survivor.

        Returns:
            The step written (load it with :meth:`load_checkpoint`), or None
            where no step is held whole: no copy was taken yet, or a lost
            rank's buddy (the next rank) was lost too (a warning says so).
        """
        candidates = [(lost_store._mirror, lost)]
        if older is not None:
            candidates.append((older[0]._mirror, older[1]))
        result = []
        self._protocol.collective(Call("restore_copies"), lambda: result.append(
            mirror.restore(self._transport, candidates, path_of, write_extra)))
        return result[0]

    def save_checkpoint(self, fname):
        """Saves the stored values, the optimizer and its states in one file set; collective.

        Each owner writes the values and states it owns; the save is atomic
        (a job killed while saving leaves the previous save whole).
        """
        call = Call("save_checkpoint", settings={"fname": str(fname)})

        def save():
            self._finish_saves()
            checkpoint.save(self._engine, str(fname), "checkpoint", True, True, self._rows)
        self._protocol.collective(call, save)

    def save_checkpoint_async(self, fname, on_commit=None):
        """:meth:`save_checkpoint` written while training goes on; collective.

        Each rank copies what it owns now (the values, optimizer states and row
        tables: the call costs that copy) and writes the copy on a thread of
        its own. ``handle.wait()``, collective, commits the checkpoint once
        every rank's part is written; until then it is not visible, and a job
        that ends before leaves the previous checkpoints whole. A later
        :meth:`save_checkpoint`, :meth:`save_checkpoint_async`,
        :meth:`load_checkpoint` or :meth:`close` commits it first, and so does
        the end of the process when every rank ends it.

        Args:
            fname: the checkpoint's path.
            on_commit: called on rank 0 right after the checkpoint's manifest is
                in place (to put a file of the caller's beside it); an exception
                it raises is raised by ``wait()`` on every rank.

        Returns:
            A :class:`~mpikv.saving.SaveHandle`: ``done()`` says (locally)
            whether this rank's part is written, ``wait()`` commits.
        """
        call = Call("save_checkpoint_async", settings={"fname": str(fname)})

        def start():
            self._finish_saves()
            handle = SaveHandle(checkpoint.Snapshot(self._engine, str(fname), "checkpoint",
                                                    True, True, self._rows),
                                self._commit_save, on_commit)
            self._saves.append(handle)
            return handle
        return self._protocol.collective(call, start)

    def _commit_save(self, handle):
        """``handle.wait()``: the ranks agree, then the saves up to it commit."""
        call = Call("save_checkpoint_wait", settings={"fname": str(handle.fname)})
        self._protocol.collective(call, lambda: self._finish_saves(handle))

    def _finish_saves(self, upto=None):
        """Commits the background saves in the order they were made (up to and
        including ``upto``; every one if None); inside an agreed call."""
        while self._saves:
            handle = self._saves.pop(0)
            handle.finish()
            if handle is upto:
                return

    def load_checkpoint(self, fname):
        """Restores a :meth:`save_checkpoint` save, on any number of ranks; collective.

        Keys not yet initialised are created from the file; keys already in
        the store must match the file's shapes and dtypes. The optimizer is
        the one set on the store, else the file's.
        """
        call = Call("load_checkpoint", settings={"fname": str(fname)})

        def load():
            self._finish_saves()
            checkpoint.load(self._engine, str(fname), "checkpoint", True, self._rows)
        self._protocol.collective(call, load)

    def optimizer_state_nbytes(self):
        """Bytes of optimizer state this rank holds (only for what it owns)."""
        return self._engine.optimizer_state_nbytes()

    def gradient_buffers(self, keys):
        """Zero-copy gradients: arrays that are views into the store's buckets.

        Write gradients into these arrays, then push exactly them (a call
        naming the same keys, one array per key): nothing is copied into the
        store, the reduction runs on them in place, and ``pushpull(keys, bufs)``
        leaves the sum in them. On a distributed store the buckets live in
        node-local MPI shared memory (unless ``shared_memory`` is off), and a
        push with the default updater sums them straight from the other ranks'
        buffers. Collective (it allocates that memory); float16 keys have none
        (they are summed in float32).

        Args:
            keys: a key or a list of initialised keys.

        Returns:
            A list of arrays, one per key (an array for a single key).
        """
        single = not isinstance(keys, (list, tuple))
        key_list = [keys] if single else list(keys)
        call = self._read("gradient_buffers", key_list,
                          settings={"shared": self._options.shared_memory})
        if any(is_half((self._engine.lookup(i.key) or (None, np.float32))[1])
               for i in call.items):
            call.fail(errors.DTypeError, None, "float16 and bfloat16 keys are summed in "
                      "float32: they have no zero-copy buffers")
        views = self._protocol.collective(call, lambda: self._engine.gradient_buffers(
            call.keys, self._options.shared_memory))
        out = [views[k] for k in call.user_keys]
        return out[0] if single else out

    def value_buffers(self, keys):
        """Zero-copy values: arrays that are the stored values of the keys.

        A model can keep its parameters in them (``mpikv.torch.Trainer`` does):
        ``pull(keys, out=bufs)`` then copies nothing, and with an optimizer set,
        a push's updates land in the owner's buffers and the pull gathers the
        owners' parts in place. Collective (the values may move into arenas
        laid out like the key list's buckets, as for :meth:`gradient_buffers`).
        Write into them only through the store; they stop being the stored
        values if a later call moves the values (another key list's
        ``gradient_buffers`` or ``value_buffers``).

        Args:
            keys: a key or a list of initialised keys.

        Returns:
            A list of arrays, one per key (an array for a single key).
        """
        single = not isinstance(keys, (list, tuple))
        call = self._read("value_buffers", [keys] if single else list(keys))
        views = self._protocol.collective(call, lambda: self._engine.value_views(call.keys))
        out = [views[k] for k in call.user_keys]
        return out[0] if single else out

    def gather_gradients(self, keys):
        """Gives every rank the whole sums after a push of zero-copy buffers to the owners.

        With an updater or optimizer set, a push reduces each part of the
        :meth:`gradient_buffers` of ``keys`` only on that part's owner. This
        call copies every owner's sums into every rank's buffers (one
        ``Allgatherv`` per bucket), so each rank holds the summed gradients, as
        after an allreduce. Collective.

        Raises:
            ValueTypeError: the key list has no gradient buffers.
        """
        call = self._gather_call(keys)
        self._protocol.collective(call, lambda: self._engine.gather_grads(call.op, call.keys))

    def gather_gradients_async(self, keys):
        """:meth:`gather_gradients` in the background, after the calls made before
        it (the push it gathers); returns a :class:`Handle`. Errors are raised
        here, on every rank."""
        call = self._gather_call(keys)
        return self._protocol.submit(
            call, action=lambda: self._engine.gather_grads(call.op, call.keys))

    def _gather_call(self, keys):
        key_list = list(keys) if isinstance(keys, (list, tuple)) else [keys]
        call = self._read("gather_gradients", key_list)
        if not call.errors and self._engine.zero_copy_views(call.keys) is None:
            call.fail(errors.ValueTypeError, None, "gather_gradients needs keys whose "
                      "gradient_buffers were made (for this key list)")
        return call

    def _install_optimizer(self, optimizer):
        self._engine.set_optimizer(optimizer)

    # -- internals -------------------------------------------------------
    def _read(self, op, key, values=None, outs=None, **kw):
        return self._reader.read(op, key, values, outs, **kw)

    def _push_call(self, op, key, value, priority, out=None):
        settings = self._push_settings(priority)
        routes = self._protocol.routes
        call = (routes.zero_copy_call(op, key, value, settings)
                if out is None and type(priority) is int else None)
        remember = call is None and out is None
        if call is None:
            call = self._read(op, key, value, out, need_values=True,
                              need_outs=op == "pushpull" and out is not None,
                              outs_default_values=op == "pushpull", settings=settings)
        e = self._engine
        if e.optimizer is not None and not call.errors:
            bad = e.int_keys_in(call.keys)
            if bad:
                call.fail(errors.OptimizerError, bad[0], f"key {bad[0]!r} holds integers; "
                          f"optimizers update floating-point values only")
        if e.compression is not None and not call.errors:
            bad = next((i for i in call.items if i.dtype != np.float32), None)
            if bad is not None:
                from .compression import FLOAT32_ONLY
                call.fail(errors.DTypeError, bad.key, f"key {bad.key!r} holds {bad.dtype}: "
                          f"{FLOAT32_ONLY}")
        if remember:
            routes.remember_zero_copy(op, key, value, call)
        return call

    def _pull_call(self, key, out, priority):
        return self._read("pull", key, outs=out, need_outs=True,
                          settings={"priority": priority})

    def _push_settings(self, priority):
        e = self._engine
        settings = {"priority": priority, "updater": e.updater_kind}
        if e.optimizer is not None:
            # Ranks that changed hyperparameters differently would drift apart.
            settings["optimizer"] = e.optimizer.get_config()
        if e.compression is not None:
            settings["compression"] = e.compression.setting
        return settings

    def __repr__(self):
        return (f"<mpikv.KVStore type={self._type!r} rank={self.rank} "
                f"num_workers={self.num_workers} keys={len(self._engine.entries)}>")

    # -- operations for the layers above (the torch Trainer) ----------------------
    @dataclasses.dataclass(frozen=True)
    class OwnedPart:
        """One part of a key that this rank owns (see :meth:`KVStore.owned_states`).

        Attributes:
            start: its first element in the key's flat value.
            stop: one past its last element.
            whole: whether the part is the whole key (the key is not split).
            weight: the stored value of the part: the key's array if whole, else
                a flat view of elements ``start:stop``.
            state: its optimizer state (name -> array), or None before its first
                update.
        """

        start: int
        stop: int
        whole: bool
        weight: object
        state: object

    @dataclasses.dataclass(frozen=True)
    class OwnedKey:
        """What this rank holds of one key's optimizer side (:meth:`KVStore.owned_states`).

        Attributes:
            dtype: the key's stored dtype (the same on every rank).
            parts: the :class:`KVStore.OwnedPart` of each part this rank owns,
                in order; empty where it owns none.
        """

        dtype: object
        parts: tuple

    class CallHook:
        """The handle of :meth:`KVStore.add_call_hook`: ``remove()`` takes the hook off."""

        def __init__(self, protocol, fn):
            import weakref   # (the hook is held weakly here too: it keeps nothing alive)
            self._protocol, self._fn = protocol, weakref.WeakMethod(fn)

        def remove(self):
            """Stops calling the hook; removing it again does nothing."""
            self._protocol.remove_settler(self._fn())

    def add_call_hook(self, fn):
        """Runs ``fn()`` on this rank before each later call on the store; not collective.

        For a layer that makes store calls on a thread of its own (the torch
        Trainer's launcher): the hook waits for them, so that the store never
        takes calls from two threads at once. ``fn`` is held weakly, so it must
        be a bound method; it is dropped once its object is collected.

        Args:
            fn: a bound method taking no arguments.

        Returns:
            a handle whose ``remove()`` takes the hook off (torch's
            ``RemovableHandle`` shape).

        Raises:
            ValueTypeError: ``fn`` is not a bound method.
        """
        if getattr(fn, "__self__", None) is None or not hasattr(fn, "__func__"):
            raise errors.ValueTypeError(f"add_call_hook takes a bound method, not "
                                        f"{type(fn).__name__}")
        self._protocol.add_settler(fn)
        return KVStore.CallHook(self._protocol, fn)

    def agree(self, op):
        """A collective call that moves nothing, named ``op``: every rank must make it.

        The ranks agree on it as on any call: a rank making another call (or
        another ``op``) gets, as the others do, a :class:`~mpikv.errors.MismatchError`
        that says what each rank was doing (:meth:`set_context`); a failure set by
        :meth:`fail_next_call` is raised on every rank. A rank that has joined
        takes no part. Nothing happens on a closed store (closing is collective:
        the same on every rank).

        Args:
            op: the call's name, as the ranks' errors give it ("Trainer.close").
        """
        if not self._protocol.closed:
            self._agree_on(op)

    @property
    def threaded(self):
        """Whether the store takes calls from threads other than the caller's
        (MPI's ``THREAD_MULTIPLE``); False for a local store."""
        return bool(self._transport.threaded)

    def owned_states(self, keys):
        """What this rank owns of ``keys``: each owned part's stored value and
        optimizer state; not collective.

        The arrays are the store's own (no copies): read them between calls, and
        change them only through :meth:`load_owned_states`.

        Args:
            keys: stored keys.

        Returns:
            dict: key -> :class:`KVStore.OwnedKey`.

        Raises:
            UnknownKeyError: for a key the store does not hold.
        """
        engine, rank = self._engine, self.rank
        owned = {}
        for key in keys:
            entry = engine.entries.get(key)
            if entry is None:
                raise errors.UnknownKeyError(f"owned_states: key {key!r} is not in the store")
            placement = engine.plan[key]
            whole = not placement.split
            owned[key] = KVStore.OwnedKey(entry.array.dtype, tuple(
                KVStore.OwnedPart(s.start, s.stop, whole,
                                  entry.array if whole else entry.flat[s.start:s.stop],
                                  engine.states.get((key, s.start)))
                for s in placement.shards if s.owner == rank))
        return owned

    def load_owned_states(self, states):
        """Replaces the optimizer states of parts this rank owns; collective.

        Every rank calls it, each with the states of its own parts (the others'
        states and every key's update count stay). The ranks agree first: a
        part this rank does not own, or a failure set by :meth:`fail_next_call`
        on any rank (a check of the caller's), raises the same
        :class:`~mpikv.errors.MPIKVError` on every rank, and nothing is loaded
        on any.

        Args:
            states: ``{(key, part start): state}``, each state as
                :meth:`owned_states` gives them (name -> array).

        Raises:
            InputError: on every rank, for a part some rank does not own.
        """
        call = Call("load_owned_states")
        engine, rank = self._engine, self.rank
        for key, start in states:
            placement = engine.plan[key] if key in engine.plan else None
            if placement is None or not any(s.start == start and s.owner == rank
                                            for s in placement.shards):
                call.fail(errors.InputError, None, f"rank {rank} does not own the part of "
                                                   f"key {key!r} that starts at {start}")
                break

        def load():
            engine.load_optimizer(engine.optimizer, {**engine.states, **states},
                                  dict(engine.counts))
        self._protocol.collective(call, load)


__all__ = ["create", "KVStore", "Handle", "ReplayedCall", "STORE_TYPES"]
