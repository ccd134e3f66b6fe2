"""Compressed sums: each sender's float32 gradients travel encoded.

After ``kv.set_gradient_compression(params)`` the :class:`~mpikv.reducers.Chooser`
hands every bucket of a push a :class:`CompressedReducer` (the codecs are
:mod:`mpikv.arrays.compression`'s; :class:`Compression` holds the settings and the
residuals all buckets share). Who sends:

- a distributed store: each rank, its values summed over its devices exactly
  (MXNet's dist stores: devices are merged uncompressed, then each worker's
  sum is compressed, with one residual per key on that worker);
- a ``device`` store: each device value of the call (MXNet's
  ``CommDevice::ReduceCompressed``, one residual per key and device), which
  the engine sums with :meth:`Compression.sum_devices` in place of its
  plain fill; its one rank then has nothing to send.

What moves, per bucket of ``n`` float32 values on ``P`` ranks:

- 2-bit, every rank needs the sum (default updater): one ``Allgatherv`` of
  every rank's packed bucket (``n / 4`` bytes each); every rank decodes all
  of them and adds them in rank order, so the sums are equal everywhere.
- 2-bit, to the owners (updater, optimizer): one ``Alltoallv``: each owner
  gets every rank's packed codes of its block (MXNet's worker-to-server
  push); a later pull moves float32 values, uncompressed, as in MXNet.
- fp16 / bf16: one ``Alltoallv`` of 16-bit blocks (``2 n`` bytes per rank);
  each block's owner adds the ``P`` blocks in float32 in rank order and
  rounds the sum once (with error feedback, the owners keep it in float32:
  each sender's residual carries what its rounding lost to its next push);
  with the default updater an ``Allgatherv`` then moves the rounded sums,
  still as 16 bits (they are 16-bit values), over near-equal blocks.

``init`` and ``pull`` never come here.
"""

import numpy as np

from ..arrays import backends
from ..arrays.compression import Workspace, describe, make_codec
from .base import Blocks, Reducer, even_blocks


class Compression:
    """A store's compression settings and the residuals every bucket shares.

    Args:
        config: a :func:`mpikv.arrays.compression.parse_params` result.
        per_device: each device value is a sender (the ``device`` store), not
            each rank.
    """

    def __init__(self, config, per_device):
        self.per_device = per_device
        self.ws = Workspace()
        self._residuals = {}        # key -> this rank's residual (flat float32 view)
        self._home = {}             # key -> the bucket arena its residual lives in
        self._arenas = {}           # id(bucket) -> (bucket, arena)
        self._device_residuals = {}  # (key, device index) -> residual (device store)
        self._sum_residuals = {}    # bucket's keys -> what rounding this owner's sums lost
        self._sum_buckets = {}      # bucket's keys -> (bucket, first element of its block)
        self._sums_loaded = {}      # key -> {(start, stop): residual} loaded, for gather
        self.configure(config)

    def configure(self, config):
        """New settings; residuals stay (MXNet keeps its residual buffers too)."""
        self.config = config
        self.codec = make_codec(config)
        #: what every rank's pushes must agree on (hashable: see agreement.fingerprint)
        self.setting = describe(config)

    @property
    def name(self):
        """The strategy name: ``compressed:2bit``, ``compressed:fp16``, ``compressed:bf16``."""
        return f"compressed:{self.config['type']}"

    def residual(self, key, device=None):
        """This rank's compression residual of ``key``, shaped like the key.

        Args:
            key: an initialised key.
            device: on a ``device`` store, which of the key's device values
                (each has its own residual); None on a distributed store.

        Returns:
            A float32 copy, or None before the key's first compressed push (and
            for 16-bit compression without error feedback, which keeps none).

        Here: the flat residual itself (not a copy), or None.
        """
        if device is None:
            return self._residuals.get(key)
        return self._device_residuals.get((key, device))

    def bucket_residual(self, bucket):
        """This rank's residual of a bucket's keys, as one array laid out like the bucket.

        A key keeps one residual whichever key lists push it: it moves into the
        arena of the bucket that uses it (copied), as stored values move into
        the arenas of :meth:`mpikv.core.engine.Engine.gradient_buffers`.
        """
        found = self._arenas.get(id(bucket))
        if found is not None and all(self._home.get(k) is found[1] for k in bucket.keys):
            return found[1]
        arena = np.zeros(bucket.size, np.float32)
        for key, offset, size in _spans(bucket):
            view = arena[offset:offset + size]
            old = self._residuals.get(key)
            if old is not None:
                view[...] = old
            self._residuals[key] = view
            self._home[key] = arena
        self._arenas[id(bucket)] = (bucket, arena)
        if found is not None or len(self._arenas) > 1:
            # Drop arenas no key lives in any more.
            self._arenas = {i: (b, a) for i, (b, a) in self._arenas.items()
                            if any(self._home.get(k) is a for k in b.keys)}
        return arena

    def gather(self, transport, flat, bucket, what):
        """Every owner's block of the bucket's sums to every rank, in 16 bits.

        Each owner rounds its block once (with error feedback, keeping what the
        rounding lost for the next step's block), every rank gathers the 16-bit
        blocks and widens them into ``flat``, the owners' own blocks too: every
        rank then holds the same values, half the bytes of a float32 gather.

        Args:
            transport: the store's transport.
            flat: the bucket's flat float32 sums (this rank's block summed), on the
                host or a GPU (staged through the host).
            bucket: its :class:`mpikv.core.fusion.Bucket` (counts, displs, keys).
            what: ``(operation, keys)`` for the watchdog.

        Returns:
            bool: whether it gathered (False: not a 16-bit codec, or not float32;
            the caller gathers in float32).
        """
        codec, ws = self.codec, self.ws
        if not hasattr(codec, "kind") or flat.dtype != np.float32:
            return False
        if type(flat) is not np.ndarray:   # a GPU bucket: through host memory, as the push
            host = ws.get("gather16 staged", flat.size, np.float32)
            backends.copyto(host, flat)
            self.gather(transport, host, bucket, what)
            backends.copyto(flat, host)
            return True
        me = transport.rank
        at, count = bucket.displs[me], bucket.counts[me]
        wire = ws.get("gather16", flat.size, codec.wire_dtype)
        residual = None
        if codec.has_residual:
            tag = tuple(bucket.keys)
            residual = self._sum_residuals.get(tag)
            if residual is None or residual.size != count:
                residual = self._sum_residuals[tag] = self._loaded_sums(bucket, at, count)
                self._sum_buckets[tag] = (bucket, at)
        codec.encode(flat[at:at + count], residual, wire[at:at + count], ws)
        transport.allgatherv_(wire, bucket.counts, bucket.displs, what)
        codec.decode(wire, flat.size, ws, flat)
        return True

    def owed(self):
        """What this rank's roundings have not yet sent, for a checkpoint.

        Returns:
            ``(senders, sums)``: ``{key: flat float32 copy}`` of its residual of
            each key it pushed, and ``[(key, start, stop, float32 copy)]`` of
            what its 16-bit gathers' sums lost, in the key's elements. Empty on a
            ``device`` store (its residuals are per device, and not saved).
        """
        if self.per_device:
            return {}, []
        senders = {k: np.array(r, np.float32) for k, r in self._residuals.items()}
        sums = []
        for tag, residual in self._sum_residuals.items():
            bucket, at = self._sum_buckets[tag]
            for key, offset, size in _spans(bucket):
                lo, hi = max(at, offset), min(at + residual.size, offset + size)
                if lo < hi:
                    sums.append((key, lo - offset, hi - offset,
                                 residual[lo - at:hi - at].copy()))
        return senders, sums

    def restore(self, senders, sums):
        """Replaces this rank's residuals with what a checkpoint held (:meth:`owed`).

        Args:
            senders: ``{key: flat float32}``, this rank's residual of each key;
                keys not named start from zero.
            sums: ``[(key, start, stop, float32)]``: what its gathers' sums lost,
                taken by the next gather whose block holds those elements.
        """
        self._residuals = {k: np.array(v, np.float32).reshape(-1) for k, v in senders.items()}
        self._home, self._arenas = {}, {}
        self._sum_residuals, self._sum_buckets = {}, {}
        self._sums_loaded = {}
        for key, start, stop, values in sums:
            self._sums_loaded.setdefault(key, {})[(start, stop)] = values

    def _loaded_sums(self, bucket, at, count):
        """A new gather residual of the block at ``at``: zeros, but where a loaded
        checkpoint holds those elements' residual (taken once)."""
        residual = np.zeros(count, np.float32)
        if not self._sums_loaded:
            return residual
        for key, offset, size in _spans(bucket):
            for (start, stop), values in list(self._sums_loaded.get(key, {}).items()):
                lo, hi = max(at, offset + start), min(at + count, offset + stop)
                if lo < hi:
                    residual[lo - at:hi - at] = values[lo - offset - start:hi - offset - start]
                    if lo == offset + start and hi == offset + stop:
                        del self._sums_loaded[key][(start, stop)]
        return residual

    def sum_devices(self, bucket, values_of, dst):
        """The device store's fill: ``dst`` becomes the sum over each key's device
        values, each compressed with its own residual, in device order.

        Args:
            bucket: the :class:`mpikv.core.fusion.Bucket`.
            values_of: key -> its list of device values.
            dst: the bucket's flat float32 buffer (host or GPU).
        """
        codec, ws = self.codec, self.ws
        total = ws.get("total", bucket.size, np.float32)
        for key, offset, size in _spans(bucket):
            part = total[offset:offset + size]
            wire = ws.get("wire", codec.wire_size(size), codec.wire_dtype)
            for d, value in enumerate(values_of(key)):
                flat = self._host_flat(value, size)
                residual = self._device_residual(key, d, size) if codec.has_residual else None
                decoded = codec.decode(codec.encode(flat, residual, wire, ws), size, ws)
                if d == 0:
                    part[...] = decoded
                else:
                    np.add(part, decoded, out=part)
            codec.round(part, ws)
        backends.copyto(dst, total)

    def _host_flat(self, value, size):
        """A device value as flat float32 on the host (a view where it can be)."""
        if type(value) is np.ndarray:
            return np.ascontiguousarray(value).reshape(-1)
        host = self.ws.get("staged", size, np.float32)
        backends.copyto(host, value.reshape(-1))
        return host

    def _device_residual(self, key, device, size):
        found = self._device_residuals.get((key, device))
        if found is None:
            found = self._device_residuals[(key, device)] = np.zeros(size, np.float32)
        return found


class CompressedReducer(Reducer):
    """Sums one bucket over the ranks from every rank's encoded values.

    Host buffers only (the codecs work on numpy arrays, in torch where it is
    loaded): the chooser stages GPU buffers.
    Bound to its bucket, whose keys' residuals it updates.

    Args:
        compression: the store's :class:`Compression`.
        transport: the store's transport.
        bucket: the :class:`mpikv.core.fusion.Bucket` it sums.
    """

    host_only = True

    def __init__(self, compression, transport, bucket):
        super().__init__(transport, 0)
        self.compression = compression
        self.bucket = bucket
        self.name = compression.name

    def allreduce(self, dst, src, what):
        self._sum(dst, src, True, what)

    def reduce_to_owners(self, dst, src, blocks, what):
        self._sum(dst, src, False, what, blocks)

    def _sum(self, dst, src, everyone, what, blocks=None):
        """``dst`` (on the owners: their blocks) becomes the sum over ranks of the
        decoded values; ``src`` (None: ``dst``) is this rank's input."""
        t, comp = self.transport, self.compression
        codec, ws = comp.codec, comp.ws
        n, p, me = dst.size, t.size, t.rank
        x = dst if src is None else src
        residual = comp.bucket_residual(self.bucket) if codec.has_residual else None
        if everyone and codec.gathers_codes:
            # 2-bit to everyone: a rank's whole bucket is n / 4 bytes, so every rank
            # takes every rank's codes (less than the owners' route's float32 gather).
            w = codec.wire_size(n)
            wire = ws.get("gather", p * w, codec.wire_dtype)
            codec.encode(x, residual, wire[me * w:(me + 1) * w], ws)
            t.allgatherv_(wire, (w,) * p, tuple(s * w for s in range(p)), what)
            self._add_in_rank_order(dst, [wire[s * w:(s + 1) * w] for s in range(p)], n)
            return
        if everyone:
            blocks = even_blocks(n, p)
        else:
            blocks = Blocks(tuple(blocks.counts), tuple(blocks.displs))
        sizes = [codec.wire_size(c) for c in blocks.counts]
        starts = [sum(sizes[:r]) for r in range(p)]
        send = ws.get("send", sum(sizes), codec.wire_dtype)
        for r in range(p):
            a, c = blocks.displs[r], blocks.counts[r]
            codec.encode(x[a:a + c], None if residual is None else residual[a:a + c],
                         send[starts[r]:starts[r] + sizes[r]], ws)
        count, at = blocks.counts[me], blocks.displs[me]
        w = codec.wire_size(count)
        recv = ws.get("recv", p * w, codec.wire_dtype)
        t.alltoallv(send, sizes, starts, recv, [w] * p, [s * w for s in range(p)], what)
        mine = dst[at:at + count]
        self._add_in_rank_order(mine, [recv[s * w:(s + 1) * w] for s in range(p)], count)
        if not everyone:
            codec.round(mine, ws)
            return
        # 16-bit to everyone: the sums rounded once are 16-bit values, so they travel
        # back as 16 bits, exactly, and every rank (this one too) decodes them.
        out = ws.get("gathered", n, codec.wire_dtype)
        codec.encode(mine, None, out[at:at + count], ws)
        t.allgatherv_(out, blocks.counts, blocks.displs, what)
        codec.decode(out, n, ws, dst)

    def _add_in_rank_order(self, total, wires, n):
        """``total`` becomes the float32 sum of the decoded ``wires``, first to last."""
        codec, ws = self.compression.codec, self.compression.ws
        if not wires:
            return
        codec.decode(wires[0], n, ws, total)
        for wire in wires[1:]:
            np.add(total, codec.decode(wire, n, ws), out=total)


def _spans(bucket):
    """``(key, offset, size)`` of each key in a bucket (a split key: the whole key)."""
    if bucket.split:
        return [(bucket.segments[0].key, 0, bucket.size)]
    return [(s.key, s.offset, s.size) for s in bucket.segments]
