"""MXNet optimizers and schedules as mpikv's, and back (pure, one process)."""

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")

import mpikv  # noqa: E402
from mpikv import optimizer as mo  # noqa: E402
from mpikv.mxnet import optimizers  # noqa: E402

COMMON = {"learning_rate": 0.05, "wd": 0.01, "rescale_grad": 0.25, "clip_gradient": 2.0,
          "begin_num_update": 3, "multi_precision": True}


@pytest.mark.parametrize("make,want", [
    (lambda: mx.optimizer.SGD(momentum=0.9, lazy_update=False, **COMMON),
     {"name": "sgd", "momentum": 0.9, "lazy_update": False}),
    (lambda: mx.optimizer.ccSGD(momentum=0.5, **COMMON),
     {"name": "sgd", "momentum": 0.5, "lazy_update": True}),
    (lambda: mx.optimizer.NAG(momentum=0.8, **COMMON),
     {"name": "nag_mxnet", "momentum": 0.8, "lazy_update": False}),
    (lambda: mx.optimizer.Adam(beta1=0.8, beta2=0.99, epsilon=1e-6, **COMMON),
     {"name": "adam", "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6, "lazy_update": True}),
    (lambda: mx.optimizer.RMSProp(gamma1=0.7, gamma2=0.6, epsilon=1e-5, centered=True,
                                  clip_weights=3.0, **COMMON),
     {"name": "rmsprop", "rho": 0.7, "momentum": 0.6, "epsilon": 1e-5, "centered": True,
      "clip_weights": 3.0}),
    (lambda: mx.optimizer.LAMB(beta1=0.8, epsilon=1e-7, lower_bound=0.1, upper_bound=5.0,
                               bias_correction=False, **COMMON),
     {"name": "lamb", "beta1": 0.8, "beta2": 0.999, "epsilon": 1e-7, "lower_bound": 0.1,
      "upper_bound": 5.0, "bias_correction": False}),
], ids=["SGD", "ccSGD", "NAG", "Adam", "RMSProp", "LAMB"])
def test_every_supported_kind_and_its_hyperparameters(make, want):
    mx_opt = make()
    config = optimizers.to_mpikv(mx_opt).get_config()
    expected = {"learning_rate": 0.05, "wd": 0.01, "rescale_grad": 0.25, "clip_gradient": 2.0,
                "begin_num_update": 3, "multi_precision": True, "lr_scheduler": None,
                "lr_mult": [], "wd_mult": [], **want}
    assert config == expected
    back = optimizers.to_mxnet(config)
    assert type(back).__name__ == {"ccSGD": "SGD"}.get(type(mx_opt).__name__,
                                                        type(mx_opt).__name__)
    assert optimizers.to_mpikv(back).get_config() == config


@pytest.mark.parametrize("name", sorted(set(mx.optimizer.Optimizer.opt_registry) -
                                         {"sgd", "ccsgd", "nag", "adam", "rmsprop", "lamb"}))
def test_other_kinds_run_as_mxnet_rules(name):
    """Every other optimizer of mx.optimizer (MXNet's test optimizer too) becomes an
    MXNetRule: its class and own attributes in the config, a copy of the object run."""
    opt = mx.optimizer.create(name, learning_rate=0.2, wd=0.01, rescale_grad=0.5)
    mp = optimizers.to_mpikv(opt)
    assert isinstance(mp, optimizers.MXNetRule)
    config = mp.get_config()
    assert config["kind"] == optimizers.class_path(type(opt))
    assert (config["learning_rate"], config["wd"], config["rescale_grad"]) == (0.2, 0.01, 0.5)
    assert config["attributes"] == optimizers.own_attributes(opt)
    assert mp._runner is not opt and type(mp._runner) is type(opt)
    back = optimizers.to_mxnet(config)
    assert type(back) is type(opt)
    assert optimizers.to_mpikv(back).get_config() == config


def test_a_subclass_runs_its_own_rule():
    """A subclass of a mapped class is not mapped (its update may differ): MXNet runs it."""
    class Doubled(mx.optimizer.SGD):
        def update_multi_precision(self, index, weight, grad, state):
            super().update_multi_precision(index, weight, grad * 2, state)
    mp = optimizers.to_mpikv(Doubled(learning_rate=0.5))
    assert isinstance(mp, optimizers.MXNetRule)
    kv = mpikv.create("local")
    kv.init(0, np.ones(3, np.float32))
    kv.set_optimizer(mp)
    kv.push(0, np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out, 0.0)     # 1 - 0.5 * 2
    want = mx.nd.ones(3)
    ref = Doubled(learning_rate=0.5)
    ref.aggregate_num = 0     # (MXNet's updater would hand SGD lists of several keys)
    mx.optimizer.get_updater(ref)(0, mx.nd.ones(3), want)
    np.testing.assert_array_equal(out, want.asnumpy())


def _lrs(sched, updates):
    return [sched(n) for n in updates]


@pytest.mark.parametrize("make", [
    lambda: mx.lr_scheduler.FactorScheduler(step=3, factor=0.5, base_lr=0.2,
                                            stop_factor_lr=0.02),
    lambda: mx.lr_scheduler.FactorScheduler(step=2, factor=0.9, base_lr=0.1, warmup_steps=3,
                                            warmup_begin_lr=0.01),
    lambda: mx.lr_scheduler.MultiFactorScheduler(step=[2, 5, 9], factor=0.3, base_lr=0.1),
    lambda: mx.lr_scheduler.PolyScheduler(max_update=12, base_lr=0.1, pwr=3, final_lr=0.01,
                                          warmup_steps=2, warmup_mode="constant",
                                          warmup_begin_lr=0.05),
    lambda: mx.lr_scheduler.CosineScheduler(max_update=10, base_lr=0.1, final_lr=0.001),
], ids=["factor", "factor-warmup", "multifactor", "poly-warmup", "cosine"])
@pytest.mark.parametrize("advanced", [0, 7])
def test_schedules_give_mxnets_rates(make, advanced):
    """From a fresh schedule, or one MXNet already advanced (its base_lr changed in
    place), the mpikv schedule gives MXNet's rates from there on; and back."""
    sched = make()
    for n in range(1, advanced + 1):
        sched(n)
    mine = optimizers.scheduler_from_mxnet(sched)
    updates = list(range(advanced, 16))
    want = _lrs(sched, updates)
    assert _lrs(mine, updates) == pytest.approx(want, rel=1e-12)
    back = optimizers.scheduler_to_mxnet(mine.get_config())
    assert _lrs(back, range(1, 16)) == pytest.approx(_lrs(make(), range(1, 16)), rel=1e-12)


def test_multipliers_are_found_as_mxnet_finds_them():
    """Gap 4: a Gluon Parameter's (param_dict), else the optimizer's by key, else by name."""
    opt = mx.optimizer.SGD(param_idx2name={0: "fc_weight", 1: "fc_bias"})
    assert optimizers.multiplier(opt, 1, "wd_mult") == 0.0        # MXNet: no decay for biases
    assert optimizers.multiplier(opt, 0, "wd_mult") == 1.0
    opt.lr_mult = {"fc_weight": 0.5, 7: 3.0}
    assert optimizers.multiplier(opt, 0, "lr_mult") == 0.5
    assert optimizers.multiplier(opt, 7, "lr_mult") == 3.0
    assert optimizers.multiplier(opt, "fc_weight", "lr_mult") == 0.5

    class Param:
        lr_mult, wd_mult = 0.25, 4.0
    opt.param_dict = {0: Param()}
    assert optimizers.multiplier(opt, 0, "lr_mult") == 0.25
    assert optimizers.multiplier(opt, 0, "wd_mult") == 4.0
    assert optimizers.multiplier(opt, 5, "lr_mult") == 1.0


def test_the_follower_copies_what_changed():
    """Gap 5: the object's later changes reach the mpikv optimizer; the count stays."""
    mx_opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)
    mp = optimizers.to_mpikv(mx_opt)
    follower = optimizers.Follower(mx_opt, mp)
    mp.num_update = 5
    mx_opt.set_learning_rate(0.01)
    mx_opt.rescale_grad = 1 / 32
    mx_opt.momentum = 0.5
    mx_opt.lr_mult = {3: 2.0}
    follower.sync([3, 4])
    config = mp.get_config()
    assert (config["learning_rate"], config["rescale_grad"], config["momentum"]) == (
        0.01, 1 / 32, 0.5)
    assert mp.lr_mult == {3: 2.0} and mp.num_update == 5
    follower.written_back()
    assert mx_opt.num_update == 5
    mx_opt.lr_mult = {}
    follower.sync([3])
    assert mp.lr_mult == {}
    mx_opt.lr_scheduler = mx.lr_scheduler.CosineScheduler(max_update=8, base_lr=0.2)
    follower.sync()
    assert mp.lr_scheduler.get_config()["name"] == "cosine" and mp.learning_rate == \
        pytest.approx(mx_opt.lr_scheduler(5))


def test_mxnets_nag_in_place():
    """MXNet 1.9.1's NAG updates the momentum from the new weight (in place): the
    adapter's rule gives its values, step after step, where mpikv's own NAG does not."""
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(50).astype(np.float32)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(5)]
    mx_opt = mx.optimizer.NAG(learning_rate=0.1, momentum=0.9, wd=0.05, rescale_grad=0.5,
                              clip_gradient=0.4)
    updater = mx.optimizer.get_updater(mx_opt)
    ref = mx.nd.array(w0)
    mine, plain = optimizers.to_mpikv(mx_opt), mo.NAG(learning_rate=0.1, momentum=0.9,
                                                       wd=0.05, rescale_grad=0.5,
                                                       clip_gradient=0.4)
    w, w_plain = w0.copy(), w0.copy()
    s, s_plain = mine.create_state(0, w), plain.create_state(0, w_plain)
    for g in grads:
        updater(0, mx.nd.array(g), ref)
        mine.update(0, w, g, s)
        plain.update(0, w_plain, g, s_plain)
        np.testing.assert_allclose(w, ref.asnumpy(), rtol=1e-6, atol=1e-7)
    assert np.abs(w_plain - ref.asnumpy()).max() > 1e-4


def test_a_schedule_comes_back_with_its_rate():
    """MXNet's Adam sets a schedule's base_lr to its learning_rate (default 0.001): the
    rebuilt optimizer must pass the schedule's own rate."""
    mx_opt = mx.optimizer.Adam(learning_rate=0.01,
                               lr_scheduler=mx.lr_scheduler.FactorScheduler(2, 0.7))
    back = optimizers.to_mxnet(optimizers.to_mpikv(mx_opt).get_config())
    assert back.lr_scheduler.base_lr == 0.01
    back.num_update = 6
    assert back.learning_rate == pytest.approx(0.01 * 0.7 ** 2)
