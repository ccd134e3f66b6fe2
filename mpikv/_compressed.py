"""The compressed push: each sender's float32 gradients travel encoded.

After ``kv.set_gradient_compression(params)`` every bucket of a push or
pushpull goes through :meth:`CompressedPush.push_bucket` instead of a
reduction strategy (the codecs are :mod:`mpikv.compression`'s). Who sends:

- a distributed store: each rank, its values summed over its devices exactly
  (MXNet's dist stores: devices are merged uncompressed, then each worker's
  sum is compressed, with one residual per key on that worker);
- a ``device`` store: each device value of the call (MXNet's
  ``CommDevice::ReduceCompressed``, one residual per key and device).

What moves, per bucket of ``n`` float32 values on ``P`` ranks:

- 2-bit, every rank needs the sum (default updater): one ``Allgatherv`` of
  every rank's packed bucket (``n / 4`` bytes each); every rank decodes all
  of them and adds them in rank order, so the sums are equal everywhere.
- 2-bit, to the owners (updater, optimizer): one ``Alltoallv``: each owner
  gets every rank's packed codes of its block (MXNet's worker-to-server
  push); a later pull moves float32 values, uncompressed, as in MXNet.
- fp16 / bf16: one ``Alltoallv`` of 16-bit blocks (``2 n`` bytes per rank);
  each block's owner adds the ``P`` blocks in float32 in rank order and
  rounds the sum once; with the default updater an ``Allgatherv`` then
  moves the rounded sums, still as 16 bits (they are 16-bit values), over
  near-equal blocks.

``init`` and ``pull`` never come here.
"""

import numpy as np

from . import backends
from .compression import Workspace, describe, make_codec
from .engine import _gives_grads
from .reducers.base import Blocks, even_blocks


class CompressedPush:
    """A store's compression settings, its residuals and its compressed data path.

    Args:
        engine: the store's :class:`mpikv.engine.Engine`.
        config: a :func:`mpikv.compression.parse_params` result.
        per_device: each device value is a sender (the ``device`` store), not
            each rank.
    """

    def __init__(self, engine, config, per_device):
        self.engine = engine
        self.per_device = per_device
        self.ws = Workspace()
        self.residuals = {}       # key -> this rank's residual (flat float32 view)
        self._home = {}           # key -> the bucket arena its residual lives in
        self._arenas = {}         # id(bucket) -> (bucket, arena)
        self.device_residuals = {}  # (key, device index) -> residual (device store)
        self.configure(config)

    def configure(self, config):
        """New settings; residuals stay (MXNet keeps its residual buffers too)."""
        self.config = config
        self.codec = make_codec(config)
        #: what every rank's pushes must agree on (hashable: see agreement.fingerprint)
        self.setting = describe(config)

    # -- one bucket ------------------------------------------------------
    def push_bucket(self, layout, index, bucket, by_key, zero_copy, what, pending):
        """Sums one bucket of a push from compressed values, then assigns or updates.

        The same steps as :meth:`mpikv.engine.Engine.push` around its reducer:
        where the bucket's input is and where its sum goes follow the
        uncompressed path's rules.

        Returns:
            bool: whether the sum was left in the caller's own array.
        """
        e = self.engine
        t = e.transport
        default = e.updater_kind is None
        in_caller = False
        if zero_copy or (by_key is not None and _gives_grads(layout, bucket, by_key)):
            src, dst = None, layout.grads[index]
        elif self.per_device:
            src, dst = None, e.scratch(np.float32, bucket.size,
                                       e.entries[bucket.keys[0]].arena)
        elif default:
            src, dst, in_caller = e._source(layout, index, bucket, by_key)
        else:
            src, dst = e._owner_source(layout, index, bucket, by_key)
        if self.per_device:
            self._sum_devices(layout, bucket, by_key, dst)
        elif type(dst) is np.ndarray and (src is None or type(src) is np.ndarray):
            self._sum_ranks(layout, index, bucket, src, dst, default, what)
        else:   # GPU buffers: encoded on the host (the codecs are numpy)
            host = self.ws.get("host", bucket.size, np.float32)
            backends.copyto(host, dst if src is None else src)
            self._sum_ranks(layout, index, bucket, None, host, default, what)
            backends.copyto(dst, host)
        if default:
            if layout.grads is not None and dst is layout.grads[index]:
                e._alias(layout, index, bucket)
            elif dst is not layout.stored[index]:
                e._store(layout.stored[index], dst, bucket)
                return in_caller
            else:
                for key in bucket.keys:
                    e.entries[key].stale = False
            return False
        for seg in bucket.segments:
            if seg.owner == t.rank:
                e._update(seg, dst, bucket, pending)
        for key in bucket.keys:
            e.entries[key].stale = t.size > 1
        return False

    def _sum_ranks(self, layout, index, bucket, src, dst, default, what):
        """``dst`` (on the owners: their blocks) becomes the sum over ranks of the
        decoded values; ``src`` (None: ``dst``) is this rank's input."""
        t, codec, ws = self.engine.transport, self.codec, self.ws
        n, p, me = bucket.size, t.size, t.rank
        x = dst if src is None else src
        residual = self._bucket_residual(bucket) if codec.has_residual else None
        if default and codec.has_residual:
            # 2-bit to everyone: a rank's whole bucket is n / 4 bytes, so every rank
            # takes every rank's codes (less than the owners' route's float32 gather).
            w = codec.wire_size(n)
            wire = ws.get("gather", p * w, codec.wire_dtype)
            codec.encode(x, residual, wire[me * w:(me + 1) * w], ws)
            t.allgatherv_(wire, (w,) * p, tuple(s * w for s in range(p)), what)
            self._add_in_rank_order(dst, [wire[s * w:(s + 1) * w] for s in range(p)], n)
            return
        blocks = even_blocks(n, p) if default else Blocks(bucket.counts, bucket.displs)
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
        if not default:
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
        codec, ws = self.codec, self.ws
        if not wires:
            return
        codec.decode(wires[0], n, ws, total)
        for wire in wires[1:]:
            np.add(total, codec.decode(wire, n, ws), out=total)

    def _sum_devices(self, layout, bucket, by_key, dst):
        """The device store: ``dst`` becomes the sum over each key's device values,
        each compressed with its own residual, in device order."""
        codec, ws = self.codec, self.ws
        total = ws.get("total", bucket.size, np.float32)
        for key, offset, size in _spans(bucket):
            values = by_key[key].values if by_key is not None else [layout.views[key]]
            part = total[offset:offset + size]
            wire = ws.get("wire", codec.wire_size(size), codec.wire_dtype)
            for d, value in enumerate(values):
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

    # -- residuals -------------------------------------------------------
    def _bucket_residual(self, bucket):
        """This rank's residual of a bucket's keys, as one array laid out like the bucket.

        A key keeps one residual whichever key lists push it: it moves into the
        arena of the bucket that uses it (copied), as stored values move into
        the arenas of :meth:`mpikv.engine.Engine.gradient_buffers`.
        """
        found = self._arenas.get(id(bucket))
        if found is not None and all(self._home.get(k) is found[1] for k in bucket.keys):
            return found[1]
        arena = np.zeros(bucket.size, np.float32)
        for key, offset, size in _spans(bucket):
            view = arena[offset:offset + size]
            old = self.residuals.get(key)
            if old is not None:
                view[...] = old
            self.residuals[key] = view
            self._home[key] = arena
        self._arenas[id(bucket)] = (bucket, arena)
        if found is not None or len(self._arenas) > 1:
            # Drop arenas no key lives in any more.
            self._arenas = {i: (b, a) for i, (b, a) in self._arenas.items()
                            if any(self._home.get(k) is a for k in b.keys)}
        return arena

    def _device_residual(self, key, device, size):
        found = self.device_residuals.get((key, device))
        if found is None:
            found = self.device_residuals[(key, device)] = np.zeros(size, np.float32)
        return found

    def residual(self, key, device=None):
        """This rank's residual of ``key`` (of its ``device``-th value on a device
        store), shaped like the key, or None before its first compressed push."""
        found = (self.residuals.get(key) if device is None
                 else self.device_residuals.get((key, device)))
        if found is None:
            return None
        return found.reshape(self.engine.entries[key].array.shape)


def _spans(bucket):
    """``(key, offset, size)`` of each key in a bucket (a split key: the whole key)."""
    if bucket.split:
        return [(bucket.segments[0].key, 0, bucket.size)]
    return [(s.key, s.offset, s.size) for s in bucket.segments]
