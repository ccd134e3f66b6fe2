"""The store: MXNet's KVStore API over a transport.

One class serves every store type. A ``local`` store is the one-rank case of
the same code, over a transport whose collectives do nothing; a ``dist_sync``
store runs over MPI. Every collective call first lets the ranks agree on what
it is (:mod:`mpikv.calls.agreement`), so a bad call raises the same error on every
rank and changes nothing.

The class is a face: each method checks its call (:mod:`mpikv.calls.reader`, or the
piece that owns the concern) and hands it to the protocol
(:mod:`mpikv.store.protocol`). Its pieces: :class:`~mpikv.core.engine.Engine` (where values
live), :class:`~mpikv.rows.tables.RowTables`, :class:`~mpikv.state.saves.Saves`
(checkpoints), :class:`~mpikv.elastic.mirror.Copies` (buddy copies),
:class:`~mpikv.store.join.Joiner`, :class:`~mpikv.store.buffer_calls.BufferCalls`
(zero-copy buffers). :func:`mpikv.store.factory.create` makes it.
"""


import contextlib
import dataclasses

import numpy as np

from ..calls import reader as calls
from .. import errors
from ..closing import ClosesAfterWith
from .buffer_calls import BufferCalls
from .executor import Handle
from .protocol import Protocol
from ..calls.reader import Call
from .reading import Reading
from ..core.engine import Engine
from .join import Joiner, ReplayedCall
from ..state.owned import OwnedStates
from ..elastic.mirror import Copies
from ..rows.tables import RowTables
from ..state.saves import Saves


class KVStore(ClosesAfterWith):
    """A key-value store for data-parallel training (use :func:`create`)."""

    def __init__(self, name, transport, options, table, device_buckets=None, *, remake=None,
                 on_release=None):
        self._type = name
        self._transport = transport
        self._options = options
        self._engine = Engine(transport, options.bigarray_bound, options.bucket_bytes,
                              device="device" in name, direct_bytes=options.direct_bytes,
                              table=table, device_buckets=device_buckets)
        self._protocol = Protocol(transport, self._engine)
        self._joiner = Joiner(self._protocol)
        self._reading = Reading(self._engine, self._protocol.routes)
        self._rows = RowTables(transport)
        self._saves = Saves(self._protocol, self._engine, self._rows)
        self._copies = Copies(self._protocol, self._engine, self._rows)
        self._buffers = BufferCalls(self._protocol, self._engine, self._reading.read,
                                    options.shared_memory)
        # (handed in by mpikv.store.factory, which imports this module)
        self._remake, self._on_release = remake, on_release

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

    def describe(self):
        """What the store runs on: its transport's facts (MPI library, CUDA paths, ...)."""
        return self._transport.describe()

    @property
    def tuning_table(self):
        """The :class:`mpikv.tuning.table.Table` that picks each bucket's reduction strategy."""
        return self._engine.chooser.table

    def outdate(self, keys):
        """Marks this rank's copies of ``keys`` as no longer the owners' values: the next
        ``pull`` of each gathers it from its owners. Local, but every rank must call it
        alike, with no pull of these keys in flight."""
        self._engine.outdate(list(keys))

    def uses_shared_memory(self, keys):
        """Whether the zero-copy buffers of this key list live in node shared memory."""
        return self._engine.uses_shared_memory(list(keys))

    @property
    def plan(self):
        """The :class:`mpikv.core.plan.OwnershipPlan`: who owns each key or shard."""
        return self._engine.plan

    @property
    def optimizer(self):
        """The :class:`mpikv.optimizer.Optimizer` run on the owners, or None: the live
        object (every rank must change its hyperparameters alike; checked at each push)."""
        return self._engine.optimizer

    @property
    def state_generation(self):
        """A number, the same on every rank, that changes whenever the owners'
        optimizer states are replaced rather than updated by a push (a new optimizer
        or updater, a load): a copy of the states is current while it stays."""
        return self._engine.state_generation

    @property
    def gradient_compression(self):
        """The parameters :meth:`set_gradient_compression` set (checked and
        completed: ``{'type': '2bit', 'threshold': 0.5}``), or None."""
        comp = self._engine.compression
        return None if comp is None else dict(comp.config)

    def gradient_residual(self, key, device=None):
        """This rank's compression residual of ``key`` (on a ``device`` store, of its
        ``device``-th value), a float32 copy shaped like the key; None before its first
        compressed push and for 16-bit compression without error feedback. See
        :meth:`mpikv.reducers.compressed.Compression.residual`.
        """
        return self._engine.gradient_residual(key, device)

    @contextlib.contextmanager
    def count_bytes(self):
        """Counts the bytes this store's collectives bring to this rank inside the block:
        yields a counter (``.bytes``, ``.calls``); background calls are waited for."""
        self._protocol.wait()
        with self._transport.count_bytes() as counter:
            try:
                yield counter
            finally:
                self._protocol.wait()

    def fail_next_call(self, exc_class, message):
        """Makes this rank's next collective call fail on every rank with
        ``exc_class(message)``, nothing applied (for adapters' own checks)."""
        if not (isinstance(exc_class, type) and issubclass(exc_class, errors.MPIKVError)):
            raise TypeError(f"exc_class must be an MPIKVError subclass, not {exc_class!r}")
        self._protocol.fail_next_call(exc_class, message)

    def refuse(self, exc_class, message, context=None):
        """A call that fails on every rank with ``exc_class(message)`` (this rank's
        refusal, in ``context``'s words with ``message`` as the hint): collective."""
        self.fail_next_call(exc_class, message)
        if context is not None:
            self.set_context(context, message)
        self.barrier()

    # -- collective operations ------------------------------------------
    def init(self, key, value):
        """Creates keys; their values are rank 0's.

        Args:
            key: a key (int or str) or a list of keys.
            value: an array per key (a list of arrays: the first is used).
        """
        call = self._reading.read("init", key, value, new_keys=True, need_values=True)
        self._rows.refuse_tables(call)
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
        if self._rows.is_rows_call(key, value):
            self._protocol.collective(*self._rows.push_call(key, value, self._engine, priority))
            return
        if not self._protocol.one_key("push", key, value, None, priority,
                                      lambda: self._reading.push("push", key, value, priority)):
            self._protocol.run(self._reading.push("push", key, value, priority), push=True,
                               remember=(key, None))

    def push_async(self, key, value, priority=0):
        """:meth:`push` in the background; returns a :class:`Handle`.

        Errors in the call are raised here, on every rank. Do not change
        ``value`` until :meth:`wait` returns for the handle.
        """
        return self._protocol.submit(self._reading.push("push", key, value, priority), push=True)

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
                                      lambda: self._reading.pull(key, out, priority)):
            self._protocol.run(self._reading.pull(key, out, priority), pull=True,
                               remember=(key, out))

    def pull_async(self, key, out=None, priority=0):
        """:meth:`pull` in the background; ``out`` is filled when :meth:`wait` returns."""
        return self._protocol.submit(self._reading.pull(key, out, priority), pull=True)

    def pushpull(self, key, value, out=None, priority=0):
        """:meth:`push` then :meth:`pull` in one collective call.

        With ``out=None`` the result is written into ``value``.
        """
        if not self._protocol.one_key(
                "pushpull", key, value, value if out is None else out, priority,
                lambda: self._reading.push("pushpull", key, value, priority, out)):
            self._protocol.run(self._reading.push("pushpull", key, value, priority, out),
                               push=True, pull=True, remember=(key, out))

    def pushpull_async(self, key, value, out=None, priority=0):
        """:meth:`pushpull` in the background; returns a :class:`Handle`."""
        return self._protocol.submit(self._reading.push("pushpull", key, value, priority, out),
                                     push=True, pull=True)

    # -- row tables ------------------------------------------------------
    def init_rows(self, key, shape, dtype=np.float32, init=None, row_sparse_weight=False):
        """Creates a row table: ``key``'s rows live on their owners only (rank ``r`` the
        ``r``-th block); collective. See :meth:`mpikv.rows.tables.RowTables.init_call`.
        """
        self._protocol.collective(*self._rows.init_call(key, shape, dtype, init,
                                                        row_sparse_weight, self._engine))

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Copies rows ``row_ids`` of ``key`` into ``out`` and returns them as a
        :class:`~mpikv.RowSparse`; collective, each rank with its own ids. See
        :meth:`mpikv.rows.tables.RowTables.pull_call`.
        """
        return self._protocol.collective(*self._rows.pull_call(key, out, row_ids, priority,
                                                               self._engine))

    def wait(self, handle=None):
        """Waits for a handle, a list of handles, or (``None``) every call made so far."""
        self._protocol.wait(handle)

    synchronize = wait

    def broadcast(self, key, value, out, priority=0):
        """:meth:`init` with rank 0's ``value``, then :meth:`pull` into ``out``."""
        call = self._reading.read("broadcast", key, value, out, new_keys=True, need_values=True,
                          need_outs=True, settings={"priority": priority})
        self._rows.refuse_tables(call)
        def run():
            self._engine.init(call.op, call.items)
            self._engine.pull(call.op, call.items)
        self._protocol.collective(call, run)

    def allreduce_(self, array, tag=None):
        """Sums ``array`` over the ranks, in place; collective (an agreed call with no
        key: the torch Trainer's per-step status). See :func:`mpikv.calls.reader.allreduce_call`.
        """
        call, native = calls.allreduce_call(array, tag)
        self._protocol.collective(call, lambda: self._transport.allreduce_(native, (call.op, [])))

    def barrier(self):
        """Waits until every rank has called ``barrier`` (``MPI_Barrier``)."""
        self._protocol.collective(Call("barrier"), lambda: self._transport.barrier(("barrier", [])))

    _barrier = barrier

    def close(self):
        """Ends the store on every rank (collective, as ``MPI_Comm_free``); arrays handed
        out stay valid, later calls raise. See :meth:`mpikv.store.protocol.Protocol.close`."""
        self._saves.close()
        self._protocol.close(self._release)

    def exit_process(self):
        """The end of this process (the exit hook of :mod:`mpikv.store.factory`): one agreed
        "exit" call unless closed; the background saves commit when every rank ends."""
        self._protocol.exit(self._saves.finish)

    def _release(self):
        if self._on_release is not None:
            self._on_release(self)
        self._engine.release()
        self._transport.close()

    def set_context(self, activity, hint=None, exit=None):
        """Says what this rank is doing, in its caller's terms, for the message of a
        call the ranks make differently; not collective. See
        :meth:`mpikv.store.protocol.Protocol.set_context`.
        """
        self._protocol.set_context(activity, hint, exit)

    def join(self, on_call=None, follow_optimizer=True):
        """Takes part in the other ranks' calls with zeros until every rank has joined
        (Horovod's ``join``, for uneven data); collective. See :meth:`mpikv.store.join.Joiner.join`.

        Returns:
            int: the rank that joined last.
        """
        return self._joiner.join(on_call, follow_optimizer)

    # -- local settings --------------------------------------------------
    def set_updater(self, updater):
        """Sets ``updater(key, input, stored)``, run on the owner of each key or shard, to
        update ``stored`` in place with the sum ``input`` (for a split array: per shard,
        flat 1-D views). Every rank must set one before the next push (checked there).
        ``None`` restores the default, which assigns the sum.
        """
        if updater is not None and not callable(updater):
            raise TypeError(f"updater must be callable, not {type(updater).__name__}")
        self._protocol.wait()
        self._engine.set_updater(updater)

    _set_updater = set_updater

    def set_optimizer(self, optimizer):
        """Runs ``optimizer`` (an :class:`mpikv.optimizer.Optimizer`) on the owners from now
        on; collective. Every rank must pass one of the same kind and hyperparameters
        (checked). Each rank keeps state only for the keys and shards it owns.
        """
        self._protocol.collective(calls.optimizer_call(optimizer),
                                  lambda: self._engine.set_optimizer(optimizer))

    def set_gradient_compression(self, compression_params):
        """Compresses the gradients of every later push and pushpull (MXNet's 2-bit, or
        16 bits); collective. See :func:`mpikv.calls.reader.compression_call`.
        """
        call, config = calls.compression_call(compression_params, self._type)
        self._protocol.collective(call, lambda: self._engine.set_compression(
            config, per_device=self._type == "device"))

    def is_capable(self, capability):
        """Whether the store supports ``capability`` ("optimizer" is the one MXNet asks)."""
        return capability.lower() == "optimizer"

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Saves the optimizer state of every key, each owner its part (``dump_optimizer``:
        the optimizer too); collective. See :meth:`mpikv.state.saves.Saves.save_states`.
        """
        self._saves.save_states(fname, dump_optimizer)

    def load_optimizer_states(self, fname):
        """Loads states saved by :meth:`save_optimizer_states`, on any number of ranks.

        Keys absent from the file start with fresh states. If no optimizer is
        set and the file holds one (``dump_optimizer=True``), it is used.
        """
        self._saves.load_states(fname)

    def run(self, step_fn, steps, directory, every, *, keep=2, min_workers=1, setup=None,
            redundancy="checkpoint"):
        """Calls ``step_fn(kv, i)`` for each step ``i``, checkpointing every ``every``
        steps; a lost rank costs the steps since the newest checkpoint, not the job.
        Collective; returns the store in use at the end. See :func:`mpikv.elastic.loop.run`."""
        from ..elastic.loop import run
        return run(self, step_fn, steps, directory, every, keep, min_workers, setup,
                   self._remake, redundancy)

    def abandon(self):
        """Lets a store that lost a rank go, on this rank alone: its background
        checkpoint writes end, never committed. See :meth:`mpikv.state.saves.Saves.abandon`."""
        self._saves.abandon()

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
        """Copies what this rank owns after ``step`` steps to the next rank
        (``redundancy="memory"``); collective. See :meth:`mpikv.elastic.mirror.Copies.keep`."""
        self._copies.keep(step, extra)

    @property
    def copies(self):
        """The :class:`mpikv.elastic.mirror.Copies` kept here: ``steps()``, ``own(step)``."""
        return self._copies

    def restore_copies(self, lost_store, lost, path_of, write_extra=None, older=None):
        """Writes the copies ``lost_store`` kept (:meth:`keep_copy`) as a checkpoint of the
        newest step held whole, and returns that step (or None); collective over this
        store, the survivors'. See :meth:`mpikv.elastic.mirror.Copies.restore`.
        """
        return self._copies.restore(lost_store.copies, lost, path_of, write_extra,
                                    None if older is None else (older[0].copies, older[1]))

    def save_checkpoint(self, fname):
        """Saves the stored values, the optimizer and its states in one file set; collective.

        Each owner writes the values and states it owns; the save is atomic
        (a job killed while saving leaves the previous save whole).
        """
        self._saves.save(fname)

    def save_checkpoint_async(self, fname, on_commit=None):
        """:meth:`save_checkpoint` written while training goes on; collective. Returns a
        :class:`~mpikv.state.saves.SaveHandle` (``wait()`` commits). See
        :meth:`mpikv.state.saves.Saves.save_async`.
        """
        return self._saves.save_async(fname, on_commit)

    def add_local_state(self, name, take, give):
        """Keeps a state of this rank's own in every checkpoint (each rank's in its
        part); not a call. See :meth:`mpikv.state.local.LocalStates.add`."""
        return self._saves.local.add(name, take, give)

    def load_checkpoint(self, fname, strict=False):
        """Restores a :meth:`save_checkpoint` save, on any number of ranks; collective.

        Keys already in the store must be in the file, with its shapes and dtypes.
        Keys not yet initialised are created from the file, or with ``strict`` refused
        (a :class:`mpikv.StateFileError` on every rank, nothing loaded), as are row
        tables. The optimizer is the one set on the store, else the file's.
        """
        self._saves.load(fname, strict)

    def optimizer_state_nbytes(self):
        """Bytes of optimizer state this rank holds (only for what it owns)."""
        return self._engine.optimizer_state_nbytes()

    def gradient_buffers(self, keys):
        """Zero-copy gradients: views into the store's buckets (one per key), to write
        gradients into and push; collective. See
        :meth:`mpikv.core.zero_copy.ZeroCopy.gradient_buffers`."""
        return self._buffers.gradient_buffers(keys)

    def value_buffers(self, keys):
        """Zero-copy values: the stored values themselves (one per key), written only
        through the store; collective. See :meth:`mpikv.core.zero_copy.ZeroCopy.value_views`."""
        return self._buffers.value_buffers(keys)

    def gather_gradients(self, keys):
        """Copies the owners' sums of a push of :meth:`gradient_buffers` into every
        rank's buffers (one ``Allgatherv`` per bucket; in 16 bits under fp16 or bf16
        compression); collective. See :mod:`mpikv.store.buffer_calls`."""
        self._buffers.gather(keys)

    def gather_gradients_async(self, keys):
        """:meth:`gather_gradients` in the background, after the calls made before it;
        returns a :class:`Handle` (errors are raised here, on every rank)."""
        return self._buffers.gather_async(keys)

    # -- internals -------------------------------------------------------
    def __repr__(self):
        return (f"<mpikv.KVStore type={self._type!r} rank={self.rank} "
                f"num_workers={self.num_workers} keys={len(self._engine.entries)}>")

    # -- operations for the layers above (the torch Trainer) ----------------------
    def add_call_hook(self, fn):
        """Runs the bound method ``fn()`` on this rank before each later call; not
        collective. Returns a handle whose ``remove()`` takes it off. See
        :meth:`mpikv.store.protocol.Protocol.add_call_hook`."""
        return self._protocol.add_call_hook(fn)

    def agree(self, op):
        """A collective call named ``op`` that moves nothing, agreed as any call is
        (docs/store.md); a joined rank takes no part; nothing on a closed store."""
        if not self._protocol.closed:
            self._protocol.collective(Call(op), lambda: None)

    @property
    def threaded(self):
        """Whether the store takes calls from threads other than the caller's
        (MPI's ``THREAD_MULTIPLE``); False for a local store."""
        return bool(self._transport.threaded)

    def owned_states(self, keys):
        """``{key: OwnedKey}``: each part of ``keys`` this rank owns, with its stored
        value and optimizer state (the store's own arrays: change them only through
        :meth:`load_owned_states`); not collective. See :class:`mpikv.state.owned.OwnedKey`;
        an :class:`~mpikv.errors.UnknownKeyError` for a key the store does not hold."""
        return OwnedStates(self._engine, self.rank).read(keys)

    def load_owned_states(self, states, settings=None):
        """Replaces the optimizer states ``{(key, part start): state}`` of parts this
        rank owns; collective and agreed (an error on one rank, or ``settings`` that
        differ, is raised on every rank, nothing loaded). See
        :meth:`mpikv.state.owned.OwnedStates.load_call`."""
        self._protocol.collective(*OwnedStates(self._engine, self.rank).load_call(
            states, settings))

__all__ = ["KVStore", "Handle", "ReplayedCall"]
