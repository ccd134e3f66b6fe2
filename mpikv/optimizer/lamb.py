"""LAMB, MXNet 1.9 ``lamb_update_phase1`` / ``lamb_update_phase2``, sharded."""

import math

import numpy as np

from ..arrays import backends
from . import checks as _checks
from .adam import _Moments
from .base import register, sum_of_squares


@register
class LAMB(_Moments):
    """Layer-wise adaptive moments (You et al. 2019), MXNet 1.9's two phases.

    Phase 1, per shard, with ``t`` the key's update count::

        g = clip(rescale_grad * grad, clip_gradient)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        mean_hat, var_hat = mean / (1 - beta1**t), var / (1 - beta2**t)
                            # or mean, var when bias_correction is False
        r = mean_hat / (sqrt(var_hat) + epsilon) + wd * w

    ``partials = [sum(w*w), sum(r*r)]`` (float64); summed over the key's
    shards they give ``r1 = ||w||`` and ``r2 = ||r||`` of the whole array.
    Phase 2: ``r1 = max(r1, lower_bound)`` and ``r1 = min(r1, upper_bound)``
    for bounds > 0 (None or <= 0: unset, as in MXNet);
    ``ratio = r1 / r2`` if both are non-zero, else 1; ``w -= lr * ratio * r``.

    Args:
        learning_rate: Defaults to 0.001, or to the scheduler's ``base_lr``
            (see :class:`~mpikv.optimizer.Optimizer`).
        beta1: First-moment decay in [0, 1).
        beta2: Second-moment decay in [0, 1).
        epsilon: > 0.
        lower_bound: Lower bound of ``||w||``, or None.
        upper_bound: Upper bound of ``||w||``, or None.
        bias_correction: Whether to divide the moments by ``1 - beta**t``.
        **kwargs: See :class:`~mpikv.optimizer.Optimizer`.

    Raises:
        ValueError: Both bounds are set and ``lower_bound > upper_bound``.
    """

    name = "lamb"
    num_partials = 2

    def __init__(self, learning_rate=None, beta1=0.9, beta2=0.999, epsilon=1e-6,
                 lower_bound=None, upper_bound=None, bias_correction=True, **kwargs):
        super().__init__(learning_rate, beta1, beta2, epsilon, **kwargs)
        self.lower_bound = _checks.optional_real("lower_bound", lower_bound)
        self.upper_bound = _checks.optional_real("upper_bound", upper_bound)
        low, high = self._bound(self.lower_bound), self._bound(self.upper_bound)
        if low is not None and high is not None and low > high:
            raise ValueError(f"lower_bound ({low}) must be <= upper_bound ({high})")
        self.bias_correction = _checks.flag("bias_correction", bias_correction)

    @staticmethod
    def _bound(value):
        return value if value is not None and value > 0 else None

    def _hyperparams(self):
        return {**super()._hyperparams(), "lower_bound": self.lower_bound,
                "upper_bound": self.upper_bound, "bias_correction": self.bias_correction}

    def _begin(self, w, g, state, lr, wd, t):
        xp = backends.module_of(w)
        mean, var = self._moments(self._scaled_grad(g), state)
        if self.bias_correction:
            mean = mean / (1.0 - self.beta1 ** t)
            var = var / (1.0 - self.beta2 ** t)
        r = mean / (xp.sqrt(var) + self.epsilon) + wd * w
        partials = np.array([sum_of_squares(w), sum_of_squares(r)], dtype=np.float64)

        def finish(totals):
            return w - (lr * self.trust_ratio(totals)) * r

        return partials, finish

    def trust_ratio(self, totals):
        """``ratio`` of phase 2 from the summed partials ``[sum(w*w), sum(r*r)]``."""
        r1 = math.sqrt(max(float(totals[0]), 0.0))
        r2 = math.sqrt(max(float(totals[1]), 0.0))
        low, high = self._bound(self.lower_bound), self._bound(self.upper_bound)
        if low is not None:
            r1 = max(r1, low)
        if high is not None:
            r1 = min(r1, high)
        return r1 / r2 if r1 != 0.0 and r2 != 0.0 else 1.0
