"""The Engine's pieces alone, without a transport: KeyTable, Layouts, BucketRoute
and ZeroCopy over numpy values, with stand-ins for the reducer chooser, the owners
and the few collectives a pull or gather calls."""

import numpy as np
import pytest

from mpikv.calls.reader import Item
from mpikv.errors import DTypeError
from mpikv.core.keytable import Entry, KeyTable
from mpikv.core.layouts import Layouts, agreed_in_place
from mpikv.core.bucket_route import BucketRoute, distinct_memory
from mpikv.core.zero_copy import ZeroCopy

F = np.float32


class Collectives:
    """Records the collectives a piece calls (rank 0 of ``size``); they move nothing."""

    def __init__(self, size=2, shared=False):
        self.rank, self.size, self.shared, self.calls = 0, size, shared, []

    def allgatherv_(self, buf, counts, displs, what):
        self.calls.append(("allgatherv", buf, tuple(counts), what))

    def bcast_(self, buf, root, what):
        self.calls.append(("bcast", buf, root, what))

    def shared_arena(self, size, dtype):
        if not self.shared:
            return None
        return type("Arena", (), {"mine": np.zeros(size, dtype)})()


class Chooser:
    """Stands in for :class:`mpikv.reducers.Chooser`: a reducer is the arguments it got."""

    compression = None

    def __init__(self):
        self.asked = []

    def get(self, bucket, nbytes, in_place, device, window, owners):
        self.asked.append((bucket.keys, nbytes, in_place, device, window, owners))
        return ("reducer", bucket.keys, in_place, owners)


class Owners:
    """Stands in for :class:`mpikv.core.owners.Owners`: records what it is asked to update."""

    def __init__(self, kind=None):
        self.kind, self.updates = kind, []

    def update(self, key, start, grad, stored, split, pending):
        self.updates.append((key, start, grad.copy(), split))


def loaded_table(shapes, num_ranks=2, bigarray_bound=1000, dtype=F):
    """A KeyTable whose keys each have an arena of their own (as a load makes them),
    key ``k`` holding ``10 * i + arange``."""
    table = KeyTable(num_ranks, bigarray_bound)
    placed = table.place([(k, int(np.prod(s)), np.dtype(dtype).itemsize)
                          for k, s in shapes.items()])
    entries = {}
    for i, (key, shape) in enumerate(shapes.items()):
        arena = (10 * i + np.arange(int(np.prod(shape)))).astype(dtype)
        entries[key] = Entry(arena, 0, shape, placed[key])
    table.add_loaded(entries)
    return table


def pieces(shapes, kind=None, size=2, shared=False, bucket_bytes=1 << 20, **kw):
    table = loaded_table(shapes, num_ranks=size, **kw)
    chooser, owners, t = Chooser(), Owners(kind), Collectives(size, shared)
    layouts = Layouts(table, chooser, owners, (False, bucket_bytes, None))
    route = BucketRoute(table, layouts, owners, chooser, t)
    return table, layouts, route, ZeroCopy(table, layouts, t, False), t


# -- KeyTable ------------------------------------------------------------------
def test_key_table_knows_its_keys():
    table = loaded_table({"a": (2, 3), "b": (4,)})
    assert table.lookup("a") == ((2, 3), np.dtype(F)) and table.lookup("z") is None
    assert table.key_type is str and not table.on_gpu and table.gpus == frozenset()
    assert sorted(table.entries) == ["a", "b"] and "a" in table.plan
    with pytest.raises(TypeError):
        table.entries["c"] = None   # read only: changes go through put
    zeros = table.zeros_of("a")
    assert zeros.shape == (2, 3) and zeros.dtype == F and not zeros.any()
    assert table.entries["a"].array.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_key_table_tells_integer_keys():
    table = KeyTable(1, 1000)
    placed = table.place([(1, 4, 4), (2, 4, 8)])
    table.put(1, Entry(np.zeros(4, np.int32), 0, (4,), placed[1]))
    table.put(2, Entry(np.zeros(4, np.float64), 0, (4,), placed[2]))
    table.note_keys([(1, np.dtype(np.int32)), (2, np.dtype(np.float64))])
    assert table.int_keys_in([2, 1, 3]) == [1] and table.key_type is int


@pytest.mark.parametrize("num_ranks, stale", [(1, False), (2, True)])
def test_loaded_values_are_copied_in_and_stale_with_other_ranks(num_ranks, stale):
    table = loaded_table({"a": (4,), "b": (2,)}, num_ranks=num_ranks)
    table.load_values([("a", 1, 3, np.array([7, 8], F))])
    assert table.entries["a"].array.tolist() == [0, 7, 8, 3]
    assert [e.stale for e in table.entries.values()] == [stale, stale]
    table.set_stale(["a"], False)
    assert not table.entries["a"].stale
    table.clear()
    assert dict(table.entries) == {} and table.lookup("a") is None


def test_a_moved_entry_keeps_its_staleness_and_can_take_a_given_view():
    table = loaded_table({"a": (2, 2)})
    old = table.entries["a"]
    old.stale = True
    arena = np.arange(10, dtype=F)
    moved = old.moved_to(arena, 6)
    assert moved.stale and moved.array.tolist() == [[6, 7], [8, 9]]
    assert moved.placement is old.placement and moved.arena is arena
    view = arena[6:].reshape(2, 2)
    assert old.moved_to(arena, 6, view).array is view


# -- Layouts -------------------------------------------------------------------
def test_a_layout_is_cached_and_fuses_small_keys():
    table, layouts, _, _, _ = pieces({"a": (3,), "b": (5,)})
    lay = layouts.get(["a", "b"])
    assert layouts.get(["a", "b"]) is lay and layouts.find(["a", "b"]) is lay
    assert layouts.find(["b"]) is None
    assert [set(b.keys) for b in lay.buckets] == [{"a", "b"}] and lay.buckets[0].size == 8
    assert lay.stored == [None]   # the keys live in arenas of their own


def test_small_buckets_cut_the_keys_apart():
    _, layouts, _, _, _ = pieces({"a": (3,), "b": (5,)}, bucket_bytes=16)
    assert [b.keys for b in layouts.get(["a", "b"]).buckets] == [("a",), ("b",)]


def test_rehome_moves_values_into_one_arena_and_changes_the_epoch():
    table, layouts, _, _, _ = pieces({"a": (3,), "b": (5,)})
    table.entries["b"].stale = True
    lay = layouts.get(["a", "b"])
    epoch = layouts.epoch
    layouts.rehome(lay)
    assert layouts.epoch > epoch
    stored = lay.stored[0]
    assert stored is table.entries["a"].arena is table.entries["b"].arena
    by_offset = {seg.key: seg.offset for seg in lay.buckets[0].segments}
    assert stored[by_offset["b"]:by_offset["b"] + 5].tolist() == [10, 11, 12, 13, 14]
    assert table.entries["a"].array.tolist() == [0, 1, 2]
    assert table.entries["b"].stale and not table.entries["a"].stale


def test_the_reducer_is_chosen_once_per_bucket_and_again_after_rechoose():
    _, layouts, _, _, _ = pieces({"a": (3,), "b": (5,)}, kind="optimizer")
    lay = layouts.get(["a", "b"])
    dst = np.zeros(8, F)
    first = layouts.reducer(lay, 0, dst)
    assert layouts.reducer(lay, 0, dst) is first
    keys = lay.buckets[0].keys
    assert first == ("reducer", keys, True, True)   # fused: in place; to the owners
    assert layouts.chooser.asked == [(keys, 32, True, False, None, True)]
    layouts.rechoose()
    layouts.reducer(lay, 0, dst)
    assert len(layouts.chooser.asked) == 2


def test_the_table_column_is_the_bucket_shape_only():
    _, layouts, _, _, _ = pieces({"a": (3,), "b": (5,)}, bucket_bytes=16)
    one = layouts.get(["a", "b"]).buckets[0]
    _, layouts, _, _, _ = pieces({"a": (3,), "b": (5,)})
    two = layouts.get(["a", "b"]).buckets[0]
    assert (agreed_in_place(one), agreed_in_place(two)) == (False, True)


def test_scratch_is_reused_and_grown():
    _, layouts, _, _, _ = pieces({"a": (3,)})
    like = np.zeros(1, F)
    small = layouts.scratch(F, 4, like)
    again = layouts.scratch(F, 3, like)
    assert again.size == 3 and np.shares_memory(small, again)
    bigger = layouts.scratch(F, 10, like)
    assert bigger.size == 10 and not np.shares_memory(small, bigger)
    layouts.scratch(np.float64, 2, like)
    assert sorted(b.dtype.name for b in layouts.scratch_buffers()) == ["float32", "float64"]
    layouts.clear()
    assert layouts.scratch_buffers() == [] and layouts.find(["a"]) is None


def test_alias_and_privatize():
    table, layouts, _, zero_copy, _ = pieces({"a": (3,), "b": (5,)})
    views = zero_copy.gradient_buffers(["a", "b"])
    lay = layouts.get(["a", "b"])
    views["a"][...] = 1
    layouts.alias(lay, 0, lay.buckets[0])
    assert table.entries["a"].array is views["a"] and lay.stored[0] is lay.grads[0]
    epoch = layouts.epoch
    layouts.privatize()
    assert layouts.epoch > epoch
    assert table.entries["a"].array.tolist() == [1, 1, 1]
    assert not np.shares_memory(table.entries["a"].array, views["a"])


# -- BucketRoute ---------------------------------------------------------------
def _items(values, outs=None):
    return {k: Item(k, v if isinstance(v, list) else [v], (outs or {}).get(k, []))
            for k, v in values.items()}


def test_fused_keys_are_summed_in_the_stored_arena():
    table, layouts, route, _, _ = pieces({"a": (3,), "b": (2,)})
    lay = layouts.get(["a", "b"])
    layouts.rehome(lay)
    by_key = _items({"a": [np.ones(3, F), np.ones(3, F)], "b": np.full(2, 5, F)})
    src, dst, in_caller = route.route(lay, 0, lay.buckets[0], by_key)
    assert src is None and dst is lay.stored[0] and not in_caller
    assert table.entries["a"].array.tolist() == [2, 2, 2]   # summed over devices
    assert table.entries["b"].array.tolist() == [5, 5]
    table.set_stale(["a"])
    assert route.finish_default(lay, 0, lay.buckets[0], dst) is False
    assert not table.entries["a"].stale


def test_a_one_key_pushpull_into_its_value_is_summed_in_place():
    table, layouts, route, _, _ = pieces({"a": (4,)})
    lay = layouts.get(["a"])
    value = np.ones(4, F)
    by_key = _items({"a": value}, {"a": [value]})
    src, dst, in_caller = route.route(lay, 0, lay.buckets[0], by_key, in_place_ok=True)
    assert src is None and np.shares_memory(dst, value) and in_caller
    dst[...] = 6   # as the reducer would sum
    assert route.finish_default(lay, 0, lay.buckets[0], dst) is True
    assert table.entries["a"].array.tolist() == [6] * 4
    # Not in place (another key of the call may read it): out of place into the store.
    src, dst, in_caller = route.route(lay, 0, lay.buckets[0], by_key, in_place_ok=False)
    assert np.shares_memory(src, value) and dst is lay.stored[0] and not in_caller


def test_a_push_to_the_owners_updates_what_this_rank_owns():
    table, layouts, route, _, t = pieces({"a": (4,), "b": (4,)}, kind="optimizer")
    lay = layouts.get(["a", "b"])
    bucket = lay.buckets[0]
    by_key = _items({"a": np.ones(4, F), "b": np.full(4, 2, F)})
    src, dst, in_caller = route.route(lay, 0, bucket, by_key)
    assert src is None and not in_caller and not np.shares_memory(dst, table.entries["a"].arena)
    route.finish_owners(bucket, dst, [])
    mine = [s.key for s in bucket.segments if s.owner == t.rank]
    assert [u[0] for u in route.owners.updates] == mine and len(mine) == 1
    want = {"a": [1] * 4, "b": [2] * 4}[mine[0]]
    assert route.owners.updates[0][2].tolist() == want
    assert all(table.entries[k].stale for k in ("a", "b"))   # until the next pull


def test_a_pull_gathers_a_whole_stale_bucket_at_once_else_key_by_key():
    table, layouts, route, _, t = pieces({"a": (4,), "b": (4,)})
    lay = layouts.get(["a", "b"])
    layouts.rehome(lay)
    bucket = lay.buckets[0]
    table.set_stale(["a", "b"])
    route.pull_stale(lay.stored[0], bucket, ["a", "b"], ("pull", ["a", "b"]))
    assert [c[0] for c in t.calls] == ["allgatherv"] and t.calls[0][2] == bucket.counts
    assert not table.entries["a"].stale and not table.entries["b"].stale
    t.calls.clear()
    table.set_stale(["b"])
    route.pull_stale(lay.stored[0], bucket, ["b"], ("pull", ["b"]))
    owner = table.plan["b"].owner
    assert [(c[0], c[2]) for c in t.calls] == [("bcast", owner)]
    assert not table.entries["b"].stale


class OneRank:
    """A reducer of one rank: the sum of one input is the input."""

    def allreduce(self, dst, src, what):
        if src is not None:
            dst[...] = src


def _push(route, layouts, keys, by_key, in_place_ok=True):
    """The Engine's push loop with the default updater, over a one-rank reducer."""
    lay = layouts.get(keys)
    for index, bucket in enumerate(lay.buckets):
        src, dst, _ = route.route(lay, index, bucket, by_key, in_place_ok)
        OneRank().allreduce(dst, src, ("push", bucket.keys))
        route.finish_default(lay, index, bucket, dst)
    return lay


def test_a_push_stores_the_sum_whichever_route_it_takes():
    table, layouts, route, _, _ = pieces({"a": (3,), "b": (2,), "c": (4,)}, bucket_bytes=20)
    by_key = _items({"a": np.full(3, 1, F), "b": np.full(2, 2, F), "c": np.full(4, 3, F)})
    lay = _push(route, layouts, ["a", "b", "c"], by_key)
    assert [set(b.keys) for b in lay.buckets] == [{"a", "b"}, {"c"}]
    assert {k: e.array.tolist() for k, e in table.entries.items()} == {
        "a": [1] * 3, "b": [2] * 2, "c": [3] * 4}
    assert not any(e.stale for e in table.entries.values())


def test_a_push_of_the_gradient_buffers_makes_them_the_stored_values():
    table, layouts, route, zero_copy, _ = pieces({"a": (3,), "b": (2,)})
    views = zero_copy.gradient_buffers(["a", "b"])
    views["a"][...], views["b"][...] = 4, 5
    epoch = layouts.epoch
    _push(route, layouts, ["a", "b"], _items(views))
    assert table.entries["a"].array is views["a"] and table.entries["b"].array is views["b"]
    assert layouts.epoch > epoch   # the stored values moved: remembered routes end
    assert table.entries["b"].array.tolist() == [5, 5]


def test_distinct_memory():
    a = np.zeros(4, F)
    assert distinct_memory([Item("x", [a]), Item("y", [np.zeros(4, F)])])
    assert not distinct_memory([Item("x", [a]), Item("y", [a[:2]])])


# -- ZeroCopy ------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
def test_gradient_buffers_are_views_of_one_arena_per_bucket(shared):
    table, layouts, _, zero_copy, t = pieces({"a": (2, 3), "b": (4,)}, shared=shared)
    views = zero_copy.gradient_buffers(["a", "b"], shared=True)
    assert views["a"].shape == (2, 3) and views["b"].shape == (4,) and not views["a"].any()
    assert views["a"].base is views["b"].base is layouts.get(["a", "b"]).grads[0]
    assert not np.shares_memory(views["a"], table.entries["a"].array)
    assert zero_copy.views(["a", "b"]) is views and zero_copy.views(["b"]) is None
    assert zero_copy.uses_shared_memory(["b", "a"]) is shared
    assert zero_copy.gradient_buffers(["a", "b"]) is views
    zero_copy.gather_grads("gather", ["a", "b"])
    keys = layouts.get(["a", "b"]).buckets[0].keys
    assert [(c[0], c[3]) for c in t.calls] == [("allgatherv", ("gather", keys))]


def test_sixteen_bit_keys_have_no_gradient_buffers():
    _, _, _, zero_copy, _ = pieces({"a": (4,)}, dtype=np.float16)
    with pytest.raises(DTypeError, match="summed in float32"):
        zero_copy.gradient_buffers(["a"])


def test_value_views_lie_in_one_arena_in_bucket_order():
    table, layouts, _, zero_copy, _ = pieces({"a": (3,), "b": (2,)})
    views = zero_copy.value_views(["a", "b"])
    assert views["a"].tolist() == [0, 1, 2] and views["b"].tolist() == [10, 11]
    assert views["a"].base is views["b"].base is not None
    assert layouts.get(["a", "b"]).stored[0] is table.entries["a"].arena
