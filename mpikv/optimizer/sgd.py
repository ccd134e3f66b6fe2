"""SGD and Nesterov momentum (MXNet 1.9 ``sgd_update``, ``sgd_mom_update``, ``nag_mom_update``)."""

from . import checks as _checks
from .base import Optimizer, register


class _Momentum(Optimizer):
    """Shared constructor of the two momentum optimizers."""

    def __init__(self, momentum=0.0, lazy_update=False, **kwargs):
        super().__init__(**kwargs)
        self.momentum = _checks.unit_interval("momentum", momentum)
        self.lazy_update = _checks.flag("lazy_update", lazy_update)

    @property
    def elementwise_state_names(self):
        return ("mom",) if self.momentum > 0 else ()

    def _hyperparams(self):
        return {"momentum": self.momentum, "lazy_update": self.lazy_update}


@register
class SGD(_Momentum):
    """Stochastic gradient descent, with optional heavy-ball momentum.

    With ``g = clip(rescale_grad * grad, clip_gradient)``:

    * ``momentum == 0`` (``sgd_update``): ``w = (1 - lr*wd) * w - lr * g``,
      that is ``w -= lr * (g + wd*w)``; the state holds only ``"t"``.
    * ``momentum > 0`` (``sgd_mom_update``):
      ``mom = momentum*mom - lr*wd*w - lr*g; w += mom``.

    Args:
        momentum: Momentum in [0, 1).
        lazy_update: for row tables' row-sparse pushes: update only the rows
            pushed (and their state), as MXNet's; dense keys' updates are dense.
        **kwargs: See :class:`~mpikv.optimizer.Optimizer`.
    """

    name = "sgd"

    def _step(self, w, g, state, lr, wd, t):
        g = self._scaled_grad(g)
        if self.momentum == 0:
            return (1.0 - lr * wd) * w - lr * g
        mom = state["mom"]
        mom *= self.momentum
        mom -= (lr * wd) * w
        mom -= lr * g
        return w + mom


@register
class NAG(_Momentum):
    """Nesterov accelerated gradient, MXNet 1.9 ``nag_mom_update``.

    With ``g = clip(rescale_grad * grad, clip_gradient) + wd * w``:
    ``mom = momentum*mom - lr*g; w += momentum*mom - lr*g``.

    The momentum holds the learning rate (as in MXNet's kernel), so for a
    constant ``lr`` this equals MXNet's documented form
    ``m = momentum*m + g; w -= lr * (g + momentum*m)`` with ``mom = -lr*m``;
    the two differ only when the rate changes between steps. With
    ``momentum == 0`` the update is SGD's.

    Args:
        momentum: Momentum in [0, 1).
        lazy_update: for row tables' row-sparse pushes: update only the rows
            pushed (and their state), as MXNet's; dense keys' updates are dense.
        **kwargs: See :class:`~mpikv.optimizer.Optimizer`.
    """

    name = "nag"

    def _step(self, w, g, state, lr, wd, t):
        g = self._scaled_grad(g)
        g += wd * w
        if self.momentum == 0:
            return w - lr * g
        mom = state["mom"]
        mom *= self.momentum
        mom -= lr * g
        return w + self.momentum * mom - lr * g
