"""Adam (MXNet 1.9 ``Adam`` + ``adam_update``) and AdamW (``contrib.adamw_update``)."""

import math

from ..arrays import backends
from . import checks as _checks
from .base import Optimizer, register


class _Moments(Optimizer):
    """Shared arguments and moment updates of the Adam family."""

    default_learning_rate = 0.001

    def __init__(self, learning_rate=None, beta1=0.9, beta2=0.999, epsilon=1e-8, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _checks.unit_interval("beta1", beta1)
        self.beta2 = _checks.unit_interval("beta2", beta2)
        self.epsilon = _checks.real("epsilon", epsilon, low=0.0, low_open=True)

    @property
    def elementwise_state_names(self):
        return ("mean", "var")

    def _hyperparams(self):
        return {"beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}

    def _moments(self, g, state):
        """Updates and returns ``(mean, var)`` in place from gradient ``g``."""
        xp = backends.module_of(g)
        mean, var = state["mean"], state["var"]
        mean *= self.beta1
        mean += (1.0 - self.beta1) * g
        var *= self.beta2
        var += (1.0 - self.beta2) * xp.square(g)
        return mean, var

    def _corrected_lr(self, lr, t):
        """``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``."""
        return lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)


@register
class Adam(_Moments):
    """Adam with MXNet 1.9's L2 weight decay and clipping order.

    With ``t`` the key's update count (``state["t"]`` after the increment)::

        g = clip(rescale_grad * grad + wd * w, clip_gradient)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)
        w -= lr_t * mean / (sqrt(var) + epsilon)

    MXNet 1.9's ``adam_update`` adds ``wd * w`` before clipping, unlike SGD,
    NAG and LAMB, which clip the rescaled gradient alone.

    Args:
        learning_rate: Defaults to 0.001, or to the scheduler's ``base_lr``
            (see :class:`~mpikv.optimizer.Optimizer`).
        beta1: First-moment decay in [0, 1).
        beta2: Second-moment decay in [0, 1).
        epsilon: > 0.
        lazy_update: for row tables' row-sparse pushes: update only the rows
            pushed (and their state), as MXNet's; dense keys' updates are dense.
        **kwargs: See :class:`~mpikv.optimizer.Optimizer`.
    """

    name = "adam"

    def __init__(self, learning_rate=None, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 lazy_update=False, **kwargs):
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.lazy_update = _checks.flag("lazy_update", lazy_update)

    def _hyperparams(self):
        return {**super()._hyperparams(), "lazy_update": self.lazy_update}

    def _step(self, w, g, state, lr, wd, t):
        xp = backends.module_of(w)
        g = self._clipped(self.rescale_grad * g + wd * w)
        mean, var = self._moments(g, state)
        return w - self._corrected_lr(lr, t) * mean / (xp.sqrt(var) + self.epsilon)


@register
class AdamW(_Moments):
    """Adam with decoupled weight decay (Loshchilov & Hutter), MXNet ``adamw_update``.

    With ``t`` the key's update count::

        g = clip(rescale_grad * grad, clip_gradient)          # no wd here
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)       # lr_t = lr if not correct_bias
        w -= eta * (lr_t * mean / (sqrt(var) + epsilon) + wd * w)

    ``lr`` is the scheduled rate times ``lr_mult`` and ``eta`` the paper's
    schedule multiplier, a constant here: the decay ``eta * wd`` is *not*
    scaled by the learning rate or its schedule. PyTorch's
    ``AdamW(lr, weight_decay=l)`` decays by ``lr * l`` per step, which is
    ``wd = lr * l`` here for a constant ``lr``.

    Args:
        learning_rate: Defaults to 0.001, or to the scheduler's ``base_lr``
            (see :class:`~mpikv.optimizer.Optimizer`).
        beta1: First-moment decay in [0, 1).
        beta2: Second-moment decay in [0, 1).
        epsilon: > 0.
        eta: Multiplier of the whole step, >= 0.
        correct_bias: Whether ``lr_t`` includes Adam's bias correction.
        **kwargs: See :class:`~mpikv.optimizer.Optimizer`.
    """

    name = "adamw"

    def __init__(self, learning_rate=None, beta1=0.9, beta2=0.999, epsilon=1e-8, eta=1.0,
                 correct_bias=True, **kwargs):
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.eta = _checks.real("eta", eta, low=0.0)
        self.correct_bias = _checks.flag("correct_bias", correct_bias)

    def _hyperparams(self):
        return {**super()._hyperparams(), "eta": self.eta, "correct_bias": self.correct_bias}

    def _step(self, w, g, state, lr, wd, t):
        xp = backends.module_of(w)
        mean, var = self._moments(self._scaled_grad(g), state)
        lr_t = self._corrected_lr(lr, t) if self.correct_bias else lr
        return w - self.eta * (lr_t * mean / (xp.sqrt(var) + self.epsilon) + wd * w)
