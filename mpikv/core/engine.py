"""The store's core: where values live and how a checked call moves them.

:class:`Engine` runs calls that every rank has already agreed on (see
:mod:`mpikv.calls.agreement`), so nothing here can fail on one rank only. Values
created by one ``init`` live in contiguous arenas laid out like the buckets
of :mod:`mpikv.core.fusion`, so a push or pull of the same keys moves each bucket
with one collective, and copies in and out of the store are single memcpys.

The Engine runs the three loops (``init``, ``push``, ``pull``) over its pieces:
:class:`~mpikv.core.keytable.KeyTable` (the keys and their values),
:class:`~mpikv.core.layouts.Layouts` (bucket plans, arenas, scratch, reducers),
:class:`~mpikv.core.bucket_route.BucketRoute` (each bucket's buffers),
:class:`~mpikv.core.zero_copy.ZeroCopy` and :class:`~mpikv.core.owners.Owners`.
"""

import numpy as np

from ..arrays import backends
from .. import reducers
from ..arrays.values import accumulate_dtype, wire_view
from .fusion import DEFAULT_BUCKET_BYTES
from .keytable import Entry, KeyTable
from .layouts import Layouts
from .owners import Owners
from .bucket_route import BucketRoute, distinct_memory
from .zero_copy import ZeroCopy

__all__ = ["Engine", "Entry"]


class Engine:
    """Values, ownership, updater and optimizer state of one store, and its data path.

    Args:
        transport: a :class:`mpikv.transport.base.Transport`.
        bigarray_bound: arrays with this many elements or more are split.
        bucket_bytes: the largest fused bucket, and the largest piece one
            collective moves.
        direct_bytes: keys of at least this many bytes are not fused: they
            move straight from the caller's array.
        table: the :class:`mpikv.tuning.table.Table` that picks each bucket's strategy (the
            store's: measured, cached or forced; see :func:`mpikv.store.factory.create`).
        device_buckets: plan buckets as a device store (:func:`mpikv.core.fusion.sizes`),
            agreed by the ranks (default: ``device``).
    """

    def __init__(self, transport, bigarray_bound, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 device=False, direct_bytes=None, *, table, device_buckets=None):
        self.transport = transport
        self.direct_bytes = direct_bytes
        self.device_buckets = device if device_buckets is None else device_buckets
        self.chooser = reducers.Chooser(transport, table, bucket_bytes)
        self.device = device  # keep GPU values on the GPU (device, dist_sync_device)
        self.bucket_bytes = bucket_bytes
        self._keys = KeyTable(transport.size, bigarray_bound)
        self._owners = Owners(transport)
        self._layouts = Layouts(self._keys, self.chooser, self._owners,
                                (self.device_buckets, bucket_bytes, direct_bytes))
        self._route = BucketRoute(self._keys, self._layouts, self._owners, self.chooser,
                                  transport)
        self._zero_copy = ZeroCopy(self._keys, self._layouts, transport, device)

    # -- state, read -----------------------------------------------------
    @property
    def entries(self):
        """key -> :class:`~mpikv.core.keytable.Entry`, read only (see :meth:`add_loaded_entries`)."""
        return self._keys.entries

    @property
    def plan(self):
        """The :class:`mpikv.core.plan.OwnershipPlan` (see :meth:`replace_plan`)."""
        return self._keys.plan

    @property
    def key_type(self):
        """The type of the store's keys (int or str), None while it has none."""
        return self._keys.key_type

    @property
    def compression(self):
        """The :class:`mpikv.reducers.compressed.Compression` once set, else None."""
        return self.chooser.compression

    def gradient_residual(self, key, device=None):
        """This rank's compression residual of ``key`` (its ``device``-th value's), a
        float32 copy shaped like the key, or None (see
        :meth:`mpikv.reducers.compressed.Compression.residual`)."""
        comp = self.compression
        found = None if comp is None else comp.residual(key, device)
        return None if found is None else found.reshape(self.entries[key].array.shape).copy()

    @property
    def on_gpu(self):
        """Whether any stored value lives on a GPU."""
        return self._keys.on_gpu

    @property
    def gpus(self):
        """The ids of the GPUs holding stored values (cached until values move)."""
        return self._keys.gpus

    @property
    def epoch(self):
        """Changes whenever stored values move or the updater or compression changes:
        remembered routes (:mod:`mpikv.store.routes`) are valid while it stays."""
        return self._layouts.epoch

    @property
    def optimizer(self):
        """The :class:`mpikv.optimizer.Optimizer` run on the owners, or None."""
        return self._owners.optimizer

    @property
    def updater_kind(self):
        """None (the sum is assigned), "function" (:meth:`set_updater`) or "optimizer"."""
        return self._owners.kind

    @property
    def states(self):
        """(key, shard start) -> optimizer state of the shards this rank owns, read only."""
        return self._owners.states

    @property
    def counts(self):
        """key -> pushes through the optimizer, the same on every rank, read only."""
        return self._owners.counts

    @property
    def state_generation(self):
        """Changes whenever the owners' states are replaced, not updated by a push."""
        return self._owners.generation

    @property
    def owners(self):
        """The :class:`~mpikv.core.owners.Owners`: the updater or optimizer, and its states."""
        return self._owners

    @property
    def layouts(self):
        """The :class:`~mpikv.core.layouts.Layouts`."""
        return self._layouts

    def lookup(self, key):
        """``(shape, dtype)`` of a stored key, or None if the store has no such key."""
        return self._keys.lookup(key)

    def int_keys_in(self, keys):
        """The keys of ``keys`` (in their order) that hold integers: no optimizer for them."""
        return self._keys.int_keys_in(keys)

    def optimizer_state_nbytes(self):
        """Bytes of optimizer state this rank holds (only for what it owns)."""
        return self._owners.state_nbytes()

    def zeros_of(self, key):
        """Zeros shaped like ``key``'s value, where it lives."""
        return self._keys.zeros_of(key)

    # -- state, changed --------------------------------------------------
    def set_updater(self, updater):
        """Runs ``updater(key, input, stored)`` on the owners from now on (None: assign);
        drops the optimizer and its states."""
        self.privatize()  # the updater may change stored values in place
        self._owners.set_updater(updater)
        self._layouts.rechoose()

    def set_optimizer(self, optimizer):
        """Runs ``optimizer`` on the owners from now on, with fresh states."""
        self.privatize()
        self._owners.set_optimizer(optimizer)
        self._layouts.rechoose()

    def set_compression(self, config, per_device):
        """Compresses every later push (see :mod:`mpikv.reducers.compressed`);
        residuals stay."""
        self.chooser.compress(config, per_device)
        self._layouts.rechoose()
        self._layouts.new_epoch()   # remembered one-key routes do not compress: they end here

    def follow_optimizer(self, config):
        """Takes the other ranks' optimizer hyperparameters (a joined rank, which did not
        see their changes); its update counts and states stay."""
        self._owners.follow_optimizer(config)

    def add_loaded_entries(self, entries):
        """Installs the keys a load created (key -> :class:`~mpikv.core.keytable.Entry`, placed
        by the plan that :meth:`replace_plan` installs next), as :meth:`init` would."""
        if entries:
            self._keys.add_loaded(entries)
            self._layouts.moved()  # new arenas: cached views are recomputed

    def replace_plan(self, plan):
        """Installs a load's plan: the old one with the placements of the keys it created."""
        self._keys.replace_plan(plan)

    def load_values(self, pieces):
        """Copies loaded values in, ``(key, start, stop, array)`` each, and marks every
        value stale until the next pull (other ranks loaded the other parts)."""
        self._keys.load_values(pieces)

    def load_optimizer(self, optimizer, states, counts):
        """Installs what a load read: ``optimizer`` if none is set, the states of the
        shards this rank owns and every key's push count."""
        if self._owners.optimizer is None and optimizer is not None:
            self.privatize()   # the optimizer changes stored values in place
        if self._owners.load(optimizer, states, counts):
            self._layouts.rechoose()

    def outdate(self, keys):
        """Marks this rank's copies of ``keys`` as behind their owners': the next pull
        gathers them (the same on every rank, as every rank calls it alike)."""
        if self.transport.size > 1:
            self._keys.set_stale(keys)

    # -- layouts ---------------------------------------------------------
    def layout(self, keys):
        """The :class:`~mpikv.core.layouts.Layout` of a key list (canonical order), cached."""
        return self._layouts.get(keys)

    def scratch(self, dtype, size, like):
        """A reusable buffer of ``size`` elements where ``like`` lives (see
        :meth:`mpikv.core.layouts.Layouts.scratch`)."""
        return self._layouts.scratch(dtype, size, like)

    def reducer(self, layout, index, dst):
        """The reducer of bucket ``index`` of ``layout`` whose sum goes to ``dst`` (see
        :meth:`mpikv.core.layouts.Layouts.reducer`)."""
        return self._layouts.reducer(layout, index, dst)

    def privatize(self):
        """Gives stored values aliased to gradient buffers their own memory again
        (before an updater may change them in place)."""
        self._layouts.privatize()

    def release(self):
        """Lets go of the values, states, layouts and scratch buffers (the store is
        closed; arrays handed out stay valid: they hold their own references)."""
        self._keys.clear()
        self._owners.clear()
        self._layouts.clear()
        self.chooser.forget()

    # -- init ------------------------------------------------------------
    def init(self, op, items):
        """Creates keys from rank 0's values: one arena and one ``Bcast`` per bucket."""
        t, keys = self.transport, self._keys
        placed = keys.place([(i.key, int(np.prod(i.shape, dtype=np.int64)), i.dtype.itemsize)
                             for i in items])
        by_key = {i.key: i for i in items}
        for bucket in self._layouts.plan([(i.key, i.dtype, placed[i.key]) for i in items]):
            # A key lives on the GPU of its first value, not on the current GPU
            # (model.to(f"cuda:{local_rank}") sets no current device); keys fused
            # with it share its arena, so its GPU.
            gpu = next((backends.device_of(by_key[k].values[0]) for k in bucket.keys
                        if backends.is_device(by_key[k].values[0])), None) if self.device else None
            arena = backends.empty("numpy" if gpu is None else "cupy", bucket.size,
                                   bucket.dtype, gpu)
            for key, offset in bucket.key_offsets():
                item = by_key[key]
                entry = Entry(arena, offset, item.shape, placed[key])
                if t.rank == 0:
                    backends.copyto(entry.array, item.values[0])
                keys.put(key, entry)
            t.bcast_(wire_view(arena), 0, (op, bucket.keys))
        keys.note_keys((i.key, i.dtype) for i in items)

    # -- push ------------------------------------------------------------
    def push(self, op, items, order=None, zero_copy=False):
        """Sums the items' values over devices and ranks, then assigns or updates.

        Args:
            op: the operation's name, for messages.
            items: the call's checked :class:`mpikv.calls.reader.Item` list.
            order: key -> priority; buckets with higher priorities move first.
            zero_copy: the items are known to be exactly the key list's zero-copy
                buffers (a remembered call), so they need no checking.

        Returns:
            set: keys whose value the push summed in the caller's own array
            (a one-key ``pushpull`` into its value), for :meth:`pull` to skip.
        """
        layout = self.layout([i.key for i in items])
        zero_copy = zero_copy and layout.grads is not None
        by_key = None if zero_copy else {i.key: i for i in items}
        # Summing a caller's array in place is only safe if no other key of the
        # call reads the same memory.
        in_place_ok = not zero_copy and distinct_memory(items)
        self._owners.count([i.key for i in items])
        pending = []
        summed_in_place = set()
        default = self._owners.kind is None
        route = self._route
        for index, bucket in _ordered(layout.buckets, order):
            what = (op, bucket.keys)
            src, dst, in_caller = route.route(layout, index, bucket, by_key, in_place_ok)
            reducer = self.reducer(layout, index, dst)
            if default:
                reducer.allreduce(dst, src, what)
                if route.finish_default(layout, index, bucket, dst) and in_caller:
                    summed_in_place.add(bucket.keys[0])
            else:
                reducer.reduce_to_owners(dst, src, bucket, what)
                route.finish_owners(bucket, dst, pending)
        split_keys = [b.segments[0].key for b in layout.buckets if b.split]
        if self._owners.needs_finish(split_keys):
            self._owners.finish(op, split_keys, pending)  # collective: owners or not
        return summed_in_place

    # -- pull ------------------------------------------------------------
    def pull(self, op, items, order=None, done=()):
        """Brings stale values back from their owners, then copies into the outputs.

        ``done``: keys whose outputs already hold the value (summed in place by
        :meth:`push`).
        """
        by_key = {i.key: i for i in items}
        layout = self.layout(list(by_key))
        entries = self.entries
        for index, bucket in _ordered(layout.buckets, order):
            stale = [k for k in bucket.keys if entries[k].stale]
            if stale:
                self._route.pull_stale(layout.stored[index], bucket, stale, (op, stale))
            copyto, ndarray = np.copyto, np.ndarray
            for key in bucket.keys:
                if key in done:
                    continue
                array = entries[key].array
                for out in by_key[key].outs:
                    if out is array:  # a zero-copy buffer that is the stored value
                        continue
                    if type(out) is ndarray and type(array) is ndarray:
                        copyto(out, array)
                    else:
                        backends.copyto(out, array)
        if self.on_gpu:
            # The call returns with its device outputs written, for every stream:
            # a reader on another stream (torch's side streams) has nothing to wait
            # for. (Copies from a host store to a GPU wait in backends.copyto.)
            backends.synchronize_gpus([o for i in items for o in i.outs])

    def one_key_route(self, key):
        """What a repeated one-key call with the default updater needs, or None.

        Returns ``(stored, reducer, keys)`` for a host float key summed in its
        own dtype; valid while :attr:`epoch` stays. A key list with zero-copy
        buffers has none: its pushes may go through shared memory.
        """
        if self.updater_kind is not None or self.on_gpu or self.compression is not None:
            return None
        layout = self.layout([key])
        stored = layout.stored[0]
        if (len(layout.buckets) != 1 or stored is None or type(stored) is not np.ndarray
                or accumulate_dtype(stored.dtype) != stored.dtype or layout.grads is not None):
            return None
        return stored, self.reducer(layout, 0, stored), [key]

    # -- zero copy -------------------------------------------------------
    def gradient_buffers(self, keys, shared=False):
        """key -> a view into the key list's gradient buckets: pushing exactly these
        skips copying them in (see :meth:`mpikv.core.zero_copy.ZeroCopy.gradient_buffers`)."""
        return self._zero_copy.gradient_buffers(keys, shared)

    def value_views(self, keys):
        """key -> its stored value, laid out like the key list's buckets (see
        :meth:`mpikv.core.zero_copy.ZeroCopy.value_views`)."""
        return self._zero_copy.value_views(keys)

    def gather_grads(self, op, keys):
        """After a push of the key list's zero-copy buffers to the owners, gives every
        rank every owner's sums: one in-place ``Allgatherv`` per bucket (in 16 bits
        with 16-bit compression)."""
        self._zero_copy.gather_grads(op, keys, self.compression)

    def uses_shared_memory(self, keys):
        """Whether a key list's zero-copy buffers are in node shared memory."""
        return self._zero_copy.uses_shared_memory(keys)

    def zero_copy_views(self, keys):
        """key -> zero-copy buffer of a key list that has them, else None."""
        return self._zero_copy.views(keys)


def _ordered(buckets, order):
    """``(index, bucket)`` pairs, highest priority first (stable), or in plan order."""
    pairs = list(enumerate(buckets))
    if order:
        pairs.sort(key=lambda p: -max(order.get(k, 0) for k in p[1].keys))
    return pairs
