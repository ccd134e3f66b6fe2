"""Bucket plans, without MPI: every key once, owner blocks contiguous, size bounds kept."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mpikv.core.fusion import DEVICE_BUCKET_BYTES, plan_buckets, sizes
from mpikv.core.plan import OwnershipPlan


def _items(sizes, dtypes, ranks, bound):
    plan = OwnershipPlan(ranks, bound)
    keys = list(range(len(sizes)))
    plan.add([(k, s, np.dtype(d).itemsize) for k, s, d in zip(keys, sizes, dtypes)])
    return [(k, np.dtype(d), plan[k]) for k, d in zip(keys, dtypes)]


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=60),
       data=st.data(), ranks=st.integers(1, 6), bound=st.integers(1, 400),
       bucket=st.integers(4, 2000))
def test_bucket_plan_invariants(sizes, data, ranks, bound, bucket):
    dtypes = data.draw(st.lists(st.sampled_from(["float32", "float64", "int32"]),
                                min_size=len(sizes), max_size=len(sizes)))
    items = _items(sizes, dtypes, ranks, bound)
    buckets = plan_buckets(items, ranks, bucket)
    seen = [s.key for b in buckets if not b.split for s in b.segments]
    seen += [b.segments[0].key for b in buckets if b.split]
    assert sorted(seen) == sorted(k for k, _, _ in items)  # every key exactly once
    for b in buckets:
        assert len({np.dtype(d) for k, d, _ in items if k in b.keys}) == 1
        assert b.dtype == np.dtype(dict((k, d) for k, d, _ in items)[b.keys[0]])
        assert sum(b.counts) == b.size
        if b.split:
            continue
        # Size bound, unless a single key is larger than a bucket.
        assert b.nbytes <= bucket or len(b.segments) == 1
        # Segments tile the buffer, grouped by owner in rank order.
        offset = 0
        for s in b.segments:
            assert s.offset == offset
            offset += s.size
        owners = [s.owner for s in b.segments]
        assert owners == sorted(owners)
        for rank in range(ranks):
            mine = [s for s in b.segments if s.owner == rank]
            assert b.counts[rank] == sum(s.size for s in mine)
            if mine:
                assert b.displs[rank] == mine[0].offset
            assert 0 <= b.displs[rank] <= b.size


def test_small_keys_fuse_and_big_keys_travel_alone():
    items = _items([1000] * 10 + [5000], ["float32"] * 11, ranks=2, bound=4000)
    buckets = plan_buckets(items, 2, bucket_bytes=16000)
    assert [b.split for b in buckets] == [False, False, False, True]
    assert [len(b.segments) for b in buckets[:3]] == [4, 4, 2]
    assert buckets[3].keys == (10,) and len(buckets[3].segments) == 2


def test_dtypes_do_not_mix():
    items = _items([10, 10, 10], ["float32", "float64", "float32"], ranks=1, bound=100)
    buckets = plan_buckets(items, 1)
    assert [(b.dtype.name, b.keys) for b in buckets] == [("float32", (0, 2)), ("float64", (1,))]


def test_gpu_keys_are_packed_in_big_buckets_and_host_keys_keep_the_options():
    assert sizes(False, 4 << 20, 256 << 10) == (4 << 20, 256 << 10)
    assert sizes(True, 4 << 20, 256 << 10) == (DEVICE_BUCKET_BYTES, None)
    assert sizes(True, 64 << 20, 256 << 10) == (64 << 20, None)   # a bigger choice is kept
    # ResNet-50-like: 40 keys of 1 MiB (float32), below the split bound.
    items = _items([1 << 18] * 40, ["float32"] * 40, ranks=2, bound=1 << 20)
    host = plan_buckets(items, 2, *sizes(False, 4 << 20, 256 << 10))
    gpu = plan_buckets(items, 2, *sizes(True, 4 << 20, 256 << 10))
    assert len(host) == 40                                   # each at least direct_bytes: alone
    assert [len(b.segments) for b in gpu] == [32, 8]         # 32 MiB buckets
