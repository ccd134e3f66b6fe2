"""Zero-copy buffers: gradient arenas laid out like a key list's buckets, and
stored values laid out the same way, so a push or pull moves them in place."""

from ..arrays import backends
from ..arrays.values import accumulate_dtype, wire_view
from ..errors import DTypeError
from .plan import sort_key


class ZeroCopy:
    """A store's zero-copy gradient buffers and value views.

    Args:
        keys: the store's :class:`mpikv.core.keytable.KeyTable`.
        layouts: its :class:`mpikv.core.layouts.Layouts` (the buffers live on the layouts).
        transport: its transport (shared windows, the gather).
        device: whether it is a ``device`` store (no shared windows: values may
            live on GPUs).
    """

    def __init__(self, keys, layouts, transport, device):
        self.keys = keys
        self.layouts = layouts
        self.transport = transport
        self.device = device

    def gradient_buffers(self, keys, shared=False):
        """Arrays, one per key, that are views into this key list's gradient buckets.

        Pushing exactly these arrays (one per key, in a call naming the same
        keys) skips copying them into the store: the reduction runs on them in
        place, and ``pushpull`` leaves the result in them. With the default
        updater the buffers then *are* the stored values of the keys (no copy),
        until an updater or optimizer is set; otherwise the stored values move
        into arenas laid out like the buckets, so storing a sum is one copy.
        In node shared memory (``shared``), a push with the default updater sums
        them straight from the peers' buffers. float16 and bfloat16 keys (summed
        in float32) have none: a :class:`~mpikv.errors.DTypeError`.

        Args:
            keys: initialised keys, in canonical order.
            shared: put the buckets in node-local shared memory (collective;
                see :mod:`mpikv.transport.shm`) where the transport can.

        Returns:
            dict: key -> array (the stored shape and dtype).
        """
        layout = self.layouts.get(keys)
        for bucket in layout.buckets:
            if accumulate_dtype(bucket.dtype) != bucket.dtype:
                raise DTypeError(f"keys {bucket.keys} are {bucket.dtype}, which is summed in "
                                 f"{accumulate_dtype(bucket.dtype)}: no zero-copy buffers")
        if layout.grads is None:
            self.layouts.rehome(layout)
            # Allocating a window is collective: decide from what every rank shares
            # (the store type), not from where this rank's values happen to live.
            entries = self.keys.entries
            layout.shared = [self.transport.shared_arena(b.size, b.dtype)
                             if shared and not self.device else None for b in layout.buckets]
            layout.grads = [a.mine if a is not None else
                            backends.zeros_on(entries[b.keys[0]].arena, b.size, b.dtype)
                            for a, b in zip(layout.shared, layout.buckets)]
            layout.views = {}
            for arena, bucket in zip(layout.grads, layout.buckets):
                for key, offset in bucket.key_offsets():
                    e = entries[key]
                    layout.views[key] = arena[offset:offset + e.flat.size].reshape(e.array.shape)
        return layout.views

    def value_views(self, keys):
        """key -> its stored value, laid out like the key list's buckets.

        Values that are not moved into arenas laid out like the buckets first,
        so a later pull of the same keys gathers the owners' parts in place,
        straight into these arrays. Valid while :attr:`mpikv.core.layouts.Layouts.epoch` stays:
        a later call that moves the values (another key list's gradient or value
        buffers) ends them. An optimizer's updates land in the owners' views.
        """
        layout = self.layouts.get(keys)
        if any(s is None for s in layout.stored):
            self.layouts.rehome(layout)
        entries = self.keys.entries
        return {k: entries[k].array for k in keys}

    def gather_grads(self, op, keys, compression=None):
        """Gives every rank every owner's sums in the key list's zero-copy buffers:
        one in-place ``Allgatherv`` per bucket; in 16 bits with a 16-bit
        ``compression`` (:meth:`mpikv.reducers.compressed.Compression.gather`)."""
        layout = self.layouts.get(keys)
        for index, bucket in enumerate(layout.buckets):
            what = (op, bucket.keys)
            if compression is not None and compression.gather(
                    self.transport, layout.grads[index], bucket, what):
                continue
            self.transport.allgatherv_(wire_view(layout.grads[index]), bucket.counts,
                                       bucket.displs, what)

    def uses_shared_memory(self, keys):
        """Whether a key list's zero-copy buffers are in node shared memory."""
        layout = self.layouts.find(sorted(keys, key=sort_key))
        return bool(layout is not None and layout.shared
                    and any(a is not None for a in layout.shared))

    def views(self, keys):
        """key -> zero-copy buffer of a key list (canonical order) that has them, else None."""
        layout = self.layouts.find(keys)
        return None if layout is None else layout.views
