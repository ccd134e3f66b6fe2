"""Learning-rate schedulers with MXNet 1.9's formulas.

MXNet's schedulers are stateful: ``FactorScheduler`` and
``MultiFactorScheduler`` multiply ``base_lr`` in place as ``num_update``
grows, and ``CosineScheduler``/``PolyScheduler`` keep returning the last value
they computed once ``num_update`` passes ``max_update``. Here every scheduler
is a pure function of ``num_update`` that returns what MXNet returns for a
non-decreasing sequence of calls, so a run resumed from a checkpoint (or a
rank that skipped calls) gets the same rates. Two documented consequences:
calling with a smaller ``num_update`` goes back in the schedule, and past
``max_update`` the cosine and poly schedules return ``final_lr``.
"""

import bisect
import math

from . import checks as _checks

_SCHEDULERS = {}


def _register(cls):
    _SCHEDULERS[cls.name] = cls
    return cls


def lr_scheduler_from_config(config):
    """Rebuilds a scheduler from :meth:`LRScheduler.get_config` output.

    Args:
        config: A dict with a ``"name"`` entry ('factor', 'multifactor',
            'cosine' or 'poly') and the constructor's arguments.

    Returns:
        A new LRScheduler.

    Raises:
        ValueError: The config is not a dict with a known name.
    """
    if not isinstance(config, dict) or "name" not in config:
        raise ValueError(f"a scheduler config must be a dict with a 'name', got {config!r}")
    kwargs = dict(config)
    name = kwargs.pop("name")
    cls = _SCHEDULERS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown lr scheduler {name!r}; valid names: "
                         f"{', '.join(sorted(_SCHEDULERS))}")
    return cls(**kwargs)


class LRScheduler:
    """Base class: warmup handling and configuration.

    During the first ``warmup_steps`` updates the rate goes from
    ``warmup_begin_lr`` to ``base_lr`` ('linear':
    ``begin + (base_lr - begin) * num_update / warmup_steps``) or stays at
    ``warmup_begin_lr`` ('constant').

    Args:
        base_lr: The rate the schedule starts from after warmup.
        warmup_steps: Number of warmup updates.
        warmup_begin_lr: The rate at update 0 of the warmup.
        warmup_mode: 'linear' or 'constant'.

    Raises:
        ValueError: A rate is negative, ``warmup_begin_lr > base_lr`` or the
            mode is unknown.
    """

    name = None

    def __init__(self, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0.0,
                 warmup_mode="linear"):
        self.base_lr = _checks.real("base_lr", base_lr, low=0.0)
        self.warmup_steps = _checks.integer("warmup_steps", warmup_steps, low=0)
        self.warmup_begin_lr = _checks.real("warmup_begin_lr", warmup_begin_lr, low=0.0)
        if self.warmup_begin_lr > self.base_lr:
            raise ValueError(f"base_lr ({self.base_lr}) must be >= warmup_begin_lr "
                             f"({self.warmup_begin_lr})")
        if warmup_mode not in ("linear", "constant"):
            raise ValueError(f"warmup_mode must be 'linear' or 'constant', got {warmup_mode!r}")
        self.warmup_mode = warmup_mode

    def __call__(self, num_update):
        """The learning rate after ``num_update`` updates."""
        num_update = _checks.integer("num_update", num_update, low=0)
        if num_update < self.warmup_steps:
            if self.warmup_mode == "constant":
                return self.warmup_begin_lr
            span = self.base_lr - self.warmup_begin_lr
            return self.warmup_begin_lr + span * num_update / self.warmup_steps
        return self._scheduled(num_update)

    def _scheduled(self, num_update):
        raise NotImplementedError

    def _own_config(self):
        return {}

    def get_config(self):
        """The constructor's arguments and ``"name"``, as JSON-ready data."""
        return {"name": self.name, "base_lr": self.base_lr,
                "warmup_steps": self.warmup_steps,
                "warmup_begin_lr": self.warmup_begin_lr,
                "warmup_mode": self.warmup_mode, **self._own_config()}

    @staticmethod
    def from_config(config):
        """Same as :func:`lr_scheduler_from_config`."""
        return lr_scheduler_from_config(config)

    def with_base_lr(self, base_lr):
        """A copy with another ``base_lr`` (warmup target included)."""
        return lr_scheduler_from_config({**self.get_config(), "base_lr": base_lr})

    def __eq__(self, other):
        if not isinstance(other, LRScheduler):
            return NotImplemented
        return self.get_config() == other.get_config()

    __hash__ = None

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"


@_register
class FactorScheduler(LRScheduler):
    """Multiplies the rate by ``factor`` every ``step`` updates.

    ``lr = base_lr * factor**k`` with ``k = max(0, (num_update - 1) // step)``
    (the number of times MXNet's ``while num_update > count + step`` loop has
    fired), floored at ``stop_factor_lr`` once ``k >= 1``. Warmup does not
    shift the steps, as in MXNet.

    Args:
        step: Updates between two reductions, >= 1.
        factor: Multiplier in (0, 1].
        stop_factor_lr: The rate never drops below this after a reduction.
        base_lr: See :class:`LRScheduler`.
        warmup_steps: See :class:`LRScheduler`.
        warmup_begin_lr: See :class:`LRScheduler`.
        warmup_mode: See :class:`LRScheduler`.
    """

    name = "factor"

    def __init__(self, step, factor=1.0, stop_factor_lr=1e-8, base_lr=0.01,
                 warmup_steps=0, warmup_begin_lr=0.0, warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.step = _checks.integer("step", step, low=1)
        self.factor = _checks.real("factor", factor, low=0.0, low_open=True, high=1.0)
        self.stop_factor_lr = _checks.real("stop_factor_lr", stop_factor_lr, low=0.0)

    def _scheduled(self, num_update):
        reductions = max(0, (num_update - 1) // self.step)
        if reductions == 0:
            return self.base_lr
        return max(self.base_lr * self.factor ** reductions, self.stop_factor_lr)

    def _own_config(self):
        return {"step": self.step, "factor": self.factor,
                "stop_factor_lr": self.stop_factor_lr}


@_register
class MultiFactorScheduler(LRScheduler):
    """Multiplies the rate by ``factor`` at each listed step.

    ``lr = base_lr * factor**k`` where ``k`` counts the steps ``s`` with
    ``num_update > s``.

    Args:
        step: Strictly increasing list of update counts, each >= 1.
        factor: Multiplier in (0, 1].
        base_lr: See :class:`LRScheduler`.
        warmup_steps: See :class:`LRScheduler`.
        warmup_begin_lr: See :class:`LRScheduler`.
        warmup_mode: See :class:`LRScheduler`.
    """

    name = "multifactor"

    def __init__(self, step, factor=1.0, base_lr=0.01, warmup_steps=0,
                 warmup_begin_lr=0.0, warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(step, (list, tuple)) or not step:
            raise TypeError("step must be a non-empty list of ints")
        steps = [_checks.integer(f"step[{i}]", s, low=1) for i, s in enumerate(step)]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"step must be strictly increasing, got {steps}")
        self.step = tuple(steps)
        self.factor = _checks.real("factor", factor, low=0.0, low_open=True, high=1.0)

    def _scheduled(self, num_update):
        return self.base_lr * self.factor ** bisect.bisect_left(self.step, num_update)

    def _own_config(self):
        return {"step": list(self.step), "factor": self.factor}


class _DecayToFinal(LRScheduler):
    """Shared checks of the schedules that end at ``final_lr`` at ``max_update``."""

    def __init__(self, max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr,
                 warmup_mode):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _checks.integer("max_update", max_update, low=1)
        if self.max_update <= self.warmup_steps:
            # MXNet would divide by max_update - warmup_steps == 0.
            raise ValueError(f"max_update ({self.max_update}) must be > warmup_steps "
                             f"({self.warmup_steps})")
        self.final_lr = _checks.real("final_lr", final_lr, low=0.0)

    def _progress(self, num_update):
        """Fraction of the decay done, in [0, 1]."""
        done = min(num_update, self.max_update) - self.warmup_steps
        return done / (self.max_update - self.warmup_steps)


@_register
class CosineScheduler(_DecayToFinal):
    """Cosine decay from ``base_lr`` to ``final_lr``.

    ``lr = final_lr + (base_lr - final_lr) * (1 + cos(pi * p)) / 2`` with
    ``p = (num_update - warmup_steps) / (max_update - warmup_steps)``; after
    ``max_update`` the rate stays ``final_lr``.

    Args:
        max_update: Update count at which ``final_lr`` is reached; must be
            greater than ``warmup_steps``.
        base_lr: See :class:`LRScheduler`.
        final_lr: The rate at and after ``max_update``.
        warmup_steps: See :class:`LRScheduler`.
        warmup_begin_lr: See :class:`LRScheduler`.
        warmup_mode: See :class:`LRScheduler`.
    """

    name = "cosine"

    def __init__(self, max_update, base_lr=0.01, final_lr=0.0, warmup_steps=0,
                 warmup_begin_lr=0.0, warmup_mode="linear"):
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr,
                         warmup_mode)

    def _scheduled(self, num_update):
        cosine = (1.0 + math.cos(math.pi * self._progress(num_update))) / 2.0
        return self.final_lr + (self.base_lr - self.final_lr) * cosine

    def _own_config(self):
        return {"max_update": self.max_update, "final_lr": self.final_lr}


@_register
class PolyScheduler(_DecayToFinal):
    """Polynomial decay from ``base_lr`` to ``final_lr``.

    ``lr = final_lr + (base_lr - final_lr) * (1 - p)**pwr`` with ``p`` as in
    :class:`CosineScheduler`; after ``max_update`` the rate stays ``final_lr``.

    Args:
        max_update: Update count at which ``final_lr`` is reached; must be
            greater than ``warmup_steps``.
        base_lr: See :class:`LRScheduler`.
        pwr: The power, > 0.
        final_lr: The rate at and after ``max_update``.
        warmup_steps: See :class:`LRScheduler`.
        warmup_begin_lr: See :class:`LRScheduler`.
        warmup_mode: See :class:`LRScheduler`.
    """

    name = "poly"

    def __init__(self, max_update, base_lr=0.01, pwr=2, final_lr=0.0, warmup_steps=0,
                 warmup_begin_lr=0.0, warmup_mode="linear"):
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr,
                         warmup_mode)
        self.pwr = _checks.real("pwr", pwr, low=0.0, low_open=True)

    def _scheduled(self, num_update):
        remaining = (1.0 - self._progress(num_update)) ** self.pwr
        return self.final_lr + (self.base_lr - self.final_lr) * remaining

    def _own_config(self):
        return {"max_update": self.max_update, "pwr": self.pwr, "final_lr": self.final_lr}
