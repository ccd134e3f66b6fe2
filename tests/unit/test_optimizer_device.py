"""Optimizers on device (cupy) weights, against the CPU stand-in of cupy.

The stand-in (``tests/fakecupy.py``) keeps cupy's rules: no implicit host
conversion, no host arrays in device arithmetic, operands on the current
GPU. Each update here runs on GPU 1 while GPU 0 is current, so an update
that forgets to make its weight's GPU current fails.
"""

import numpy as np
import pytest

from mpikv import optimizer as opt_mod
from mpikv.errors import OptimizerError

from .. import fakecupy
from .test_optimizer_rules import CASES, STEPS, SIZE


@pytest.fixture
def cp(monkeypatch):
    return fakecupy.install(monkeypatch)


def _steps(name, kwargs, dtype, put, shape=(SIZE,)):
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(SIZE).astype(dtype).reshape(shape)
    grads = rng.standard_normal((STEPS,) + shape).astype(dtype)
    opt = opt_mod.create(name, **kwargs)
    weight = put(w0)
    state = opt.create_state("k", weight)
    for grad in grads:
        opt.update("k", weight, put(grad), state)
    return weight, state


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name,kwargs", CASES)
def test_device_update_equals_host_update(cp, name, kwargs, dtype):
    host_w, host_state = _steps(name, kwargs, dtype, lambda a: a.copy())
    dev_w, dev_state = _steps(name, kwargs, dtype,
                              lambda a: _on(cp, 1, lambda: cp.asarray(a)))
    assert isinstance(dev_w, cp.ndarray) and dev_w.device.id == 1 and dev_w.dtype == dtype
    np.testing.assert_array_equal(dev_w.get(), host_w)
    for key, value in host_state.items():
        if key == "t":  # the count stays on the host
            assert isinstance(dev_state[key], np.ndarray)
            assert dev_state[key].tolist() == value.tolist() == [STEPS]
        else:
            assert dev_state[key].device.id == 1
            np.testing.assert_array_equal(dev_state[key].get(), value)


def _on(cp, device, make):
    with cp.cuda.Device(device):
        return make()


def test_host_gradient_of_a_device_weight(cp):
    opt = opt_mod.SGD(learning_rate=0.5)
    weight = _on(cp, 1, lambda: cp.ones(3, cp.float32))
    opt.update(0, weight, np.full(3, 2, np.float32), opt.create_state(0, weight))
    assert weight.get().tolist() == [0, 0, 0]


def test_lamb_shards_on_device(cp):
    # The two-phase protocol: partials (host floats) summed over shards.
    opt = opt_mod.LAMB(learning_rate=0.1, wd=0.01)
    rng = np.random.default_rng(0)
    w0, g = rng.standard_normal(10), rng.standard_normal(10)
    whole = w0.copy()
    opt.update("k", whole, g, opt.create_state("k", whole))
    shards = [_on(cp, 1, lambda s=s: cp.asarray(w0[s])) for s in (slice(0, 4), slice(4, 10))]
    pend = [opt.begin_update("k", w, _on(cp, 1, lambda s=s: cp.asarray(g[s])),
                             opt.create_state("k", w))
            for w, s in zip(shards, (slice(0, 4), slice(4, 10)))]
    totals = sum(p.partials for p in pend)
    assert isinstance(totals, np.ndarray)
    for p in pend:
        opt.finish_update(p, totals)
    np.testing.assert_allclose(np.concatenate([s.get() for s in shards]), whole, rtol=1e-12)


def test_host_state_for_a_device_weight_is_refused(cp):
    opt = opt_mod.Adam()
    weight = cp.ones(3, cp.float32)
    state = opt.create_state(0, np.ones(3, np.float32))
    with pytest.raises(OptimizerError, match=r"state 'mean' must be a float32 cupy array"):
        opt.update(0, weight, cp.ones(3, cp.float32), state)


def test_updater_states_stay_on_their_gpu(cp):
    updater = opt_mod.get_updater(opt_mod.Adam(learning_rate=0.1))
    weight = _on(cp, 1, lambda: cp.ones(4, cp.float32))
    updater(7, _on(cp, 1, lambda: cp.ones(4, cp.float32)), weight)
    states = updater.get_states()
    assert states[7]["mean"].device.id == 1 and isinstance(states[7]["t"], np.ndarray)
    updater.set_states(states)
    assert updater.states[7]["mean"].device.id == 1
    assert updater.states[7]["mean"] is not states[7]["mean"]
    np.testing.assert_array_equal(updater.states[7]["var"].get(), states[7]["var"].get())


def test_compute_dtype_takes_device_arrays(cp):
    assert opt_mod.compute_dtype(cp.ones(2, cp.float16)) == np.float32
    with pytest.raises(TypeError, match="numpy or cupy array"):
        opt_mod.compute_dtype([1.0, 2.0])
