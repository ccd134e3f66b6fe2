"""How the keys of one call pack into a few large buffers (buckets). Pure.

A call with many keys must move as a few large MPI messages, not one
collective per key. Unsplit keys of one dtype are packed into buckets of at
most ``bucket_bytes``; inside a bucket the keys are ordered by owner, so each
owner's keys form one contiguous block (rank order): a bucket can be reduced
whole (``Allreduce``), block by block to the owners (``Reduce``), or with one
``Reduce_scatter`` whose counts are the blocks, and brought back with one
``Allgatherv``. A split key (a big array, cut over the owners) travels alone,
shard by shard.
"""

from dataclasses import dataclass

import numpy as np

#: Default bucket size. Smaller than DDP's 25 MiB and Horovod's 128 MiB: on the
#: test machine Open MPI summed 97 MiB 3.8 times faster as 4 MiB Allreduces
#: than as one (``python -m mpikv bench chunks``).
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

#: The smallest bucket of a ``device`` store's keys. Packing GPU keys costs a device
#: copy, while each bucket staged through host memory costs a wait for the GPU and two
#: copies:
#: an H200 shared by 2 ranks summed ResNet-50's gradients in place in 50 ms with
#: the host's sizes and in 38 ms fused in 32 MiB buckets (``bench gpu``,
#: docs/gpu.md). DDP's buckets are 25 MiB.
DEVICE_BUCKET_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Segment:
    """One key's place in a bucket: elements ``[offset, offset + size)``."""

    key: object
    offset: int
    size: int
    owner: int


@dataclass(frozen=True)
class Bucket:
    """A buffer's worth of keys.

    Attributes:
        dtype: the dtype the bucket is summed in.
        size: elements.
        segments: in buffer order; for a fused bucket, grouped by owner in rank
            order; for a split key, its shards in element order.
        split: True when the bucket is one split key.
        counts / displs: per rank, the elements of its block and where it
            starts (what ``Reduce_scatter`` and ``Allgatherv`` take).
    """

    dtype: np.dtype
    size: int
    segments: tuple
    split: bool
    counts: tuple
    displs: tuple
    keys: tuple = ()

    def __post_init__(self):
        # Read on every call that moves the bucket: computed once.
        object.__setattr__(self, "keys", tuple(dict.fromkeys(s.key for s in self.segments)))

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    def key_offsets(self):
        """``(key, offset)`` of each key in the bucket (a split key starts at 0)."""
        if self.split:
            return [(self.segments[0].key, 0)]
        return [(s.key, s.offset) for s in self.segments]


def _fused(dtype, members, num_ranks):
    """A fused bucket of ``(key, size, owner)`` members, laid out by owner."""
    ordered = sorted(range(len(members)), key=lambda i: (members[i][2], i))
    segments, offset = [], 0
    counts, displs = [0] * num_ranks, [0] * num_ranks
    for i in ordered:
        key, size, owner = members[i]
        if counts[owner] == 0:
            displs[owner] = offset
        segments.append(Segment(key, offset, size, owner))
        counts[owner] += size
        offset += size
    # Ranks without keys still need a displacement inside the buffer.
    for rank in range(num_ranks):
        if counts[rank] == 0:
            displs[rank] = displs[rank - 1] + counts[rank - 1] if rank else 0
    return Bucket(np.dtype(dtype), offset, tuple(segments), False, tuple(counts), tuple(displs))


def plan_buckets(items, num_ranks, bucket_bytes=DEFAULT_BUCKET_BYTES, direct_bytes=None):
    """Packs the keys of one call into buckets.

    Args:
        items: ``(key, dtype, placement)`` per key, in the call's canonical
            order; ``dtype`` is the dtype the key is summed in and
            ``placement`` its :class:`mpikv.core.plan.Placement`.
        num_ranks: the number of owners.
        direct_bytes: keys of at least this many bytes get a bucket of their
            own (they move straight from the caller's array, not packed);
            None: only keys larger than ``bucket_bytes``.
        bucket_bytes: the largest fused bucket; a key larger than this gets a
            bucket of its own.

    Returns:
        list of :class:`Bucket`, in the order of their first key.
    """
    buckets = []
    open_ = {}  # dtype -> (members, bytes, index in buckets)
    for key, dtype, placement in items:
        dtype = np.dtype(dtype)
        if placement.split:
            counts, displs = placement.counts_and_displs(num_ranks)
            segments = tuple(Segment(key, s.start, s.size, s.owner) for s in placement.shards)
            buckets.append(Bucket(dtype, placement.size, segments, True,
                                  tuple(counts), tuple(displs)))
            continue
        nbytes = placement.size * dtype.itemsize
        if direct_bytes is not None and nbytes >= direct_bytes:
            buckets.append(_fused(dtype, [(key, placement.size, placement.owner)], num_ranks))
            continue
        members, used, index = open_.get(dtype, (None, 0, None))
        if members is None or used + nbytes > bucket_bytes:
            members, used, index = [], 0, len(buckets)
            buckets.append(None)  # filled in below, keeping first-key order
        members.append((key, placement.size, placement.owner))
        open_[dtype] = (members, used + nbytes, index)
        buckets[index] = members
    return [b if isinstance(b, Bucket) else _fused(_dtype_of(b, items), b, num_ranks)
            for b in buckets]


def sizes(device, bucket_bytes, direct_bytes):
    """The ``(bucket_bytes, direct_bytes)`` to plan a call's keys with.

    The unsplit keys of a ``device`` store (one that keeps GPU values on the GPU)
    are all packed (``direct_bytes`` is for host stores, whose packing is a host
    copy), in buckets of at least :data:`DEVICE_BUCKET_BYTES`. The store's type
    decides, agreed at ``create`` (a device store on any rank), not where this
    rank's values are: ranks may keep a key in different places, and every rank
    must cut the same buckets.
    """
    if not device:
        return bucket_bytes, direct_bytes
    return max(bucket_bytes, DEVICE_BUCKET_BYTES), None


def _dtype_of(members, items):
    first = members[0][0]
    return next(np.dtype(d) for k, d, _ in items if k == first)
