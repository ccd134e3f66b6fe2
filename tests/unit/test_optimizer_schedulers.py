"""Learning-rate schedulers: values, MXNet's stateful semantics, configs, checks."""

import json
import math
import warnings

import pytest

import mpikv.optimizer as opt_mod
from mpikv.errors import OptimizerError
from mpikv.optimizer import (CosineScheduler, FactorScheduler, MultiFactorScheduler,
                             PolyScheduler, lr_scheduler_from_config)


def _warmup(n, base, steps, begin, mode):
    if mode == "constant":
        return begin
    return begin + (base - begin) * n / steps


class MXFactor:
    """MXNet 1.9's stateful FactorScheduler loop, as documented."""

    def __init__(self, step, factor, stop, base, warmup=0, begin=0.0, mode="linear"):
        self.step, self.factor, self.stop, self.base = step, factor, stop, base
        self.warmup, self.begin, self.mode, self.count = warmup, begin, mode, 0

    def __call__(self, n):
        if n < self.warmup:
            return _warmup(n, self.base, self.warmup, self.begin, self.mode)
        while n > self.count + self.step:
            self.count += self.step
            self.base *= self.factor
            if self.base < self.stop:
                self.base = self.stop
        return self.base


class MXMultiFactor:
    def __init__(self, steps, factor, base, warmup=0, begin=0.0, mode="linear"):
        self.steps, self.factor, self.base, self.cur = steps, factor, base, 0
        self.warmup, self.begin, self.mode = warmup, begin, mode

    def __call__(self, n):
        if n < self.warmup:
            return _warmup(n, self.base, self.warmup, self.begin, self.mode)
        while self.cur < len(self.steps) and n > self.steps[self.cur]:
            self.cur += 1
            self.base *= self.factor
        return self.base


class MXDecay:
    """Cosine (pwr None) or poly decay, remembering the last value like MXNet."""

    def __init__(self, max_update, base, final, pwr=None, warmup=0, begin=0.0, mode="linear"):
        self.max_update, self.orig, self.final, self.pwr = max_update, base, final, pwr
        self.warmup, self.begin, self.mode, self.value = warmup, begin, mode, base

    def __call__(self, n):
        if n < self.warmup:
            return _warmup(n, self.orig, self.warmup, self.begin, self.mode)
        if n <= self.max_update:
            p = (n - self.warmup) / (self.max_update - self.warmup)
            shape = (1 + math.cos(math.pi * p)) / 2 if self.pwr is None else (1 - p) ** self.pwr
            self.value = self.final + (self.orig - self.final) * shape
        return self.value


PAIRS = [
    (FactorScheduler(step=7, factor=0.5, stop_factor_lr=1e-3, base_lr=0.1),
     MXFactor(7, 0.5, 1e-3, 0.1)),
    (FactorScheduler(step=1, factor=0.9, base_lr=1.0, warmup_steps=5, warmup_begin_lr=0.1),
     MXFactor(1, 0.9, 1e-8, 1.0, 5, 0.1)),
    (FactorScheduler(step=3, factor=1.0, stop_factor_lr=0.5, base_lr=0.2),
     MXFactor(3, 1.0, 0.5, 0.2)),
    (MultiFactorScheduler(step=[4, 9, 30], factor=0.3, base_lr=2.0, warmup_steps=3,
                          warmup_begin_lr=0.5, warmup_mode="constant"),
     MXMultiFactor([4, 9, 30], 0.3, 2.0, 3, 0.5, "constant")),
    (CosineScheduler(max_update=40, base_lr=0.5, final_lr=0.01, warmup_steps=6,
                     warmup_begin_lr=0.05),
     MXDecay(40, 0.5, 0.01, None, 6, 0.05)),
    (PolyScheduler(max_update=25, base_lr=0.3, pwr=3, final_lr=0.02),
     MXDecay(25, 0.3, 0.02, 3.0)),
]


@pytest.mark.parametrize("pure,stateful", PAIRS)
def test_pure_schedule_matches_mxnet_stateful_loop(pure, stateful):
    for n in range(60):
        assert pure(n) == pytest.approx(stateful(n), rel=1e-12, abs=1e-15), n


def test_factor_values():
    f = FactorScheduler(step=10, factor=0.5, base_lr=1.0)
    assert [f(n) for n in (0, 1, 10, 11, 20, 21, 31)] == [1, 1, 1, 0.5, 0.5, 0.25, 0.125]
    floor = FactorScheduler(step=10, factor=0.5, stop_factor_lr=0.3, base_lr=1.0)
    assert floor(21) == 0.3 and floor(10 ** 9) == 0.3
    warm = FactorScheduler(step=10, base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2)
    assert [warm(n) for n in (0, 2, 4)] == pytest.approx([0.2, 0.6, 1.0])
    const = FactorScheduler(step=10, base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2,
                            warmup_mode="constant")
    assert const(3) == 0.2 and const(4) == 1.0


def test_multifactor_cosine_poly_values():
    m = MultiFactorScheduler(step=[3, 7], factor=0.1, base_lr=1.0)
    assert [m(n) for n in (0, 3, 4, 7, 8, 100)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    c = CosineScheduler(max_update=10, base_lr=1.0, final_lr=0.0)
    assert [c(n) for n in (0, 5, 10, 15)] == pytest.approx([1.0, 0.5, 0.0, 0.0], abs=1e-15)
    cw = CosineScheduler(max_update=10, base_lr=1.0, warmup_steps=2)
    assert [cw(n) for n in (0, 1, 2, 6)] == pytest.approx([0.0, 0.5, 1.0, 0.5])
    p = PolyScheduler(max_update=10, base_lr=1.0, pwr=2)
    assert [p(n) for n in (0, 5, 10, 11)] == pytest.approx([1.0, 0.25, 0.0, 0.0])


@pytest.mark.parametrize("sched", [pair[0] for pair in PAIRS])
def test_config_round_trip(sched):
    config = json.loads(json.dumps(sched.get_config()))
    again = lr_scheduler_from_config(config)
    assert type(again) is type(sched) and again == sched
    assert again.get_config() == sched.get_config()
    assert [again(n) for n in range(50)] == [sched(n) for n in range(50)]
    moved = sched.with_base_lr(sched.base_lr * 2)
    assert moved.base_lr == sched.base_lr * 2 and moved != sched


@pytest.mark.parametrize("make,exc", [
    (lambda: FactorScheduler(step=0), ValueError),
    (lambda: FactorScheduler(step=1.5), TypeError),
    (lambda: FactorScheduler(step=2, factor=1.5), ValueError),
    (lambda: FactorScheduler(step=2, factor=0.0), ValueError),
    (lambda: FactorScheduler(step=2, base_lr=-1.0), ValueError),
    (lambda: FactorScheduler(step=2, base_lr=0.1, warmup_begin_lr=0.2), ValueError),
    (lambda: FactorScheduler(step=2, warmup_mode="cubic"), ValueError),
    (lambda: FactorScheduler(step=2, warmup_steps=-1), ValueError),
    (lambda: MultiFactorScheduler(step=[5, 3]), ValueError),
    (lambda: MultiFactorScheduler(step=[0, 3]), ValueError),
    (lambda: MultiFactorScheduler(step=[]), TypeError),
    (lambda: MultiFactorScheduler(step=5), TypeError),
    (lambda: CosineScheduler(max_update=0), ValueError),
    (lambda: CosineScheduler(max_update=5, warmup_steps=5), ValueError),
    (lambda: CosineScheduler(max_update=5, final_lr=float("nan")), ValueError),
    (lambda: PolyScheduler(max_update=5, pwr=0), ValueError),
    (lambda: lr_scheduler_from_config({"name": "exp"}), ValueError),
    (lambda: lr_scheduler_from_config("factor"), ValueError),
    (lambda: FactorScheduler(step=2)(-1), ValueError),
])
def test_invalid_arguments(make, exc):
    with pytest.raises(exc):
        make()


def test_optimizer_takes_scheduler_base_lr_without_warning():
    sched = CosineScheduler(max_update=10, base_lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adam = opt_mod.Adam(lr_scheduler=sched)
    assert adam.lr == 0.1 and adam.learning_rate == 0.1
    assert adam.get_config()["learning_rate"] == 0.1
    adam.num_update = 5
    assert adam.learning_rate == pytest.approx(0.05)
    with pytest.raises(OptimizerError):
        adam.set_learning_rate(0.3)


def test_explicit_learning_rate_replaces_base_lr_in_a_copy():
    sched = FactorScheduler(step=2, factor=0.5, base_lr=1.0, warmup_steps=2)
    with pytest.warns(UserWarning):
        sgd = opt_mod.SGD(learning_rate=0.5, lr_scheduler=sched)
    assert sched.base_lr == 1.0
    assert sgd.lr_scheduler.base_lr == 0.5 and sgd.lr_scheduler.warmup_steps == 2
    assert sgd.lr_scheduler(1) == pytest.approx(0.25)  # warmup ends at the new base_lr
    config = sgd.get_config()
    assert config["lr_scheduler"]["base_lr"] == config["learning_rate"] == 0.5
