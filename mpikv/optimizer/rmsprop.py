"""RMSProp, MXNet 1.9 ``rmsprop_update`` and ``rmspropalex_update``."""

from ..arrays import backends
from . import checks as _checks
from .base import Optimizer, register


@register
class RMSProp(Optimizer):
    """RMSProp: Tieleman & Hinton, or centered (Graves 2013).

    MXNet 1.9 calls ``rho`` ``gamma1`` and ``momentum`` ``gamma2``; both
    spellings are taken (one of each pair). With
    ``g = clip(rescale_grad * grad + wd * w, clip_gradient)`` (decay added
    before clipping, as in MXNet's kernels):

    * ``centered=False``: ``n = (1-rho)*g**2 + rho*n;
      w -= lr * g / sqrt(n + epsilon)``; ``momentum`` is unused.
    * ``centered=True``: ``n = (1-rho)*g**2 + rho*n;
      g_avg = (1-rho)*g + rho*g_avg;
      delta = momentum*delta - lr * g / sqrt(n - g_avg**2 + epsilon);
      w += delta``.

    Then, if ``clip_weights`` > 0, ``w = clip(w, -clip_weights, clip_weights)``.

    Args:
        learning_rate: Defaults to 0.001, or to the scheduler's ``base_lr``
            (see :class:`~mpikv.optimizer.Optimizer`).
        rho: Decay of the squared-gradient average, in [0, 1) (MXNet 1.9:
            ``gamma1``).
        momentum: Momentum of ``delta`` (centered only), in [0, 1) (MXNet 1.9:
            ``gamma2``).
        epsilon: > 0; added inside the square root.
        centered: Whether to use the centered variant.
        clip_weights: None or <= 0: no weight clipping.
        **kwargs: See :class:`~mpikv.optimizer.Optimizer`.
    """

    name = "rmsprop"
    default_learning_rate = 0.001

    def __init__(self, learning_rate=None, rho=None, momentum=None, epsilon=1e-8,
                 centered=False, clip_weights=None, gamma1=None, gamma2=None, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.rho = _checks.unit_interval("rho", _one_of("rho", rho, "gamma1", gamma1, 0.9))
        self.momentum = _checks.unit_interval(
            "momentum", _one_of("momentum", momentum, "gamma2", gamma2, 0.9))
        self.epsilon = _checks.real("epsilon", epsilon, low=0.0, low_open=True)
        self.centered = _checks.flag("centered", centered)
        self.clip_weights = _checks.optional_real("clip_weights", clip_weights)

    @property
    def elementwise_state_names(self):
        return ("n", "g", "delta") if self.centered else ("n",)

    def _hyperparams(self):
        return {"rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon,
                "centered": self.centered, "clip_weights": self.clip_weights}

    def _step(self, w, g, state, lr, wd, t):
        xp = backends.module_of(w)
        g = self._clipped(self.rescale_grad * g + wd * w)
        n = state["n"]
        n *= self.rho
        n += (1.0 - self.rho) * xp.square(g)
        if not self.centered:
            new = w - lr * g / xp.sqrt(n + self.epsilon)
        else:
            g_avg, delta = state["g"], state["delta"]
            g_avg *= self.rho
            g_avg += (1.0 - self.rho) * g
            delta *= self.momentum
            delta -= lr * g / xp.sqrt(n - xp.square(g_avg) + self.epsilon)
            new = w + delta
        if self.clip_weights is not None and self.clip_weights > 0:
            xp.clip(new, -self.clip_weights, self.clip_weights, out=new)
        return new


def _one_of(name, value, alias, alias_value, default):
    """The value given under ``name`` or under MXNet 1.9's ``alias``, else ``default``."""
    if value is not None and alias_value is not None:
        raise ValueError(f"give {name} or {alias} (MXNet 1.9's name for it), not both")
    return default if value is None and alias_value is None else (
        value if value is not None else alias_value)
