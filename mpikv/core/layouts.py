"""Bucket layouts of key lists, the arenas they match, and scratch buffers.

A :class:`Layout` is the cached bucket plan of one key list (see
:mod:`mpikv.core.fusion`) with views of the stored values laid out like its
buckets, its zero-copy gradient arenas, and each bucket's reducer.
:class:`Layouts` keeps them, moves stored values between arenas, and keeps
:attr:`Layouts.epoch`, which changes whenever a remembered route may be wrong.
"""

import numpy as np

from ..arrays import backends
from .fusion import plan_buckets, sizes


class Layout:
    """A cached bucket plan for one key list, with the arenas it matches.

    Attributes:
        buckets: the :class:`mpikv.core.fusion.Bucket` list.
        chosen: (bucket index, on a GPU) -> its reducer.
        stored: per bucket, a view of the stored arena (None where the stored
            values are not one arena in bucket order); None after values moved.
        grads: per bucket, the zero-copy gradient arena, or None.
        views: key -> its view into ``grads``.
        shared: per bucket, its node-local SharedArena, or None.
    """

    __slots__ = ("buckets", "stored", "grads", "views", "shared", "chosen")

    def __init__(self, buckets):
        self.buckets = buckets
        self.chosen = {}
        self.stored = None
        self.grads = None
        self.views = None
        self.shared = None

    def gives_grads(self, bucket, by_key):
        """Whether a call hands over exactly the bucket's zero-copy gradient buffers
        (the arrays themselves, or views of them such as the torch tensors over them)."""
        return self.grads is not None and all(
            len(by_key[key].values) == 1
            and backends.same_memory(by_key[key].values[0], self.views[key])
            for key, _ in bucket.key_offsets())

    def holds(self, arena):
        """Whether ``arena`` is one of this layout's gradient arenas."""
        return self.grads is not None and any(arena is g for g in self.grads)


class Layouts:
    """The layouts of a store's key lists, its scratch buffers and its epoch.

    Args:
        keys: the store's :class:`mpikv.core.keytable.KeyTable`.
        chooser: the :class:`mpikv.reducers.Chooser` that picks each bucket's reducer.
        owners: the :class:`mpikv.core.owners.Owners` (whether an updater runs).
        bucket_sizes: ``(device_buckets, bucket_bytes, direct_bytes)``, as
            :func:`mpikv.core.fusion.sizes` takes them.
    """

    def __init__(self, keys, chooser, owners, bucket_sizes):
        self.keys = keys
        self.chooser = chooser
        self.owners = owners
        self.sizes = sizes(*bucket_sizes)   # (bucket_bytes, direct_bytes) of the plans
        self._layouts = {}
        self._scratch = {}
        self.epoch = 0   # bumped whenever stored values move or the updater changes

    def get(self, keys):
        """The bucket plan of a key list (canonical order), cached, with its stored views."""
        sig = tuple(keys)
        found = self._layouts.get(sig)
        if found is None:
            entries = self.keys.entries
            items = [(k, entries[k].array.dtype, entries[k].placement) for k in keys]
            found = self._layouts[sig] = Layout(self.plan(items))
        if found.stored is None:  # after stored values moved (see moved)
            found.stored = [self.stored_view(b) for b in found.buckets]
        return found

    def find(self, keys):
        """The layout of a key list if it has one, else None (nothing is planned)."""
        return self._layouts.get(tuple(keys))

    def plan(self, items):
        """Buckets of ``(key, dtype, placement)`` items, with this store's sizes."""
        return plan_buckets(items, self.keys.num_ranks, *self.sizes)

    def stored_view(self, bucket):
        """The stored values of a bucket as one view, if they lie in one arena in bucket order.

        A bucket that fills its arena is the arena itself (the same object), so
        identity tells an aliased zero-copy bucket at once.
        """
        entries = self.keys.entries
        first = entries[bucket.segments[0].key]
        if bucket.split:
            base = first.offset
        else:
            base = first.offset - bucket.segments[0].offset
            for seg in bucket.segments:
                e = entries[seg.key]
                if e.arena is not first.arena or e.offset != base + seg.offset:
                    return None
        if base == 0 and bucket.size == first.arena.size:
            return first.arena
        return first.arena[base:base + bucket.size]

    def new_epoch(self):
        """Remembered routes are no longer valid (see :mod:`mpikv.store.routes`)."""
        self.epoch += 1

    def moved(self):
        """Stored values changed arenas: cached stored views must be recomputed."""
        self.epoch += 1
        for lay in self._layouts.values():
            lay.stored = None

    def scratch(self, dtype, size, like):
        """A reusable buffer of ``size`` elements where ``like`` lives: the host or
        ``like``'s GPU (grown, never shrunk)."""
        kind, device = backends.kind_of(like), backends.device_of(like)
        key = (np.dtype(dtype), kind, device)
        buf = self._scratch.get(key)
        if buf is None or buf.size < size:
            buf = self._scratch[key] = backends.empty(kind, size, dtype, device)
        return buf[:size]

    def scratch_buffers(self):
        """The scratch buffers made so far (where they live tells where sums ran)."""
        return list(self._scratch.values())

    def reducer(self, layout, index, dst):
        """The reducer of bucket ``index`` of ``layout`` whose sum goes to ``dst``
        (chosen once per layout: see :class:`mpikv.reducers.Chooser`).

        Everything it depends on is the same on every rank: the table's column
        (see :func:`agreed_in_place`: whether this rank's own input happens to
        be the destination must not change which collectives it calls; the
        ``to_owners`` one where an updater or optimizer runs on the owners, whose
        pushes call ``reduce_to_owners``), where values live, the updater, and
        whether the key list's zero-copy buffers are a shared window.
        """
        device = type(dst) is not np.ndarray
        key = (index, device)
        found = layout.chosen.get(key)
        if found is None:
            kind = self.owners.kind
            window = layout.shared[index] if layout.shared and kind is None else None
            bucket = layout.buckets[index]
            found = layout.chosen[key] = self.chooser.get(
                bucket, bucket.size * dst.itemsize, agreed_in_place(bucket), device, window,
                owners=kind is not None)
        return found

    def rechoose(self):
        """What picks a bucket's reducer changed (updater, compression): pick again."""
        for lay in self._layouts.values():
            lay.chosen.clear()

    # -- moving stored values --------------------------------------------
    def rehome(self, layout):
        """Moves stored values into arenas laid out like ``layout``'s buckets."""
        keys = self.keys
        for index, bucket in enumerate(layout.buckets):
            if layout.stored[index] is not None:
                continue
            arena = backends.zeros_on(keys.entries[bucket.keys[0]].arena, bucket.size,
                                      bucket.dtype)
            for key, offset in bucket.key_offsets():
                old = keys.entries[key]
                new = old.moved_to(arena, offset)
                backends.copyto(new.array, old.array)
                keys.put(key, new)
        self.moved()
        layout.stored = [self.stored_view(b) for b in layout.buckets]

    def alias(self, layout, index, bucket):
        """After a zero-copy push with the default updater the buffers hold the sum:
        they become the stored values (no copy) until the updater changes."""
        grads = layout.grads[index]
        if layout.stored[index] is grads:
            return  # aliased already; nothing makes an aliased value stale
        keys = self.keys
        for key, offset in bucket.key_offsets():
            new = keys.entries[key].moved_to(grads, offset, layout.views[key])
            new.stale = False   # the buffers hold the sum
            keys.put(key, new)
        self.moved()
        layout.stored = [self.stored_view(b) for b in layout.buckets]
        layout.stored[index] = grads

    def privatize(self):
        """Gives stored values aliased to gradient buffers their own memory again
        (before an updater may change them in place)."""
        self.epoch += 1
        keys, copies = self.keys, {}
        for key, e in list(keys.entries.items()):
            if any(lay.holds(e.arena) for lay in self._layouts.values()):
                arena = copies.get(id(e.arena))
                if arena is None:
                    with backends.on(e.arena):  # the copy stays on the values' GPU
                        arena = copies[id(e.arena)] = e.arena.copy()
                keys.put(key, e.moved_to(arena, e.offset))
        if copies:
            self.moved()

    def clear(self):
        """Drops every layout and scratch buffer (the store is closed)."""
        self._layouts.clear()
        self._scratch.clear()
        self.moved()


def agreed_in_place(bucket):
    """The table column of a bucket, from what every rank knows alike.

    A bucket of one key is summed from the caller's array where it can be (out
    of place); fused keys are packed first (in place). A rank whose own input
    takes the other route (an in-place ``pushpull``, a non-contiguous array)
    runs the same strategy on its buffers, so the ranks' collectives match.
    """
    return len(bucket.keys) > 1
