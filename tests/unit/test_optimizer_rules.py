"""Update rules of mpikv.optimizer against step-by-step float64 references.

Each reference below is written from MXNet 1.9's formulas, independently of
the module: a plain loop over steps in float64. After every step the
reference rounds the weight to the tested dtype, as the store keeps it.
"""

import itertools
import math

import numpy as np
import pytest

import mpikv.optimizer as opt_mod

STEPS = 5
SIZE = 17
TOL = {np.float64: dict(rtol=1e-10, atol=1e-12),
       np.float32: dict(rtol=2e-5, atol=2e-6),
       np.float16: dict(rtol=4e-3, atol=4e-3)}


def _clip(x, c):
    return np.clip(x, -c, c) if c is not None and c > 0 else x


def ref_sgd(w, grads, *, learning_rate, momentum=0.0, wd=0.0, rescale_grad=1.0,
            clip_gradient=None, rnd):
    mom = np.zeros_like(w)
    for g in grads:
        g = _clip(rescale_grad * g, clip_gradient)
        if momentum == 0:
            w = w - learning_rate * (g + wd * w)
        else:
            mom = momentum * mom - learning_rate * (g + wd * w)
            w = w + mom
        w = rnd(w)
        yield w


def ref_nag(w, grads, *, learning_rate, momentum=0.0, wd=0.0, rescale_grad=1.0,
            clip_gradient=None, rnd):
    # MXNet's documented form; equal to its kernel for a constant rate.
    m = np.zeros_like(w)
    for g in grads:
        g = _clip(rescale_grad * g, clip_gradient) + wd * w
        m = momentum * m + g
        w = rnd(w - learning_rate * (g + momentum * m))
        yield w


def ref_adam(w, grads, *, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
             rescale_grad=1.0, clip_gradient=None, begin_num_update=0, rnd):
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=begin_num_update + 1):
        g = _clip(rescale_grad * g + wd * w, clip_gradient)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        lr_t = learning_rate * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        w = rnd(w - lr_t * m / (np.sqrt(v) + epsilon))
        yield w


def ref_adamw(w, grads, *, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
              eta=1.0, correct_bias=True, rescale_grad=1.0, clip_gradient=None, rnd):
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = _clip(rescale_grad * g, clip_gradient)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        lr_t = learning_rate
        if correct_bias:
            lr_t = learning_rate * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        w = rnd(w - eta * (lr_t * m / (np.sqrt(v) + epsilon) + wd * w))
        yield w


def ref_rmsprop(w, grads, *, learning_rate, rho=0.9, momentum=0.9, epsilon=1e-8,
                centered=False, clip_weights=None, wd=0.0, rescale_grad=1.0,
                clip_gradient=None, rnd):
    n = np.zeros_like(w)
    g_avg = np.zeros_like(w)
    delta = np.zeros_like(w)
    for g in grads:
        g = _clip(rescale_grad * g + wd * w, clip_gradient)
        n = (1 - rho) * g * g + rho * n
        if centered:
            g_avg = (1 - rho) * g + rho * g_avg
            delta = momentum * delta - learning_rate * g / np.sqrt(n - g_avg * g_avg + epsilon)
            w = w + delta
        else:
            w = w - learning_rate * g / np.sqrt(n + epsilon)
        w = rnd(_clip(w, clip_weights))
        yield w


def ref_lamb(w, grads, *, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-6, wd=0.0,
             lower_bound=None, upper_bound=None, bias_correction=True, rescale_grad=1.0,
             clip_gradient=None, rnd):
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = _clip(rescale_grad * g, clip_gradient)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m, v
        if bias_correction:
            m_hat = m / (1 - beta1 ** t)
            v_hat = v / (1 - beta2 ** t)
        r = m_hat / (np.sqrt(v_hat) + epsilon) + wd * w
        r1 = np.linalg.norm(w)
        r2 = np.linalg.norm(r)
        if lower_bound:
            r1 = max(r1, lower_bound)
        if upper_bound:
            r1 = min(r1, upper_bound)
        ratio = r1 / r2 if r1 != 0 and r2 != 0 else 1.0
        w = rnd(w - learning_rate * ratio * r)
        yield w


REFS = {"sgd": ref_sgd, "nag": ref_nag, "adam": ref_adam, "adamw": ref_adamw,
        "rmsprop": ref_rmsprop, "lamb": ref_lamb}


def _grid(**options):
    names = list(options)
    return [dict(zip(names, values)) for values in itertools.product(*options.values())]


COMMON = _grid(wd=[0.0, 0.1], rescale_grad=[1.0, 0.5], clip_gradient=[None, 0.6])
CASES = (
    [("sgd", dict(learning_rate=0.1, momentum=mo, **c)) for mo in (0.0, 0.9) for c in COMMON]
    + [("nag", dict(learning_rate=0.1, momentum=mo, **c)) for mo in (0.0, 0.9) for c in COMMON]
    + [("adam", dict(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, **c))
       for c in COMMON]
    + [("adamw", dict(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, eta=eta,
                      correct_bias=cb, **c))
       for eta, cb in ((1.0, True), (0.5, False)) for c in COMMON]
    + [("rmsprop", dict(learning_rate=0.02, rho=0.8, momentum=0.7, epsilon=1e-6,
                        centered=centered, clip_weights=cw, **c))
       for centered in (False, True) for cw in (None, 1.2) for c in COMMON]
    + [("lamb", dict(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-6,
                     lower_bound=lb, upper_bound=ub, bias_correction=bc, **c))
       for lb, ub, bc in ((None, None, True), (None, None, False), (5.0, None, True),
                          (None, 2.0, True), (1.0, 3.0, False))
       for c in COMMON]
)


def _data(dtype, seed=0):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(SIZE).astype(dtype)
    grads = rng.standard_normal((STEPS, SIZE)).astype(dtype)
    return w0, grads


def _rounder(dtype):
    return lambda w: w.astype(dtype).astype(np.float64)


def _check_against_reference(name, kwargs, dtype, shape=(SIZE,)):
    w0, grads = _data(dtype)
    expected = REFS[name](w0.astype(np.float64), grads.astype(np.float64),
                          rnd=_rounder(dtype), **kwargs)
    opt = opt_mod.create(name, **kwargs)
    weight = w0.reshape(shape).copy()
    state = opt.create_state("k", weight)
    for step, (grad, want) in enumerate(zip(grads, expected), start=1):
        opt.update("k", weight, grad.reshape(shape), state)
        assert weight.dtype == dtype
        np.testing.assert_allclose(weight.reshape(-1).astype(np.float64), want,
                                   err_msg=f"step {step}", **TOL[dtype])
        assert int(state["t"][0]) == step


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,kwargs", CASES)
def test_matches_reference(name, kwargs, dtype):
    _check_against_reference(name, kwargs, dtype)


@pytest.mark.parametrize("name,kwargs", CASES[::3])
def test_matches_reference_float16(name, kwargs):
    _check_against_reference(name, kwargs, np.float16)


@pytest.mark.parametrize("name", sorted(REFS))
def test_multidimensional_weight(name):
    kwargs = dict(learning_rate=0.05, wd=0.1, clip_gradient=0.6)
    _check_against_reference(name, kwargs, np.float64, shape=(SIZE, 1))


@pytest.mark.parametrize("name", sorted(REFS))
def test_float16_states_are_float32(name):
    opt = opt_mod.create(name, learning_rate=0.05)
    weight = np.ones(4, np.float16)
    state = opt.create_state(0, weight)
    for key in opt.elementwise_state_names:
        assert state[key].dtype == np.float32 and state[key].shape == (4,)
    opt.update(0, weight, np.full(4, 0.5, np.float16), state)
    assert weight.dtype == np.float16
    assert np.all(weight < 1)


def test_defaults_are_mxnet_defaults():
    w0, grads = _data(np.float64)
    for name, lr in (("sgd", 0.01), ("nag", 0.01), ("adam", 0.001), ("adamw", 0.001),
                     ("rmsprop", 0.001), ("lamb", 0.001)):
        opt = opt_mod.create(name)
        assert opt.learning_rate == lr
        weight = w0.copy()
        state = opt.create_state(0, weight)
        expected = list(REFS[name](w0.copy(), grads, learning_rate=lr, rnd=lambda w: w))
        for grad in grads:
            opt.update(0, weight, grad, state)
        np.testing.assert_allclose(weight, expected[-1], rtol=1e-12, atol=1e-14)
    assert opt_mod.RMSProp().state_names == ("n", "t")
    assert opt_mod.RMSProp(centered=True).state_names == ("n", "g", "delta", "t")
    assert opt_mod.SGD().state_names == ("t",)
    assert opt_mod.SGD(momentum=0.9).state_names == ("mom", "t")
    assert opt_mod.Adam().state_names == ("mean", "var", "t")


def test_adam_clips_after_adding_weight_decay():
    # MXNet 1.9 adam_update: clip(rescale*grad + wd*w); one step, t = 1.
    opt = opt_mod.Adam(learning_rate=0.1, wd=1.0, clip_gradient=0.5, beta1=0.5, beta2=0.5)
    weight = np.array([2.0, -2.0, 0.1])
    grad = np.array([0.0, 0.0, 0.0])
    opt.update(0, weight, grad, opt.create_state(0, weight))
    g = np.array([0.5, -0.5, 0.1])
    m, v = 0.5 * g, 0.5 * g * g
    lr_t = 0.1 * math.sqrt(0.5) / 0.5
    np.testing.assert_allclose(weight, [2.0, -2.0, 0.1] - lr_t * m / (np.sqrt(v) + 1e-8))


def test_nag_momentum_holds_the_learning_rate():
    # nag_mom_update: mom = mu*mom - lr*g; w += mu*mom - lr*g (g includes wd*w).
    opt = opt_mod.NAG(learning_rate=0.1, momentum=0.9, wd=0.01)
    weight = np.array([1.0, -1.0])
    state = opt.create_state(0, weight)
    w, mom = weight.copy(), np.zeros(2)
    grads = [np.array([0.3, 0.2]), np.array([-0.1, 0.4]), np.array([0.2, 0.2])]
    for lr, grad in zip((0.1, 0.05, 0.2), grads):
        opt.set_learning_rate(lr)
        opt.update(0, weight, grad, state)
        g = grad + 0.01 * w
        mom = 0.9 * mom - lr * g
        w = w + 0.9 * mom - lr * g
        np.testing.assert_allclose(weight, w, rtol=1e-13)
        np.testing.assert_allclose(state["mom"], mom, rtol=1e-13)


def test_adamw_decay_is_not_scaled_by_learning_rate():
    opt = opt_mod.AdamW(learning_rate=0.0, wd=0.1, eta=0.5)
    weight = np.array([1.0, -2.0])
    opt.update(0, weight, np.array([3.0, 4.0]), opt.create_state(0, weight))
    np.testing.assert_allclose(weight, [1.0 - 0.05, -2.0 + 0.1])


def test_adam_begin_num_update_offsets_the_count():
    w0, grads = _data(np.float64)
    opt = opt_mod.Adam(learning_rate=0.05, begin_num_update=10)
    assert opt.num_update == 10
    weight = w0.copy()
    state = opt.create_state(0, weight)
    assert state["t"].tolist() == [10]
    expected = list(ref_adam(w0.copy(), grads, learning_rate=0.05, begin_num_update=10,
                             rnd=lambda w: w))
    for grad in grads:
        opt.update(0, weight, grad, state)
    np.testing.assert_allclose(weight, expected[-1], rtol=1e-12)
    assert state["t"].tolist() == [10 + STEPS]
    assert opt.num_update == 10 + STEPS


def test_lamb_zero_weight_uses_ratio_one():
    opt = opt_mod.LAMB(learning_rate=0.1, bias_correction=False, epsilon=1e-6)
    weight = np.zeros(3)
    opt.update(0, weight, np.array([1.0, -1.0, 0.0]), opt.create_state(0, weight))
    g = np.array([1.0, -1.0, 0.0])
    r = 0.1 * g / (np.sqrt(0.001 * g * g) + 1e-6)
    np.testing.assert_allclose(weight, -0.1 * r)
