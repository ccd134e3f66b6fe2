"""Where one bucket of a push is summed and where its sum goes; how a stale
bucket of a pull comes back from its owners.

:meth:`BucketRoute.route` picks a push's buffers: the zero-copy gradient
arena, the caller's own array, the stored arena or a scratch buffer. After
the reducer ran, :meth:`BucketRoute.finish_default` keeps the sum as the
stored values (default updater) and :meth:`BucketRoute.finish_owners` hands
the owned parts to :class:`mpikv.core.owners.Owners`.
"""

import numpy as np

from ..arrays import backends
from ..arrays.values import accumulate_dtype, wire_view


class BucketRoute:
    """The buffers of each bucket of a push or pull.

    Args:
        keys: the store's :class:`mpikv.core.keytable.KeyTable`.
        layouts: its :class:`mpikv.core.layouts.Layouts` (scratch buffers, aliasing).
        owners: its :class:`mpikv.core.owners.Owners`.
        chooser: its :class:`mpikv.reducers.Chooser` (compression).
        transport: its transport (rank, and the pull's collectives).
    """

    def __init__(self, keys, layouts, owners, chooser, transport):
        self.keys = keys
        self.layouts = layouts
        self.owners = owners
        self.chooser = chooser
        self.transport = transport

    # -- push ------------------------------------------------------------
    def route(self, layout, index, bucket, by_key, in_place_ok=False):
        """``(src, dst, in the caller's array)`` of one bucket of a push.

        ``dst`` gets the sum (``src=None``: it holds this rank's input). The
        zero-copy buffers are summed where they are; a ``device`` store that
        compresses sums each device's encoded values into a scratch buffer;
        otherwise see :meth:`_source` (default updater) and
        :meth:`_owner_source` (the owners update).

        Args:
            layout / index / bucket: the :class:`mpikv.core.layouts.Layout`, and the
                bucket's index in it and the bucket.
            by_key: key -> the call's :class:`mpikv.calls.reader.Item`; None for a
                remembered push of exactly the zero-copy buffers.
            in_place_ok: whether a caller's array may be summed in place (no
                other key of the call reads its memory: see :func:`distinct_memory`).
        """
        comp = self.chooser.compression
        per_device = comp is not None and comp.per_device
        if by_key is None or layout.gives_grads(bucket, by_key):
            src, dst, in_caller = None, layout.grads[index], False
        elif per_device:
            src, dst, in_caller = None, self.layouts.scratch(
                np.float32, bucket.size, self._home(bucket)), False
        elif self.owners.kind is None:
            src, dst, in_caller = self._source(layout, index, bucket, by_key, in_place_ok)
        else:
            (src, dst), in_caller = self._owner_source(layout, index, bucket, by_key), False
        if per_device:
            comp.sum_devices(bucket, (lambda k: [layout.views[k]]) if by_key is None
                             else (lambda k: by_key[k].values), dst)
        return src, dst, in_caller

    def finish_default(self, layout, index, bucket, dst):
        """After a sum with the default updater: the bucket's stored values become it.

        Zero-copy buffers become the stored values (no copy); a sum elsewhere is
        copied in. Returns whether it was copied (the caller's array holding
        the sum then needs no copy out).
        """
        if layout.grads is not None and dst is layout.grads[index]:
            self.layouts.alias(layout, index, bucket)
            return False
        if dst is not layout.stored[index]:
            self._store(layout.stored[index], dst, bucket)
            return True
        self.keys.set_stale(bucket.keys, False)
        return False

    def finish_owners(self, bucket, dst, pending):
        """After a sum to the owners: this rank updates what it owns; every rank's
        copy of the bucket is stale until the next pull."""
        t, entries = self.transport, self.keys.entries
        for seg in bucket.segments:
            if seg.owner == t.rank:
                e = entries[seg.key]
                grad = dst[seg.offset:seg.offset + seg.size]
                if bucket.split:   # a shard: flat views
                    stored, start = e.flat[seg.offset:seg.offset + seg.size], seg.offset
                else:
                    grad, stored, start = grad.reshape(e.array.shape), e.array, 0
                self.owners.update(seg.key, start, grad, stored, bucket.split, pending)
        self.keys.set_stale(bucket.keys, t.size > 1)

    def _home(self, bucket):
        """The arena of the bucket's first key: where its scratch buffers live."""
        return self.keys.entries[bucket.keys[0]].arena

    def _source(self, layout, index, bucket, by_key, in_place_ok):
        """``(src, dst, in the caller's array)`` of a push with the default updater
        (``src=None``: in place).

        A key alone in its bucket is summed straight from the caller's array:
        in place in it when it is also the output (``pushpull(key, value)``),
        else out of place into the stored value. Fused keys are copied into
        the stored value (or a scratch buffer) and summed there in place.
        """
        stored = layout.stored[index]
        single = _single(bucket, by_key)
        if single is not None:
            item = by_key[bucket.keys[0]]
            if (in_place_ok and len(item.outs) == 1 and item.outs[0] is item.values[0]
                    and getattr(single.flags, "writeable", True)):  # cupy has no such flag
                return None, single, True
            if (stored is not None and stored.dtype == single.dtype
                    and backends.same_place(stored, single)
                    and not backends.may_overlap(stored, single)):
                return single, stored, False
            home = self._home(bucket)
            if backends.same_place(single, home):
                return single, self.layouts.scratch(bucket.dtype, bucket.size, home), False
        if (stored is not None and stored.dtype == accumulate_dtype(bucket.dtype)
                and not _inputs_overlap(stored, bucket, by_key)):
            _fill(stored, bucket, by_key)
            return None, stored, False
        return None, self._gather(bucket, by_key), False

    def _owner_source(self, layout, index, bucket, by_key):
        """``(src, dst)`` of a push to the owners: ``dst`` gets the summed gradients."""
        single = _single(bucket, by_key)
        home = self._home(bucket)
        if single is not None and backends.same_place(single, home):
            return single, self.layouts.scratch(bucket.dtype, bucket.size, home)
        return None, self._gather(bucket, by_key)

    def _gather(self, bucket, by_key):
        """The bucket's input in one scratch buffer: each key's sum over devices."""
        buf = self.layouts.scratch(accumulate_dtype(bucket.dtype), bucket.size,
                                   self._home(bucket))
        _fill(buf, bucket, by_key)
        return buf

    def _store(self, stored, buf, bucket):
        """Copies a summed bucket into the stored values: one copy if they are one arena."""
        if stored is not None:
            if stored is not buf:
                backends.copyto(stored, buf, "unsafe")
        else:
            entries = self.keys.entries
            for seg in bucket.segments:
                backends.copyto(entries[seg.key].flat, buf[seg.offset:seg.offset + seg.size],
                                "unsafe")
        self.keys.set_stale(bucket.keys, False)

    # -- pull ------------------------------------------------------------
    def pull_stale(self, stored, bucket, stale, what):
        """Brings this rank's stale copies of a bucket's keys back from their owners:
        the whole bucket at once where all are stale, else key by key."""
        if len(stale) == len(bucket.keys):
            self._gather_bucket(stored, bucket, what)
        else:
            for key in stale:
                self._pull_one(key, what)
        self.keys.set_stale(stale, False)

    def _gather_bucket(self, stored, bucket, what):
        """One Allgatherv of the owners' blocks: in place when the stored values are
        one arena, else through a scratch buffer (the same collective either way)."""
        t = self.transport
        if stored is not None:
            t.allgatherv_(wire_view(stored), bucket.counts, bucket.displs, what)
            return
        entries = self.keys.entries
        buf = self.layouts.scratch(bucket.dtype, bucket.size, self._home(bucket))
        for seg in bucket.segments:
            backends.copyto(buf[seg.offset:seg.offset + seg.size], entries[seg.key].flat)
        t.allgatherv_(wire_view(buf), bucket.counts, bucket.displs, what)
        for seg in bucket.segments:
            backends.copyto(entries[seg.key].flat, buf[seg.offset:seg.offset + seg.size])

    def _pull_one(self, key, what):
        t = self.transport
        e = self.keys.entries[key]
        if e.placement.split:
            counts, displs = e.placement.counts_and_displs(t.size)
            t.allgatherv_(wire_view(e.flat), counts, displs, what)
        else:
            t.bcast_(wire_view(e.flat), e.placement.owner, what)


def distinct_memory(items):
    """Whether no two input arrays of a call are (views of) the same array."""
    bases = [id(v if v.base is None else v.base) for i in items for v in i.values]
    return len(set(bases)) == len(bases)


def _single(bucket, by_key):
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


def _fill(buf, bucket, by_key):
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


def _inputs_overlap(target, bucket, by_key):
    """Whether any input of the bucket's keys may share memory with ``target``
    (an array that owns its memory cannot: only views are checked)."""
    return any(v.base is not None and backends.may_overlap(target, v)
               for k in bucket.keys for v in by_key[k].values)
