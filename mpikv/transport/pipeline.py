"""Pipelined staging: a large device buffer goes through host memory in pieces, so
that the copies of some pieces overlap MPI's work on another.

Whole-buffer staging (:meth:`mpikv.transport.staging.Stager.staged`) runs three
steps one after the other: the device-to-host copy of the whole buffer, the MPI
call, the host-to-device copy. Here the buffer is cut into pieces of
``piece_bytes`` and two pinned host buffers (slots) take the pieces in turn:

* the device-to-host copy of piece k+1 is queued on a side stream (``down``)
  before MPI starts on piece k, so the GPU copies while the host is in MPI;
* after MPI on piece k, its host-to-device copy is queued on another side
  stream (``up``) and an event is recorded after it;
* a slot is refilled only after the host-to-device copy that reads it: the
  ``down`` stream waits for that event on the GPU (the host goes on), or,
  where nothing is copied in (a ``Bcast`` receiver), the host waits for it
  before MPI writes the slot;
* MPI touches a slot only after the host waited for the event of the copy
  into it;
* at the end the host waits for both side streams: the device buffer is then
  written for every stream, as after whole-buffer staging.

Only elementwise operations may go in pieces (``Allreduce``, ``Reduce`` and
``Bcast`` of one layout, a reducer's ``allreduce``): each piece's result
depends on that piece alone. Every rank makes the same MPI calls, since the
pieces depend only on the buffer's size and dtype and on ``piece_bytes``, an
option every rank of a store agrees on when it is made
(:data:`mpikv.store.factory.AGREED_OPTIONS`).

Anchor: CUDA-aware MPI libraries move large GPU messages through host buffers
the same way, in blocks whose copies overlap the transfer (MVAPICH2's
``MV2_CUDA_BLOCK_SIZE``, "the chunk size used in large message transfer from
device memory to host memory").
"""

import threading

from ..arrays.xp import module_of, on

#: The default piece (``MPIKV_STAGING_PIECE``), in bytes. 4 MiB is the reducers'
#: Allreduce piece (``bucket_bytes``), so pieces add no MPI call there; a PCIe
#: copy of 4 MiB takes ~0.2-0.4 ms, long enough that a piece's fixed costs (a
#: copy launch and an event, some microseconds) stay small, short enough that
#: filling and draining the pipeline (one piece's copy each way) is a small
#: part of a large bucket's time.
DEFAULT_STAGING_PIECE = 4 << 20
#: Host buffers used in turn: two suffice to overlap one piece's copies with
#: MPI on the other (double buffering).
SLOTS = 2

__all__ = ["SLOTS", "DEFAULT_STAGING_PIECE", "piece_ranges", "wants_pieces", "pipelined"]


def piece_ranges(size, itemsize, piece_bytes):
    """``(start, stop)`` element ranges of at most ``piece_bytes`` covering ``size`` elements.

    The same on every rank for the same buffer and setting; at least one element
    per piece, whatever ``piece_bytes``.
    """
    step = max(1, int(piece_bytes) // int(itemsize))
    return [(a, min(a + step, size)) for a in range(0, size, step)] or [(0, 0)]


def wants_pieces(nbytes, piece_bytes):
    """Whether a buffer of ``nbytes`` goes in pieces (more than one piece; 0: never)."""
    return piece_bytes > 0 and nbytes > piece_bytes


class _Slot:
    """A host buffer (and one for ``src``), with the events that guard it."""

    __slots__ = ("dst", "src", "ready", "read_back")

    def __init__(self, dst, src):
        self.dst, self.src = dst, src
        self.ready = None      # the copy into this slot: MPI may touch it once done
        self.read_back = None  # the host-to-device copy that still reads this slot


# (stream class, thread id, GPU id) -> (down, up): a thread's own non-blocking streams,
# so that waiting for them never waits for unrelated work on the caller's streams.
_streams = {}
_streams_lock = threading.Lock()


def _side_streams(cp, device_id):
    key = (cp.cuda.Stream, threading.get_ident(), device_id)
    with _streams_lock:
        found = _streams.get(key)
        if found is None:
            found = _streams[key] = (cp.cuda.Stream(non_blocking=True),
                                     cp.cuda.Stream(non_blocking=True))
    return found


def _get_async(dev, host, stream):
    """Queues ``dev`` -> ``host`` on ``stream`` without waiting for it."""
    try:
        dev.get(stream=stream, out=host, blocking=False)   # cupy 13: blocking=True waits
    except TypeError:  # cupy 12 and earlier: no ``blocking``; a stream makes it asynchronous
        dev.get(stream=stream, out=host)


def pipelined(stager, fn, dst, src, dev_dst, dev_src, copy_in, copy_back, piece_bytes):
    """Runs ``fn`` piece by piece on host copies of device buffers, copies overlapping MPI.

    Args:
        stager: the :class:`mpikv.transport.staging.Stager` lending host buffers.
        fn: ``fn(dst_piece, src_piece)``, blocking MPI work that is elementwise
            over the buffer; ``src_piece`` is None when ``src`` is.
        dst: the flat result buffer (device or host).
        src: a flat buffer ``fn`` only reads, or None (in place).
        dev_dst, dev_src: whether ``dst``/``src`` are device arrays (one is).
        copy_in: copy ``dst``'s values in (only in place).
        copy_back: copy the results back to a device ``dst``.
        piece_bytes: the largest piece, in bytes.

    Returns:
        the list of ``fn``'s results, one per piece. If ``fn`` raises, the pieces
        before hold their results and the later ones their old values.
    """
    ranges = piece_ranges(dst.size, dst.itemsize, piece_bytes)
    read_dst = dev_dst and copy_in and src is None
    anchor = dst if dev_dst else src
    cp = module_of(anchor)
    step = ranges[0][1] - ranges[0][0]
    slots, results = [], []
    with on(anchor):
        down, up = _side_streams(cp, anchor.device.id)
        # Both side streams start after the buffers' writers on the current
        # stream (the copies read dst/src, and write dst after them).
        start = cp.cuda.get_current_stream().record()
        down.wait_event(start)
        up.wait_event(start)

        def queue_in(k):
            slot = slots[k % len(slots)]
            a, b = ranges[k]
            if not (read_dst or dev_src):
                # Nothing to copy in: MPI writes the slot once its last copy back ran.
                slot.ready = slot.read_back
                return
            if slot.read_back is not None:
                down.wait_event(slot.read_back)   # on the GPU: the host goes on
            if read_dst:
                _get_async(dst[a:b], slot.dst[:b - a], down)
            if dev_src:
                _get_async(src[a:b], slot.src[:b - a], down)
            slot.ready = down.record()

        try:
            for _ in range(min(SLOTS, len(ranges))):
                slots.append(_Slot(stager.acquire(dst.dtype, step) if dev_dst else None,
                                   stager.acquire(src.dtype, step) if dev_src else None))
            queue_in(0)
            for k, (a, b) in enumerate(ranges):
                if k + 1 < len(ranges):
                    queue_in(k + 1)   # copied while MPI works on piece k
                slot = slots[k % len(slots)]
                if slot.ready is not None:
                    slot.ready.synchronize()
                n = b - a
                d = slot.dst[:n] if dev_dst else dst[a:b]
                s = slot.src[:n] if dev_src else (None if src is None else src[a:b])
                results.append(fn(d, s))
                if dev_dst and copy_back:
                    dst[a:b].set(d, stream=up)
                    slot.read_back = up.record()
        finally:
            # Queued copies still read or write the slots: done before they go back
            # to the pool. The results are then written for every stream.
            down.synchronize()
            up.synchronize()
            for slot in slots:
                for host in (slot.dst, slot.src):
                    if host is not None:
                        stager.release(host)
    return results
