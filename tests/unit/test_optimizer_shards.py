"""Sharded two-phase updates equal whole-array updates; counts live in states."""

import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpikv.optimizer as opt_mod
from mpikv.errors import OptimizerError

SHARD_CASES = [
    ("sgd", dict(learning_rate=0.1)),
    ("sgd", dict(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.5)),
    ("nag", dict(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5)),
    ("adam", dict(learning_rate=0.05, wd=0.01, clip_gradient=0.8)),
    ("adamw", dict(learning_rate=0.05, wd=0.01, eta=0.7)),
    ("rmsprop", dict(learning_rate=0.02, centered=True, clip_weights=2.0)),
    ("lamb", dict(learning_rate=0.05, wd=0.01)),
    ("lamb", dict(learning_rate=0.05, lower_bound=4.0, upper_bound=6.0,
                  bias_correction=False, clip_gradient=0.7)),
]
STEPS = 3


def _shard_bounds(size, cuts):
    edges = [0, *sorted(cuts), size]
    return list(zip(edges[:-1], edges[1:]))


def _sharded_step(opt, key, flat_w, flat_g, bounds, states):
    pendings = [opt.begin_update(key, flat_w[a:b], flat_g[a:b], s)
                for (a, b), s in zip(bounds, states)]
    if pendings[0].partials is None:
        assert all(p.partials is None for p in pendings)
        totals = None
    else:
        totals = np.sum([p.partials for p in pendings], axis=0)
    for p in pendings:
        opt.finish_update(p, totals)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("name,kwargs", SHARD_CASES)
def test_sharded_update_equals_whole(name, kwargs, data):
    rows = data.draw(st.integers(1, 6), label="rows")
    cols = data.draw(st.integers(1, 7), label="cols")
    size = rows * cols
    parts = data.draw(st.sampled_from([2, 3, 5]), label="parts")
    cuts = data.draw(st.lists(st.integers(0, size), min_size=parts - 1, max_size=parts - 1),
                     label="cuts")
    dtype = data.draw(st.sampled_from([np.float32, np.float64]), label="dtype")
    bounds = _shard_bounds(size, cuts)
    rng = np.random.default_rng(size + parts)
    w0 = rng.standard_normal((rows, cols)).astype(dtype)
    grads = rng.standard_normal((STEPS, rows, cols)).astype(dtype)

    whole_opt = opt_mod.create(name, **kwargs)
    whole = w0.copy()
    whole_state = whole_opt.create_state(7, whole)

    shard_opt = opt_mod.create(name, **kwargs)
    sharded = w0.copy()
    flat = sharded.reshape(-1)
    shard_states = [shard_opt.create_state(7, flat[a:b]) for a, b in bounds]

    for grad in grads:
        whole_opt.update(7, whole, grad, whole_state)
        _sharded_step(shard_opt, 7, flat, grad.reshape(-1), bounds, shard_states)

    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(sharded, whole, **tol)
    for name_ in whole_opt.elementwise_state_names:
        joined = np.concatenate([s[name_] for s in shard_states])
        np.testing.assert_allclose(joined, whole_state[name_].reshape(-1), **tol)
    assert all(s["t"].tolist() == [STEPS] for s in shard_states)
    assert shard_opt.num_update == whole_opt.num_update == STEPS


def test_whole_state_sliced_into_shards_continues_identically():
    opt_a = opt_mod.LAMB(learning_rate=0.05, wd=0.01)
    opt_b = opt_mod.LAMB(learning_rate=0.05, wd=0.01)
    rng = np.random.default_rng(3)
    weight = rng.standard_normal(10)
    grads = rng.standard_normal((4, 10))
    state = opt_a.create_state(0, weight)
    for g in grads[:2]:
        opt_a.update(0, weight, g, state)
    other = weight.copy()
    bounds = [(0, 3), (3, 4), (4, 10)]
    shard_states = [{"mean": state["mean"][a:b].copy(), "var": state["var"][a:b].copy(),
                     "t": state["t"].copy()} for a, b in bounds]
    for g in grads[2:]:
        opt_a.update(0, weight, g, state)
        _sharded_step(opt_b, 0, other, g, bounds, shard_states)
    np.testing.assert_allclose(other, weight, rtol=1e-13)


def test_lamb_partials_are_sums_of_squares():
    opt = opt_mod.LAMB(learning_rate=0.1, wd=0.0, bias_correction=False, epsilon=1e-6)
    assert opt.num_partials == 2
    weight = np.array([3.0, 4.0])
    pending = opt.begin_update(0, weight, np.array([1.0, -1.0]), opt.create_state(0, weight))
    assert pending.partials.dtype == np.float64 and pending.partials.shape == (2,)
    r = 0.1 / (np.sqrt(0.001) + 1e-6)
    np.testing.assert_allclose(pending.partials, [25.0, 2 * r * r])
    np.testing.assert_array_equal(weight, [3.0, 4.0])  # untouched until finish
    assert not pending.done
    opt.finish_update(pending, np.array([100.0, 2 * r * r]))  # pretend ||w|| = 10
    ratio = 10.0 / (np.sqrt(2) * r)
    np.testing.assert_allclose(weight, [3.0 - 0.1 * ratio * r, 4.0 + 0.1 * ratio * r])
    assert pending.done


@pytest.mark.parametrize("name", ["sgd", "nag", "adam", "adamw", "rmsprop"])
def test_single_phase_optimizers_update_in_begin(name):
    opt = opt_mod.create(name, learning_rate=0.1)
    assert opt.num_partials == 0
    weight = np.ones(3)
    pending = opt.begin_update(0, weight, np.ones(3), opt.create_state(0, weight))
    assert pending.partials is None and pending.done
    assert np.all(weight < 1)
    opt.finish_update(pending, None)
    with pytest.raises(ValueError):
        opt.finish_update(pending, np.zeros(2))


def test_finish_errors():
    opt = opt_mod.LAMB()
    weight = np.ones(3)
    state = opt.create_state(0, weight)
    pending = opt.begin_update(0, weight, np.ones(3), state)
    with pytest.raises(ValueError):
        opt.finish_update(pending, np.zeros(3))
    with pytest.raises(ValueError):
        opt.finish_update(pending, None)
    with pytest.raises(OptimizerError):
        opt_mod.LAMB().finish_update(pending, pending.partials)
    opt.finish_update(pending, pending.partials)
    with pytest.raises(OptimizerError):
        opt.finish_update(pending, pending.partials)
    with pytest.raises(TypeError):
        opt.finish_update("not pending", None)


def test_counts_are_per_key():
    rng = np.random.default_rng(5)
    opt = opt_mod.Adam(learning_rate=0.05)
    wa, wb = rng.standard_normal(4), rng.standard_normal(4)
    wb0 = wb.copy()
    sa, sb = opt.create_state("a", wa), opt.create_state("b", wb)
    for _ in range(3):
        opt.update("a", wa, rng.standard_normal(4), sa)
    gb = rng.standard_normal(4)
    opt.update("b", wb, gb, sb)
    assert sa["t"].tolist() == [3] and sb["t"].tolist() == [1]
    assert opt.num_update == 3
    # b's first step has t = 1, whatever a did.
    lr_t = 0.05 * np.sqrt(1 - 0.999) / (1 - 0.9)
    m, v = 0.1 * gb, 0.001 * gb * gb
    np.testing.assert_allclose(wb, wb0 - lr_t * m / (np.sqrt(v) + 1e-8), rtol=1e-12)


def test_saved_state_and_config_resume_exactly():
    rng = np.random.default_rng(11)
    grads = rng.standard_normal((6, 5)).astype(np.float32)
    sched = opt_mod.FactorScheduler(step=2, factor=0.5, base_lr=0.05)
    opt = opt_mod.Adam(lr_scheduler=sched, wd=0.01)
    opt.set_lr_mult({"w": 0.5})
    straight = np.linspace(-1, 1, 5, dtype=np.float32)
    resumed = straight.copy()
    state = opt.create_state("w", straight)
    for g in grads:
        opt.update("w", straight, g, state)

    first = opt_mod.from_config(json.loads(json.dumps(opt.get_config())))
    st1 = first.create_state("w", resumed)
    for g in grads[:3]:
        first.update("w", resumed, g, st1)
    buf = io.BytesIO()
    np.savez(buf, **st1)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as saved:
        st2 = {name: saved[name].copy() for name in saved.files}
    # A fresh optimizer: num_update catches up from the restored count.
    second = opt_mod.from_config(json.loads(json.dumps(first.get_config())))
    for g in grads[3:]:
        second.update("w", resumed, g, st2)
    np.testing.assert_array_equal(resumed, straight)
    assert st2["t"].tolist() == [6]


def test_scheduler_sees_num_update_after_increment():
    sched = opt_mod.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    opt = opt_mod.SGD(lr_scheduler=sched)
    weight = np.zeros(1)
    state = opt.create_state(0, weight)
    deltas = []
    for _ in range(5):
        before = weight.copy()
        opt.update(0, weight, np.ones(1), state)
        deltas.append(float(before[0] - weight[0]))
    assert deltas == [1.0, 1.0, 0.5, 0.5, 0.25]
    # A key's first update uses the optimizer-wide num_update, as in MXNet.
    other = np.zeros(1)
    opt.update(1, other, np.ones(1), opt.create_state(1, other))
    assert other[0] == -0.25 and opt.num_update == 5


def test_lr_and_wd_multipliers():
    opt = opt_mod.SGD(learning_rate=0.1, wd=0.5)
    opt.set_lr_mult({"a": 0.5, 3: 2.0})
    opt.set_wd_mult({"a": 0.0})
    out = {}
    for key in ("a", 3, "z"):
        weight = np.ones(1)
        opt.update(key, weight, np.ones(1), opt.create_state(key, weight))
        out[key] = weight[0]
    assert out["a"] == pytest.approx(1 - 0.05 * 1.0)
    assert out[3] == pytest.approx(1 - 0.2 * (1 + 0.5))
    assert out["z"] == pytest.approx(1 - 0.1 * (1 + 0.5))
    with pytest.raises(ValueError):
        opt.set_lr_mult({"a": -1.0})
    with pytest.raises(TypeError):
        opt.set_wd_mult({1.5: 1.0})


def test_bad_inputs():
    opt = opt_mod.Adam()
    weight = np.ones(4, np.float32)
    state = opt.create_state(0, weight)
    with pytest.raises(TypeError):
        opt.create_state(0, np.ones(4, np.int32))
    with pytest.raises(TypeError):
        opt.update(0, [1.0, 2.0], np.ones(2), state)
    with pytest.raises(ValueError):
        opt.update(0, weight, np.ones(5, np.float32), state)
    with pytest.raises(OptimizerError):
        opt.update(0, weight, np.ones(4, np.float32), {"mean": state["mean"], "t": state["t"]})
    with pytest.raises(OptimizerError):
        opt.update(0, weight, np.ones(4, np.float32), dict(state, var=np.zeros(4)))
    with pytest.raises(OptimizerError):
        opt.update(0, weight, np.ones(4, np.float32), dict(state, var=np.zeros(3, np.float32)))
    with pytest.raises(OptimizerError):
        opt.update(0, weight, np.ones(4, np.float32), dict(state, t=np.zeros(1)))
    with pytest.raises(OptimizerError):
        opt.update(0, weight, np.ones(4, np.float32), [state["mean"], state["var"]])
    frozen = weight.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        opt.update(0, frozen, np.ones(4, np.float32), state)
    assert state["t"].tolist() == [0]  # nothing was counted
    np.testing.assert_array_equal(weight, 1)
