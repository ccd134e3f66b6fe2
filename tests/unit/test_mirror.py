"""Buddy copies (redundancy="memory") on one process: what a copy holds, which step
the survivors go on from, and the rank lost with its buddy."""

import numpy as np
import pytest

import mpikv
from mpikv.elastic import mirror


@pytest.mark.parametrize("size, lost, held, step", [
    # every survivor holds steps 4 and 5 of its own and of its predecessor
    (4, [1], {0: ([4, 5], [4, 5]), 2: ([4, 5], [4, 5]), 3: ([4, 5], [4, 5])}, 5),
    # the lost rank's buddy (2) had not received step 5 yet: step 4
    (4, [1], {0: ([4, 5], [4, 5]), 2: ([4, 5], [3, 4]), 3: ([4, 5], [4, 5])}, 4),
    # a survivor one call behind, without its own copy of step 5: step 4
    (4, [1], {0: ([3, 4], [3, 4]), 2: ([4, 5], [4, 5]), 3: ([4, 5], [4, 5])}, 4),
    # rank 0 lost: its buddy is rank 1; the last rank's buddy is rank 0
    (3, [0], {1: ([7, 8], [7, 8]), 2: ([7, 8], [7, 8])}, 8),
    (3, [2], {0: ([7, 8], [7, 8]), 1: ([7, 8], [7, 8])}, 8),
    # two ranks apart: each has its own buddy
    (4, [0, 2], {1: ([2, 3], [2, 3]), 3: ([2, 3], [1, 2])}, 2),
    # no copy taken yet (a loss in the first step): nothing
    (3, [1], {0: ([], []), 2: ([], [])}, None),
    # no step in common
    (3, [1], {0: ([5, 6], [5, 6]), 2: ([3, 4], [3, 4])}, None),
])
def test_the_survivors_go_on_from_the_newest_step_held_whole(size, lost, held, step):
    assert mirror.common_step(size, lost, held) == step


@pytest.mark.parametrize("size, lost, pairs", [
    (4, [1, 2], [(1, 2)]),
    (3, [2, 0], [(2, 0)]),
    (4, [0, 1, 2], [(0, 1), (1, 2)]),
    (4, [1, 3], []),        # apart: each has a living buddy
    (2, [1], []),
    (1, [0], []),
])
def test_a_rank_lost_with_its_buddy_leaves_no_step_held_whole(size, lost, pairs):
    assert mirror.lost_with_buddy(size, lost) == pairs
    held = {r: ([1], [1]) for r in range(size) if r not in lost}
    assert mirror.common_step(size, lost, held) == (None if pairs else (1 if held else None))


def test_buddy_is_the_next_rank_round_the_ring():
    assert [mirror.buddy(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert mirror.buddy(0, 1) == 0


def test_a_copy_holds_the_values_and_states_a_checkpoint_part_would(make_store, tmp_path):
    kv = make_store()
    kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    kv.init(["a", "b"], [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4)])
    for step in range(1, 4):
        kv.push(["a", "b"], [np.full((2, 3), step, np.float32), np.full(4, -step, np.float64)])
        kv.keep_copy(step, {"note": step})
    own, prev = kv.copies.steps()
    assert own == prev == [2, 3]            # the two newest; one rank: its own back
    copy = kv.copies.own(3)
    assert (copy.step, copy.rank, copy.extra) == (3, 0, {"note": 3})
    got = {(k, n): a for k, n, _, _, _, a in copy.entries()}
    values = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4)}
    for key, out in values.items():
        kv.pull(key, out=out)
        np.testing.assert_array_equal(got[(key, "value")], out.reshape(-1))
    assert got[("a", "value")].dtype == np.float32 and got[("b", "value")].dtype == np.float64
    # the state kept is the optimizer's: a push after the copy does not change it
    momentum = got[("b", "opt.mom")].copy()
    kv.push("b", np.full(4, 100.0))
    np.testing.assert_array_equal(got[("b", "opt.mom")], momentum)


def test_keep_copy_takes_a_step_count(make_store, tmp_path):
    kv = make_store()
    kv.init("w", np.zeros(2))
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(mpikv.InputError, match="step must be an int >= 0"):
            kv.keep_copy(bad)
    assert kv.copies.steps() == ([], [])


def test_a_loss_among_the_survivors_combines_with_the_first():
    first = mirror.Loss([1], [0, 2, 3])
    # the survivors' rank 2 (the first store's rank 3) lost next
    both = mirror.combine(first, mirror.Loss([2], [0, 1]))
    assert both == mirror.Loss([1, 3], [0, 2])
    # and once more: the survivors' rank 0 (the first store's rank 0)
    assert mirror.combine(both, mirror.Loss([0], [1])) == mirror.Loss([0, 1, 3], [2])
    # a rank and its buddy lost one after the other: no step held whole, as at once
    assert mirror.lost_with_buddy(4, mirror.combine(first, mirror.Loss([1], [0, 2])).lost) \
        == [(1, 2)]
