"""kv.run on one process: the steps it calls, its checkpoints, its checks."""

import numpy as np
import pytest

import mpikv


def _accumulate(key, pushed, stored):
    stored += pushed


def _accumulating(make_store):
    """A store that adds what is pushed to what it holds, "w" zeros."""
    kv = make_store()
    kv.set_updater(_accumulate)
    kv.init("w", np.zeros(3))
    return kv


def test_run_saves_every_k_steps_and_a_new_run_goes_on_from_the_newest(make_store, tmp_path):
    calls = []

    def step_fn(kv, i):
        calls.append(i)
        kv.push("w", np.full(3, float(i)))
    kv = _accumulating(make_store)
    assert kv.run(step_fn, 5, tmp_path, every=2) is kv
    assert calls == [0, 1, 2, 3, 4]
    # step 0 at the start, then after 2 and 4 steps; the newest two kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000002", "step-000000002.parts", "step-000000004", "step-000000004.parts"]
    calls.clear()
    again = _accumulating(make_store)
    again.run(step_fn, [3, 4, 5, 6], tmp_path, every=2)
    assert calls == [4, 5, 6]   # from the checkpoint after 4 steps
    out = np.zeros(3)
    again.pull("w", out=out)
    assert out.tolist() == [21.0] * 3   # 0 + 1 + ... + 6, each step once


@pytest.mark.parametrize("kwargs, says", [
    ({"every": 0}, "every must be a positive int, not 0"),
    ({"every": 2, "keep": 0}, "keep must be a positive int, not 0"),
    ({"every": 2, "min_workers": None}, "min_workers must be a positive int, not None"),
    ({"every": 2, "redundancy": "disk"},
     "redundancy must be 'checkpoint' or 'memory', not 'disk'"),
])
def test_run_refuses_bad_arguments(make_store, tmp_path, kwargs, says):
    with pytest.raises(mpikv.InputError, match=f"^barrier: kv.run: {says}; nothing was applied$"):
        _accumulating(make_store).run(lambda kv, i: None, 3, tmp_path, **kwargs)
