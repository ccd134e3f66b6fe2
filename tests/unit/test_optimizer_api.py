"""mpikv.optimizer API: create/register, configs, argument checks, the updater."""

import json

import numpy as np
import pytest

import mpikv.optimizer as opt_mod
from mpikv.errors import OptimizerError

NAMES = ["adam", "adamw", "lamb", "nag", "rmsprop", "sgd"]
CLASSES = {"sgd": opt_mod.SGD, "nag": opt_mod.NAG, "adam": opt_mod.Adam,
           "adamw": opt_mod.AdamW, "rmsprop": opt_mod.RMSProp, "lamb": opt_mod.LAMB}

NON_DEFAULT = {
    "sgd": dict(momentum=0.8, lazy_update=True),
    "nag": dict(momentum=0.7),
    "adam": dict(beta1=0.8, beta2=0.95, epsilon=1e-6),
    "adamw": dict(eta=0.5, correct_bias=False, epsilon=1e-7),
    "rmsprop": dict(rho=0.8, momentum=0.5, centered=True, clip_weights=3.0),
    "lamb": dict(lower_bound=0.1, upper_bound=10.0, bias_correction=False),
}


@pytest.mark.parametrize("name", NAMES)
def test_create_is_case_insensitive(name):
    for spelling in (name, name.upper(), name.capitalize()):
        opt = opt_mod.create(spelling, learning_rate=0.5)
        assert type(opt) is CLASSES[name] and opt.lr == 0.5 and opt.name == name


def test_create_errors():
    with pytest.raises(ValueError) as err:
        opt_mod.create("adagrad")
    for name in NAMES:
        assert name in str(err.value)
    with pytest.raises(TypeError):
        opt_mod.create(opt_mod.SGD)
    with pytest.raises(TypeError):
        opt_mod.create("sgd", gamma=0.1)


def test_register():
    with pytest.raises(ValueError):
        opt_mod.create("halve")

    @opt_mod.register
    class Halve(opt_mod.Optimizer):
        name = "Halve"

        def _step(self, w, g, state, lr, wd, t):
            return w / 2

    try:
        opt = opt_mod.create("HALVE")
        weight = np.full(2, 4.0)
        opt.update(0, weight, np.zeros(2), opt.create_state(0, weight))
        assert weight.tolist() == [2.0, 2.0]
        assert opt_mod.from_config(opt.get_config()).get_config() == opt.get_config()
        with pytest.warns(UserWarning):
            opt_mod.register(type("Halve", (opt_mod.Optimizer,), {"name": "halve"}))
        with pytest.raises(TypeError):
            opt_mod.register(int)
    finally:
        assert opt_mod.unregister("HALVE") is not None
    with pytest.raises(ValueError):
        opt_mod.create("halve")
    assert opt_mod.unregister("halve") is None


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip_and_equivalence(name):
    sched = opt_mod.MultiFactorScheduler(step=[2, 4], factor=0.5, base_lr=0.2)
    opt = opt_mod.create(name, lr_scheduler=sched, wd=0.01, rescale_grad=0.5,
                         clip_gradient=2.0, begin_num_update=1, **NON_DEFAULT[name])
    opt.set_lr_mult({"b": 0.5, 1: 2.0})
    opt.set_wd_mult({1: 0.0})
    config = opt.get_config()
    assert config["name"] == name and config["lr_scheduler"]["name"] == "multifactor"
    for key, value in NON_DEFAULT[name].items():
        assert config[key] == value
    assert config["lr_mult"] == [[1, 2.0], ["b", 0.5]]
    again = opt_mod.from_config(json.loads(json.dumps(config)))
    assert type(again) is type(opt) and again.get_config() == config
    assert opt_mod.Optimizer.from_config(config).get_config() == config

    rng = np.random.default_rng(2)
    grads = rng.standard_normal((5, 6))
    results = []
    for o in (opt, again):
        ws = {k: np.linspace(-1, 1, 6) for k in (1, "b")}
        states = {k: o.create_state(k, w) for k, w in ws.items()}
        for g in grads:
            for k in ws:
                o.update(k, ws[k], g, states[k])
        results.append(ws)
    for k in (1, "b"):
        np.testing.assert_array_equal(results[0][k], results[1][k])


def test_from_config_errors():
    with pytest.raises(ValueError):
        opt_mod.from_config({"learning_rate": 0.1})
    with pytest.raises(ValueError):
        opt_mod.from_config({"name": "nadam"})
    with pytest.raises(ValueError):
        opt_mod.from_config({"name": "sgd", "lr_mult": [1, 2]})


@pytest.mark.parametrize("name,kwargs,exc", [
    ("sgd", dict(learning_rate=-0.1), ValueError),
    ("sgd", dict(learning_rate="0.1"), TypeError),
    ("sgd", dict(learning_rate=float("inf")), ValueError),
    ("sgd", dict(wd=-1.0), ValueError),
    ("sgd", dict(rescale_grad=-1.0), ValueError),
    ("sgd", dict(clip_gradient=float("nan")), ValueError),
    ("sgd", dict(begin_num_update=-1), ValueError),
    ("sgd", dict(begin_num_update=1.0), TypeError),
    ("sgd", dict(momentum=1.0), ValueError),
    ("sgd", dict(momentum=-0.1), ValueError),
    ("sgd", dict(lazy_update=1), TypeError),
    ("sgd", dict(lr_scheduler="cosine"), TypeError),
    ("nag", dict(momentum=True), TypeError),
    ("adam", dict(beta1=1.0), ValueError),
    ("adam", dict(beta2=-0.5), ValueError),
    ("adam", dict(epsilon=0.0), ValueError),
    ("adamw", dict(eta=-1.0), ValueError),
    ("adamw", dict(correct_bias="yes"), TypeError),
    ("rmsprop", dict(rho=1.0), ValueError),
    ("rmsprop", dict(momentum=1.5), ValueError),
    ("rmsprop", dict(epsilon=-1e-8), ValueError),
    ("rmsprop", dict(centered=None), TypeError),
    ("rmsprop", dict(rho=0.8, gamma1=0.8), ValueError),       # one name of each pair
    ("rmsprop", dict(momentum=0.5, gamma2=0.5), ValueError),
    ("rmsprop", dict(gamma1=1.0), ValueError),
    ("lamb", dict(lower_bound=5.0, upper_bound=1.0), ValueError),
    ("lamb", dict(epsilon=0), ValueError),
    ("lamb", dict(beta1=1.2), ValueError),
])
def test_invalid_arguments(name, kwargs, exc):
    with pytest.raises(exc):
        opt_mod.create(name, **kwargs)


def test_rmsprop_takes_mxnet_1_9_names():
    """MXNet 1.9 spells rho gamma1 and momentum gamma2: the same optimizer, the same step."""
    old = opt_mod.create("rmsprop", learning_rate=0.01, gamma1=0.8, gamma2=0.5, centered=True)
    new = opt_mod.RMSProp(learning_rate=0.01, rho=0.8, momentum=0.5, centered=True)
    assert old.get_config() == new.get_config()
    assert (old.rho, old.momentum) == (0.8, 0.5)
    weights = []
    for opt in (old, new):
        w = np.linspace(-1.0, 1.0, 5)
        state = opt.create_state(0, w)
        for step in range(3):
            opt.update(0, w, np.full(5, 0.3 * (step + 1)), state)
        weights.append(w)
    np.testing.assert_array_equal(weights[0], weights[1])
    assert weights[0].tolist() != np.linspace(-1.0, 1.0, 5).tolist()


def test_clip_values_at_or_below_zero_mean_no_clipping():
    results = []
    for clip in (None, 0.0, -1.0):
        opt = opt_mod.SGD(learning_rate=1.0, clip_gradient=clip)
        weight = np.zeros(2)
        opt.update(0, weight, np.array([5.0, -5.0]), opt.create_state(0, weight))
        results.append(weight.tolist())
    assert results == [[-5.0, 5.0]] * 3
    lamb = opt_mod.LAMB(lower_bound=0.0, upper_bound=-1.0)
    assert lamb.trust_ratio([4.0, 1.0]) == 2.0
    rms = opt_mod.RMSProp(learning_rate=10.0, clip_weights=0.0)
    weight = np.zeros(1)
    rms.update(0, weight, np.ones(1), rms.create_state(0, weight))
    assert abs(weight[0]) > 1


def test_positional_arguments_follow_mxnet():
    for cls in (opt_mod.Adam, opt_mod.AdamW, opt_mod.RMSProp, opt_mod.LAMB):
        assert cls(0.25).lr == 0.25 and cls().lr == 0.001
    assert opt_mod.SGD(0.9).momentum == 0.9 and opt_mod.NAG(0.8).momentum == 0.8
    assert opt_mod.SGD().lr == opt_mod.NAG().lr == 0.01


def test_learning_rate_property_and_setter():
    opt = opt_mod.SGD(learning_rate=0.1)
    assert opt.learning_rate == 0.1
    opt.set_learning_rate(0.2)
    assert opt.learning_rate == 0.2 and opt.get_config()["learning_rate"] == 0.2
    with pytest.raises(ValueError):
        opt.set_learning_rate(-1.0)


def test_updater_keeps_states_per_key():
    rng = np.random.default_rng(9)
    grads = rng.standard_normal((4, 3))
    upd = opt_mod.get_updater(opt_mod.SGD(learning_rate=0.1, momentum=0.9))
    manual_opt = opt_mod.SGD(learning_rate=0.1, momentum=0.9)
    w_a, w_b = np.ones(3), np.zeros(3)
    m_a, m_b = np.ones(3), np.zeros(3)
    s_a, s_b = manual_opt.create_state("a", m_a), manual_opt.create_state(0, m_b)
    for i, g in enumerate(grads):
        upd("a", g, w_a)
        manual_opt.update("a", m_a, g, s_a)
        if i % 2:
            upd([0], [g], [w_b])
            manual_opt.update(0, m_b, g, s_b)
    np.testing.assert_array_equal(w_a, m_a)
    np.testing.assert_array_equal(w_b, m_b)
    states = upd.get_states()
    assert set(states) == {"a", 0}
    assert states["a"]["t"].tolist() == [4] and states[0]["t"].tolist() == [2]
    np.testing.assert_array_equal(states["a"]["mom"], s_a["mom"])

    states["a"]["mom"][:] = 0  # a copy: the updater's state is untouched
    assert np.any(upd.states["a"]["mom"] != 0)

    fresh = opt_mod.get_updater(opt_mod.SGD(learning_rate=0.1, momentum=0.9))
    fresh.set_states(upd.get_states())
    w_c = w_a.copy()
    upd("a", grads[0], w_a)
    fresh("a", grads[0], w_c)
    np.testing.assert_array_equal(w_a, w_c)
    with pytest.raises(OptimizerError):
        fresh.set_states({"a": {"t": np.zeros(1, np.int64)}})
    with pytest.raises(ValueError):
        upd(["a", 0], [grads[0]], [w_a])
    with pytest.raises(TypeError):
        opt_mod.get_updater("sgd")


def test_state_is_plain_arrays():
    for name in NAMES:
        opt = opt_mod.create(name, **NON_DEFAULT[name])
        state = opt.create_state(0, np.ones((2, 3), np.float64))
        assert tuple(state) == opt.state_names and opt.state_names[-1] == opt_mod.COUNT
        for key, arr in state.items():
            assert isinstance(arr, np.ndarray) and arr.dtype != object
        assert state["t"].dtype == np.int64 and state["t"].shape == (1,)
        assert all(state[k].shape == (2, 3) for k in opt.elementwise_state_names)
