"""The ownership plan, without MPI: every element owned once, balanced, rank-independent."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpikv.core.plan import OwnershipPlan, split_bounds

entries_st = st.lists(
    st.tuples(st.integers(0, 400), st.sampled_from([2, 4, 8])),
    min_size=1, max_size=40)


def _entries(raw):
    return [(f"k{i}", size, itemsize) for i, (size, itemsize) in enumerate(raw)]


@settings(max_examples=200, deadline=None)
@given(raw=entries_st, ranks=st.integers(1, 9), bound=st.integers(1, 500),
       calls=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_every_element_owned_once_and_loads_balanced(raw, ranks, bound, calls, seed):
    entries = _entries(raw)
    plan = OwnershipPlan(ranks, bound)
    # Several init calls, as a training script would make.
    chunks = [entries[i::calls] for i in range(calls)]
    biggest = 0
    for chunk in chunks:
        random.Random(seed).shuffle(chunk)
        plan.add(chunk)
    for key, size, itemsize in entries:
        p = plan[key]
        covered = [0] * size
        for shard in p.shards:
            assert 0 <= shard.owner < ranks
            for i in range(shard.start, shard.stop):
                covered[i] += 1
        assert covered == [1] * size
        assert p.split == (size >= bound and ranks > 1 and size > 1)
        if p.split:
            assert len({s.owner for s in p.shards}) == len(p.shards)
            sizes = [s.size for s in p.shards]
            assert max(sizes) - min(sizes) <= 1
            assert len(p.shards) == min(size, ranks)
        biggest = max(biggest, max(s.size for s in p.shards) * itemsize)
    # Loads are balanced within the largest single piece placed.
    assert max(plan.loads) - min(plan.loads) <= biggest
    assert sum(plan.loads) == sum(size * itemsize for _, size, itemsize in entries)


@settings(max_examples=100, deadline=None)
@given(raw=entries_st, ranks=st.integers(1, 9), bound=st.integers(1, 500),
       seed=st.integers(0, 2**16))
def test_same_answer_whatever_the_order(raw, ranks, bound, seed):
    entries = _entries(raw)
    shuffled = list(entries)
    random.Random(seed).shuffle(shuffled)
    a, b = OwnershipPlan(ranks, bound), OwnershipPlan(ranks, bound)
    a.add(entries)
    b.add(shuffled)
    assert all(a[k] == b[k] for k, _, _ in entries)
    assert a.loads == b.loads


def test_mxnet_default_bound_splits_a_million_elements():
    plan = OwnershipPlan(4)
    placed = plan.add([("big", 1_000_000, 4), ("small", 999_999, 4)])
    assert placed["big"].split and len(placed["big"].shards) == 4
    assert not placed["small"].split


def test_counts_and_displs_cover_the_array():
    plan = OwnershipPlan(3, bigarray_bound=10)
    p = plan.add([(7, 11, 4)])[7]
    counts, displs = p.counts_and_displs(3)
    assert sum(counts) == 11
    assert sorted(zip(displs, counts)) == [(0, 3), (3, 4), (7, 4)]
    assert [(s.start, s.stop) for s in p.shards] == [(0, 3), (3, 7), (7, 11)]


def test_small_keys_spread_over_ranks():
    plan = OwnershipPlan(4)
    plan.add([(k, 100, 4) for k in range(8)])
    owners = [plan[k].owner for k in range(8)]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [len(plan.owned_by(r)) for r in range(4)] == [2, 2, 2, 2]


def test_split_bounds_near_equal():
    assert split_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split_bounds(2, 2) == [(0, 1), (1, 2)]


def test_bad_arguments():
    with pytest.raises(ValueError):
        OwnershipPlan(0)
    with pytest.raises(ValueError):
        OwnershipPlan(2, bigarray_bound=0)
    plan = OwnershipPlan(2)
    plan.add([(1, 3, 4)])
    with pytest.raises(ValueError, match="already placed"):
        plan.add([(1, 3, 4)])
    with pytest.raises(ValueError, match="duplicate"):
        plan.add([(2, 3, 4), (2, 3, 4)])
    with pytest.raises(ValueError, match="split"):
        OwnershipPlan(2, 1).add([(5, 4, 4)])[5].owner
