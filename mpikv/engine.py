"""The store's core: where values live and how a checked call moves them.

:class:`Engine` runs calls that every rank has already agreed on (see
:mod:`mpikv.agreement`), so nothing here can fail on one rank only. Values
created by one ``init`` live in contiguous arenas laid out like the buckets
of :mod:`mpikv.fusion`, so a push or pull of the same keys moves each bucket
with one collective, and copies in and out of the store are single memcpys.
"""

from types import MappingProxyType

import numpy as np

from . import backends, reducers, tuning
from ._arrays import accumulate_dtype, wire_view
from .dtypes import is_floating
from .errors import DTypeError
from .fusion import DEFAULT_BUCKET_BYTES, plan_buckets, sizes
from .owners import Owners
from .plan import OwnershipPlan, sort_key


class Entry:
    """A stored value.

    Attributes:
        array: the value (a view into ``arena`` for fused keys).
        flat: a flat view of it.
        placement: its :class:`mpikv.plan.Placement`.
        arena / offset: the buffer it lives in and its element offset there.
        stale: whether this rank's copy is behind the owners' (after a push
            with an updater, or a checkpoint load), until the next pull.
    """

    __slots__ = ("array", "flat", "placement", "arena", "offset", "stale")

    def __init__(self, arena, offset, shape, placement):
        self.arena = arena
        self.offset = offset
        size = placement.size
        self.flat = arena[offset:offset + size]
        self.array = self.flat.reshape(shape)
        self.placement = placement
        self.stale = False


class _Layout:
    """A cached bucket plan for one key list, with the arenas it matches."""

    __slots__ = ("buckets", "stored", "grads", "views", "shared", "chosen")

    def __init__(self, buckets, stored):
        self.buckets = buckets
        self.chosen = {}       # (bucket index, in place, on a GPU) -> its reducer
        self.stored = stored   # per bucket: a view of the stored arena, or None
        self.grads = None      # per bucket: the zero-copy gradient arena, or None
        self.views = None      # key -> its view into ``grads``
        self.shared = None     # per bucket: its node-local SharedArena, or None


class Engine:
    """Values, ownership, updater and optimizer state of one store, and its data path.

    Args:
        transport: a :class:`mpikv.transport.base.Transport`.
        bigarray_bound: arrays with this many elements or more are split.
        bucket_bytes: the largest fused bucket, and the largest piece one
            collective moves.
        direct_bytes: keys of at least this many bytes are not fused: they
            move straight from the caller's array.
        table: the :class:`mpikv.tuning.Table` that picks each bucket's strategy.
        device_buckets: plan buckets as a device store (:func:`mpikv.fusion.sizes`),
            agreed by the ranks (default: ``device``).
    """

    def __init__(self, transport, bigarray_bound, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 device=False, direct_bytes=None, table=None, device_buckets=None):
        self.transport = transport
        self.direct_bytes = direct_bytes
        self.device_buckets = device if device_buckets is None else device_buckets
        self.chooser = reducers.Chooser(transport, table or tuning.forced("allreduce", "default"),
                                        bucket_bytes)
        self.device = device  # keep GPU values on the GPU (device, dist_sync_device)
        self.bucket_bytes = bucket_bytes
        # The state below is the engine's own: others read it through the
        # properties and lookups, and change it only through the methods.
        self._on_gpu = False   # whether any stored value lives on a GPU
        self._gpus = None     # cache of :attr:`gpus`
        self._int_keys = set()  # keys of integer dtype (no optimizer for them)
        self._in_place_ok = False
        self._plan = OwnershipPlan(transport.size, bigarray_bound)
        self._entries = {}
        self._entries_view = MappingProxyType(self._entries)  # never replaced, only changed
        self._key_type = None
        self._owners = Owners(transport)
        self._layouts = {}
        self._scratch = {}
        self.epoch = 0   # bumped whenever stored values move or the updater changes

    # -- state, read -----------------------------------------------------
    @property
    def entries(self):
        """key -> :class:`Entry`, read only (see :meth:`add_loaded_entries`)."""
        return self._entries_view

    @property
    def plan(self):
        """The :class:`mpikv.plan.OwnershipPlan` (see :meth:`replace_plan`)."""
        return self._plan

    @property
    def key_type(self):
        """The type of the store's keys (int or str), None while it has none."""
        return self._key_type

    @property
    def compression(self):
        """The :class:`mpikv.reducers.compressed.Compression` once set, else None."""
        return self.chooser.compression

    @property
    def on_gpu(self):
        """Whether any stored value lives on a GPU."""
        return self._on_gpu

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

    def lookup(self, key):
        """``(shape, dtype)`` of a stored key, or None if the store has no such key."""
        entry = self._entries.get(key)
        return None if entry is None else (entry.array.shape, entry.array.dtype)

    def int_keys_in(self, keys):
        """The keys of ``keys`` (in their order) that hold integers: no optimizer for them."""
        int_keys = self._int_keys
        return [k for k in keys if k in int_keys] if int_keys else []

    def optimizer_state_nbytes(self):
        """Bytes of optimizer state this rank holds (only for what it owns)."""
        return self._owners.state_nbytes()

    # -- state, changed --------------------------------------------------
    def set_updater(self, updater):
        """Runs ``updater(key, input, stored)`` on the owners from now on (None: assign);
        drops the optimizer and its states."""
        self.privatize()  # the updater may change stored values in place
        self._owners.set_updater(updater)
        self._rechoose()

    def set_optimizer(self, optimizer):
        """Runs ``optimizer`` on the owners from now on, with fresh states."""
        self.privatize()
        self._owners.set_optimizer(optimizer)
        self._rechoose()

    def set_compression(self, config, per_device):
        """Compresses every later push (see :mod:`mpikv.reducers.compressed`);
        residuals stay."""
        self.chooser.compress(config, per_device)
        self._rechoose()
        self.epoch += 1   # remembered one-key routes do not compress: they end here

    def _rechoose(self):
        """What picks a bucket's reducer changed (updater, compression): pick again."""
        for lay in self._layouts.values():
            lay.chosen.clear()

    def follow_optimizer(self, config):
        """Takes the other ranks' optimizer hyperparameters (a joined rank, which did not
        see their changes); its update counts and states stay."""
        self._owners.follow_optimizer(config)

    def zeros_of(self, key):
        """Zeros shaped like ``key``'s value, where it lives."""
        e = self._entries[key]
        return backends.zeros_on(e.arena, e.array.size, e.array.dtype).reshape(e.array.shape)

    def add_loaded_entries(self, entries):
        """Installs the keys a load created (key -> :class:`Entry`, placed by the plan
        that :meth:`replace_plan` installs next), as :meth:`init` would."""
        if not entries:
            return
        for key, entry in entries.items():
            self._entries[key] = entry
            self._on_gpu = self._on_gpu or not isinstance(entry.arena, np.ndarray)
        self._note_keys((key, entry.array.dtype) for key, entry in entries.items())
        self._moved()  # new arenas: cached views and the set of GPUs are recomputed

    def replace_plan(self, plan):
        """Installs a load's plan: the old one with the placements of the keys it created."""
        self._plan = plan

    def load_values(self, pieces):
        """Copies loaded values in, ``(key, start, stop, array)`` each, and marks every
        value stale until the next pull (other ranks loaded the other parts)."""
        for key, start, stop, array in pieces:
            backends.copyto(self._entries[key].flat[start:stop], array)
        stale = self.transport.size > 1
        for entry in self._entries.values():
            entry.stale = stale

    def load_optimizer(self, optimizer, states, counts):
        """Installs what a load read: ``optimizer`` if none is set, the states of the
        shards this rank owns and every key's push count."""
        if self._owners.optimizer is None and optimizer is not None:
            self.privatize()   # the optimizer changes stored values in place
        if self._owners.load(optimizer, states, counts):
            self._rechoose()

    def _note_keys(self, keys_and_dtypes):
        """Records new keys' integer dtypes and the store's key type."""
        for key, dtype in keys_and_dtypes:
            if not is_floating(dtype):
                self._int_keys.add(key)
            if self._key_type is None:
                self._key_type = type(key)

    # -- layout ----------------------------------------------------------

    def layout(self, keys):
        """The bucket plan of a key list (canonical order), cached."""
        sig = tuple(keys)
        found = self._layouts.get(sig)
        if found is None:
            items = [(k, self._entries[k].array.dtype, self._entries[k].placement) for k in keys]
            buckets = plan_buckets(items, self.transport.size, *self._sizes())
            found = self._layouts[sig] = _Layout(buckets, None)
        if found.stored is None:  # after stored values moved (see _moved)
            found.stored = [self._stored_view(b) for b in found.buckets]
        return found

    def _sizes(self):
        """``(bucket_bytes, direct_bytes)`` of this store's bucket plans."""
        return sizes(self.device_buckets, self.bucket_bytes, self.direct_bytes)

    def _moved(self):
        """Stored values changed arenas: cached stored views must be recomputed."""
        self.epoch += 1
        self._gpus = None
        for lay in self._layouts.values():
            lay.stored = None

    @property
    def gpus(self):
        """The ids of the GPUs holding stored values (cached until values move)."""
        if self._gpus is None:
            self._gpus = frozenset(e.arena.device.id for e in self._entries.values()
                                   if type(e.arena) is not np.ndarray)
        return self._gpus

    def _stored_view(self, bucket):
        """The stored values of a bucket as one view, if they lie in one arena in bucket order.

        A bucket that fills its arena is the arena itself (the same object), so
        identity tells an aliased zero-copy bucket at once.
        """
        first = self._entries[bucket.segments[0].key]
        if bucket.split:
            base = first.offset
        else:
            base = first.offset - bucket.segments[0].offset
            for seg in bucket.segments:
                e = self._entries[seg.key]
                if e.arena is not first.arena or e.offset != base + seg.offset:
                    return None
        if base == 0 and bucket.size == first.arena.size:
            return first.arena
        return first.arena[base:base + bucket.size]

    def scratch(self, dtype, size, like):
        """A reusable buffer of ``size`` elements where ``like`` lives: the host or
        ``like``'s GPU (grown, never shrunk)."""
        kind, device = backends.kind_of(like), backends.device_of(like)
        key = (np.dtype(dtype), kind, device)
        buf = self._scratch.get(key)
        if buf is None or buf.size < size:
            buf = self._scratch[key] = backends.empty(kind, size, dtype, device)
        return buf[:size]

    def reducer(self, layout, index, dst):
        """The reducer of bucket ``index`` of ``layout`` whose sum goes to ``dst``
        (chosen once per layout: see :class:`mpikv.reducers.Chooser`).

        Everything it depends on is the same on every rank: the table's column
        (see :func:`_agreed_in_place`: whether this rank's own input happens to
        be the destination must not change which collectives it calls; the
        ``to_owners`` one where an updater or optimizer runs on the owners, whose
        pushes call ``reduce_to_owners``), where values live, the updater, and
        whether the key list's zero-copy buffers are a shared window.
        """
        device = type(dst) is not np.ndarray
        key = (index, device)
        found = layout.chosen.get(key)
        if found is None:
            window = (layout.shared[index] if layout.shared and self._owners.kind is None
                      else None)
            bucket = layout.buckets[index]
            found = layout.chosen[key] = self.chooser.get(
                bucket, bucket.size * dst.itemsize, _agreed_in_place(bucket), device, window,
                owners=self._owners.kind is not None)
        return found

    # -- init ------------------------------------------------------------
    def init(self, op, items):
        """Creates keys from rank 0's values: one arena and one ``Bcast`` per bucket."""
        t = self.transport
        placed = self._plan.add([(i.key, int(np.prod(i.shape, dtype=np.int64)),
                                 i.dtype.itemsize) for i in items])
        by_key = {i.key: i for i in items}
        buckets = plan_buckets([(i.key, i.dtype, placed[i.key]) for i in items],
                               t.size, *self._sizes())
        for bucket in buckets:
            # A key lives on the GPU of its first value, not on the current GPU
            # (model.to(f"cuda:{local_rank}") sets no current device); keys fused
            # with it share its arena, so its GPU.
            gpu = next((backends.device_of(by_key[k].values[0]) for k in bucket.keys
                        if backends.is_device(by_key[k].values[0])), None) if self.device else None
            on_gpu = gpu is not None
            arena = backends.empty("cupy" if on_gpu else "numpy", bucket.size, bucket.dtype, gpu)
            self._on_gpu = self._on_gpu or on_gpu
            for key, offset in _key_offsets(bucket):
                item = by_key[key]
                entry = Entry(arena, offset, item.shape, placed[key])
                if t.rank == 0:
                    backends.copyto(entry.array, item.values[0])
                self._entries[key] = entry
            t.bcast_(wire_view(arena), 0, (op, bucket.keys))
        self._note_keys((i.key, i.dtype) for i in items)
        self._gpus = None

    # -- push ------------------------------------------------------------
    def push(self, op, items, order=None, zero_copy=False):
        """Sums the items' values over devices and ranks, then assigns or updates.

        Args:
            op: the operation's name, for messages.
            items: the call's checked :class:`mpikv.calls.Item` list.
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
        self._in_place_ok = not zero_copy and _distinct_memory(items)
        self._owners.count([i.key for i in items])
        pending = []
        summed_in_place = set()
        default = self._owners.kind is None
        for index, bucket in _ordered(layout.buckets, order):
            what = (op, bucket.keys)
            src, dst, in_caller = self._route(layout, index, bucket, by_key)
            reducer = self.reducer(layout, index, dst)
            if default:
                reducer.allreduce(dst, src, what)
                if self._keep_sum(layout, index, bucket, dst) and in_caller:
                    summed_in_place.add(bucket.keys[0])
            else:
                reducer.reduce_to_owners(dst, src, bucket, what)
                self._update_owned(bucket, dst, pending)
        split_keys = [b.segments[0].key for b in layout.buckets if b.split]
        if self._owners.needs_finish(split_keys):
            self._owners.finish(op, split_keys, pending)  # collective: owners or not
        return summed_in_place

    def _route(self, layout, index, bucket, by_key):
        """``(src, dst, in the caller's array)`` of one bucket of a push.

        ``dst`` gets the sum (``src=None``: it holds this rank's input). The
        zero-copy buffers are summed where they are; a ``device`` store that
        compresses sums each device's encoded values into a scratch buffer;
        otherwise see :meth:`_source` (default updater) and
        :meth:`_owner_source` (the owners update).
        """
        comp = self.chooser.compression
        per_device = comp is not None and comp.per_device
        if by_key is None or _gives_grads(layout, bucket, by_key):
            src, dst, in_caller = None, layout.grads[index], False
        elif per_device:
            src, dst, in_caller = None, self.scratch(
                np.float32, bucket.size, self._entries[bucket.keys[0]].arena), False
        elif self._owners.kind is None:
            src, dst, in_caller = self._source(layout, index, bucket, by_key)
        else:
            (src, dst), in_caller = self._owner_source(layout, index, bucket, by_key), False
        if per_device:
            comp.sum_devices(bucket, (lambda k: [layout.views[k]]) if by_key is None
                             else (lambda k: by_key[k].values), dst)
        return src, dst, in_caller

    def _keep_sum(self, layout, index, bucket, dst):
        """After a sum with the default updater: the bucket's stored values become it.

        Zero-copy buffers become the stored values (no copy); a sum elsewhere is
        copied in. Returns whether it was copied (the caller's array holding
        the sum then needs no copy out).
        """
        if layout.grads is not None and dst is layout.grads[index]:
            self._alias(layout, index, bucket)
            return False
        if dst is not layout.stored[index]:
            self._store(layout.stored[index], dst, bucket)
            return True
        for key in bucket.keys:
            self._entries[key].stale = False
        return False

    def _update_owned(self, bucket, dst, pending):
        """After a sum to the owners: this rank updates what it owns; every rank's
        copy of the bucket is stale until the next pull."""
        t = self.transport
        for seg in bucket.segments:
            if seg.owner == t.rank:
                e = self._entries[seg.key]
                grad = dst[seg.offset:seg.offset + seg.size]
                if bucket.split:   # a shard: flat views
                    stored, start = e.flat[seg.offset:seg.offset + seg.size], seg.offset
                else:
                    grad, stored, start = grad.reshape(e.array.shape), e.array, 0
                self._owners.update(seg.key, start, grad, stored, bucket.split, pending)
        for key in bucket.keys:
            self._entries[key].stale = t.size > 1

    def _single(self, bucket, by_key):
        """The caller's one array of a one-key bucket, flat, if MPI can read it as is."""
        if len(bucket.keys) != 1:
            return None
        item = by_key[bucket.keys[0]]
        if len(item.values) != 1:
            return None
        value = item.values[0]
        if (value.dtype != bucket.dtype or value.dtype != accumulate_dtype(value.dtype)
                or not value.flags.c_contiguous):
            return None
        return value.reshape(-1)

    def _source(self, layout, index, bucket, by_key):
        """``(src, dst, in the caller's array)`` of a push with the default updater
        (``src=None``: in place).

        A key alone in its bucket is summed straight from the caller's array:
        in place in it when it is also the output (``pushpull(key, value)``),
        else out of place into the stored value. Fused keys are copied into
        the stored value (or a scratch buffer) and summed there in place.
        """
        stored = layout.stored[index]
        if _gives_grads(layout, bucket, by_key):
            return None, layout.grads[index], False
        single = self._single(bucket, by_key)
        if single is not None:
            item = by_key[bucket.keys[0]]
            if (self._in_place_ok and len(item.outs) == 1 and item.outs[0] is item.values[0]
                    and getattr(single.flags, "writeable", True)):  # cupy has no such flag
                return None, single, True
            if (stored is not None and stored.dtype == single.dtype
                    and backends.same_place(stored, single) and not backends.may_overlap(stored, single)):
                return single, stored, False
            home = self.entries[bucket.keys[0]].arena
            if backends.same_place(single, home):
                return single, self.scratch(bucket.dtype, bucket.size, home), False
        if (stored is not None and stored.dtype == accumulate_dtype(bucket.dtype)
                and not _inputs_overlap(stored, bucket, by_key)):
            self._fill(stored, bucket, by_key)
            return None, stored, False
        buf = self._gather(layout, index, bucket, by_key)
        return None, buf, False

    def _owner_source(self, layout, index, bucket, by_key):
        """``(src, dst)`` of a push to the owners: ``dst`` gets the summed gradients."""
        if _gives_grads(layout, bucket, by_key):
            return None, layout.grads[index]
        single = self._single(bucket, by_key)
        home = self.entries[bucket.keys[0]].arena
        if single is not None and backends.same_place(single, home):
            return single, self.scratch(bucket.dtype, bucket.size, home)
        buf = self._gather(layout, index, bucket, by_key)
        return None, buf

    def _fill(self, buf, bucket, by_key):
        """Writes each key's sum over devices into its place in ``buf``."""
        if bucket.split:
            backends.sum_into(buf, by_key[bucket.segments[0].key].values)
            return
        items = [by_key[seg.key] for seg in bucket.segments]
        if (buf.dtype == bucket.dtype and all(len(i.values) == 1 for i in items)
                and backends.concatenate_into(buf, [i.values[0] for i in items])):
            return
        for seg, item in zip(bucket.segments, items):
            backends.sum_into(buf[seg.offset:seg.offset + seg.size], item.values)

    def _alias(self, layout, index, bucket):
        """After a zero-copy push with the default updater the buffers hold the sum:
        they become the stored values (no copy) until the updater changes."""
        grads = layout.grads[index]
        if layout.stored[index] is grads:
            return  # aliased already; nothing makes an aliased value stale
        for key, offset in _key_offsets(bucket):
            old = self._entries[key]
            e = Entry(grads, offset, old.array.shape, old.placement)
            e.array = layout.views[key]
            self._entries[key] = e
        self._moved()
        layout.stored = [self._stored_view(b) for b in layout.buckets]
        layout.stored[index] = grads

    def release(self):
        """Lets go of the values, states, layouts and scratch buffers (the store is
        closed; arrays handed out stay valid: they hold their own references)."""
        self._entries.clear()
        self._owners.clear()
        self._layouts.clear()
        self._scratch.clear()
        self.chooser.forget()
        self._moved()

    def privatize(self):
        """Gives stored values aliased to gradient buffers their own memory again
        (before an updater may change them in place)."""
        self.epoch += 1
        copies = {}
        for key, e in list(self._entries.items()):
            if any(lay.grads is not None and any(e.arena is g for g in lay.grads)
                   for lay in self._layouts.values()):
                arena = copies.get(id(e.arena))
                if arena is None:
                    with backends.on(e.arena):  # the copy stays on the values' GPU
                        arena = copies[id(e.arena)] = e.arena.copy()
                new = Entry(arena, e.offset, e.array.shape, e.placement)
                new.stale = e.stale
                self._entries[key] = new
        if copies:
            self._moved()

    def _gather(self, layout, index, bucket, by_key):
        """The bucket's input in one buffer: the zero-copy gradient arena, or a
        scratch buffer filled with each key's sum over devices."""
        if _gives_grads(layout, bucket, by_key):
            return layout.grads[index]
        home = self.entries[bucket.keys[0]].arena
        buf = self.scratch(accumulate_dtype(bucket.dtype), bucket.size, home)
        self._fill(buf, bucket, by_key)
        return buf

    def _store(self, stored, buf, bucket):
        """Copies a summed bucket into the stored values: one copy if they are one arena."""
        if stored is not None:
            if stored is not buf:
                backends.copyto(stored, buf, "unsafe")
        else:
            for seg in bucket.segments:
                e = self._entries[seg.key]
                backends.copyto(e.flat, buf[seg.offset:seg.offset + seg.size], "unsafe")
        for key in bucket.keys:
            self._entries[key].stale = False

    # -- pull ------------------------------------------------------------
    def pull(self, op, items, order=None, done=()):
        """Brings stale values back from their owners, then copies into the outputs.

        ``done``: keys whose outputs already hold the value (summed in place by
        :meth:`push`).
        """
        by_key = {i.key: i for i in items}
        layout = self.layout(list(by_key))
        for index, bucket in _ordered(layout.buckets, order):
            stale = [k for k in bucket.keys if self.entries[k].stale]
            if stale:
                what = (op, stale)
                if len(stale) == len(bucket.keys):
                    self._gather_bucket(layout.stored[index], bucket, what)
                else:
                    for key in stale:
                        self._pull_one(key, what)
                for key in stale:
                    self.entries[key].stale = False
            entries, copyto, ndarray = self.entries, np.copyto, np.ndarray
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
        if self._on_gpu:
            # The call returns with its device outputs written, for every stream:
            # a reader on another stream (torch's side streams) has nothing to wait
            # for. (Copies from a host store to a GPU wait in backends.copyto.)
            backends.synchronize_gpus([o for i in items for o in i.outs])

    def _gather_bucket(self, stored, bucket, what):
        """One Allgatherv of the owners' blocks: in place when the stored values are
        one arena, else through a scratch buffer (the same collective either way)."""
        t = self.transport
        if stored is not None:
            t.allgatherv_(wire_view(stored), bucket.counts, bucket.displs, what)
            return
        buf = self.scratch(bucket.dtype, bucket.size, self._entries[bucket.keys[0]].arena)
        for seg in bucket.segments:
            backends.copyto(buf[seg.offset:seg.offset + seg.size], self._entries[seg.key].flat)
        t.allgatherv_(wire_view(buf), bucket.counts, bucket.displs, what)
        for seg in bucket.segments:
            backends.copyto(self._entries[seg.key].flat, buf[seg.offset:seg.offset + seg.size])

    def _pull_one(self, key, what):
        t = self.transport
        e = self._entries[key]
        placement = e.placement
        if placement.split:
            counts, displs = placement.counts_and_displs(t.size)
            t.allgatherv_(wire_view(e.flat), counts, displs, what)
        else:
            t.bcast_(wire_view(e.flat), placement.owner, what)

    # -- zero copy -------------------------------------------------------
    def gradient_buffers(self, keys, shared=False):
        """Arrays, one per key, that are views into this key list's gradient buckets.

        Pushing exactly these arrays (one per key, in a call naming the same
        keys) skips copying them into the store: the reduction runs on them in
        place, and ``pushpull`` leaves the result in them. With the default
        updater the buffers then *are* the stored values of the keys (no copy),
        until an updater or optimizer is set; otherwise the stored values move
        into arenas laid out like the buckets, so storing a sum is one copy.

        Args:
            keys: initialised keys, in canonical order.
            shared: put the buckets in node-local shared memory (collective;
                see :mod:`mpikv.transport.shm`) where the transport can.

        Returns:
            dict: key -> array (the stored shape and dtype).
        """
        layout = self.layout(keys)
        for bucket in layout.buckets:
            if accumulate_dtype(bucket.dtype) != bucket.dtype:
                raise DTypeError(f"keys {bucket.keys} are {bucket.dtype}, which is summed in "
                                 f"{accumulate_dtype(bucket.dtype)}: no zero-copy buffers")
        if layout.grads is None:
            self._rehome(layout)
            # Allocating a window is collective: decide from what every rank shares
            # (the store type), not from where this rank's values happen to live.
            layout.shared = [self.transport.shared_arena(b.size, b.dtype)
                             if shared and not self.device else None for b in layout.buckets]
            layout.grads = [a.mine if a is not None else
                            backends.zeros_on(self._entries[b.keys[0]].arena, b.size, b.dtype)
                            for a, b in zip(layout.shared, layout.buckets)]
            layout.views = {}
            for arena, bucket in zip(layout.grads, layout.buckets):
                for key, offset in _key_offsets(bucket):
                    e = self._entries[key]
                    layout.views[key] = arena[offset:offset + e.flat.size].reshape(e.array.shape)
        return layout.views

    def value_views(self, keys):
        """key -> its stored value, laid out like the key list's buckets.

        Values that are not moved into arenas laid out like the buckets first,
        so a later pull of the same keys gathers the owners' parts in place,
        straight into these arrays. Valid while :attr:`epoch` stays.
        """
        layout = self.layout(keys)
        if any(s is None for s in layout.stored):
            self._rehome(layout)
        return {k: self._entries[k].array for k in keys}

    def gather_grads(self, op, keys):
        """After a push of the key list's zero-copy buffers to the owners, gives every
        rank every owner's sums: one in-place ``Allgatherv`` per bucket."""
        layout = self.layout(keys)
        for index, bucket in enumerate(layout.buckets):
            self.transport.allgatherv_(wire_view(layout.grads[index]), bucket.counts,
                                       bucket.displs, (op, bucket.keys))

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

    @property
    def owners(self):
        """The :class:`~mpikv.owners.Owners`: the updater or optimizer, and its states."""
        return self._owners

    def outdate(self, keys):
        """Marks this rank's copies of ``keys`` as behind their owners': the next pull
        gathers them (the same on every rank, as every rank calls it alike)."""
        if self.transport.size > 1:
            for key in keys:
                self._entries[key].stale = True

    def uses_shared_memory(self, keys):
        """Whether a key list's zero-copy buffers are in node shared memory."""
        layout = self._layouts.get(tuple(sorted(keys, key=sort_key)))
        return bool(layout is not None and layout.shared and any(
            a is not None for a in layout.shared))

    def zero_copy_views(self, keys):
        """key -> zero-copy buffer of a key list that has them, else None."""
        layout = self._layouts.get(tuple(keys))
        return None if layout is None else layout.views

    def _rehome(self, layout):
        """Moves stored values into arenas laid out like ``layout``'s buckets."""
        for index, bucket in enumerate(layout.buckets):
            if layout.stored[index] is not None:
                continue
            home = self._entries[bucket.keys[0]].arena
            arena = backends.zeros_on(home, bucket.size, bucket.dtype)
            for key, offset in _key_offsets(bucket):
                old = self._entries[key]
                new = Entry(arena, offset, old.array.shape, old.placement)
                backends.copyto(new.array, old.array)
                new.stale = old.stale
                self._entries[key] = new
        self._moved()
        layout.stored = [self._stored_view(b) for b in layout.buckets]


def _gives_grads(layout, bucket, by_key):
    """Whether the call hands over exactly the bucket's zero-copy gradient buffers
    (the arrays themselves, or views of them such as the torch tensors over them)."""
    return layout.grads is not None and all(
        len(by_key[key].values) == 1 and backends.same_memory(by_key[key].values[0], layout.views[key])
        for key, _ in _key_offsets(bucket))




def _inputs_overlap(target, bucket, by_key):
    """Whether any input of the bucket's keys may share memory with ``target``
    (an array that owns its memory cannot: only views are checked)."""
    return any(v.base is not None and backends.may_overlap(target, v)
               for k in bucket.keys for v in by_key[k].values)


def _agreed_in_place(bucket):
    """The table column of a bucket, from what every rank knows alike.

    A bucket of one key is summed from the caller's array where it can be (out
    of place); fused keys are packed first (in place). A rank whose own input
    takes the other route (an in-place ``pushpull``, a non-contiguous array)
    runs the same strategy on its buffers, so the ranks' collectives match.
    """
    return len(bucket.keys) > 1






def _distinct_memory(items):
    """Whether no two input arrays of a call are (views of) the same array."""
    bases = [id(v if v.base is None else v.base) for i in items for v in i.values]
    return len(set(bases)) == len(bases)










def _ordered(buckets, order):
    """``(index, bucket)`` pairs, highest priority first (stable), or in plan order."""
    pairs = list(enumerate(buckets))
    if order:
        pairs.sort(key=lambda p: -max(order.get(k, 0) for k in p[1].keys))
    return pairs


def _key_offsets(bucket):
    """``(key, offset)`` of each key in a bucket (a split key starts at 0)."""
    if bucket.split:
        return [(bucket.segments[0].key, 0)]
    return [(s.key, s.offset) for s in bucket.segments]
