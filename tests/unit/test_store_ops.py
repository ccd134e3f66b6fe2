"""The store operations for the layers above (the torch Trainer), on a local store:
add_call_hook, agree, threaded, owned_states, load_owned_states."""

import gc

import numpy as np
import pytest

import mpikv
from mpikv import errors


class _Counter:
    def __init__(self):
        self.calls = 0

    def hook(self):
        self.calls += 1


def _pulled(kv):
    out = np.empty(4, np.float32)
    kv.pull("w", out=out)
    return out.tolist()


def _store():
    kv = mpikv.create("local")
    kv.init("w", np.arange(4, dtype=np.float32))
    kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    return kv


def test_a_call_hook_runs_before_each_call_until_removed():
    kv = _store()
    counter = _Counter()
    handle = kv.add_call_hook(counter.hook)
    kv.push("w", np.ones(4, np.float32))
    kv.barrier()
    assert counter.calls == 2
    handle.remove()
    handle.remove()   # again: nothing
    kv.barrier()
    assert counter.calls == 2


def test_a_call_hook_is_held_weakly_and_must_be_a_bound_method():
    kv = _store()
    counter = _Counter()
    handle = kv.add_call_hook(counter.hook)
    del counter
    gc.collect()
    kv.barrier()   # the dead hook is skipped
    handle.remove()
    with pytest.raises(errors.ValueTypeError, match="bound method"):
        kv.add_call_hook(lambda: None)


def test_agree_moves_nothing_and_does_nothing_once_closed():
    kv = _store()
    kv.agree("Trainer.close")
    assert _pulled(kv) == [0, 1, 2, 3]
    kv.fail_next_call(errors.OptimizerError, "a check failed")
    with pytest.raises(errors.OptimizerError, match="^Trainer.save: a check failed"):
        kv.agree("Trainer.save")
    kv.close()
    kv.agree("Trainer.close")   # nothing on a closed store


def test_a_local_store_is_not_threaded():
    assert mpikv.create("local").threaded is False


def test_owned_states_gives_the_stored_value_and_the_state_after_an_update():
    kv = _store()
    owned = kv.owned_states(["w"])["w"]
    assert owned.dtype == np.float32
    (part,) = owned.parts
    assert (part.start, part.stop, part.whole, part.state) == (0, 4, True, None)
    assert part.weight.tolist() == [0, 1, 2, 3]
    kv.push("w", np.ones(4, np.float32))
    (part,) = kv.owned_states(["w"])["w"].parts
    assert part.weight.tolist() == [-0.5, 0.5, 1.5, 2.5]
    assert part.state["mom"].tolist() == [-0.5] * 4
    with pytest.raises(errors.UnknownKeyError, match="'v'"):
        kv.owned_states(["v"])


def test_load_owned_states_replaces_the_state_used_by_the_next_update():
    kv = _store()
    kv.push("w", np.ones(4, np.float32))
    (part,) = kv.owned_states(["w"])["w"].parts
    fresh = {name: np.full_like(a, 2.0) for name, a in part.state.items()}
    kv.load_owned_states({("w", 0): fresh})
    assert kv.owned_states(["w"])["w"].parts[0].state["mom"].tolist() == [2.0] * 4
    kv.push("w", np.zeros(4, np.float32))   # mom = 0.9 * 2 - 0.5 * 0; w += mom
    assert np.allclose(_pulled(kv), [1.3, 2.3, 3.3, 4.3])


def test_load_owned_states_loads_nothing_on_a_failure():
    kv = _store()
    kv.push("w", np.ones(4, np.float32))
    before = kv.owned_states(["w"])["w"].parts[0].state["mom"].copy()
    with pytest.raises(errors.InputError, match="does not own the part of key 'w' that starts"):
        kv.load_owned_states({("w", 2): {"mom": np.zeros(2, np.float32)}})
    kv.fail_next_call(errors.OptimizerError, "the caller's check failed")
    with pytest.raises(errors.OptimizerError, match="the caller's check failed"):
        kv.load_owned_states({("w", 0): {"mom": np.zeros(4, np.float32)}})
    assert kv.owned_states(["w"])["w"].parts[0].state["mom"].tolist() == before.tolist()
