"""A single-process updater, MXNet's ``get_updater`` equivalent."""

import numpy as np

from ..arrays import backends
from ..errors import OptimizerError
from .base import Optimizer


class Updater:
    """Applies an optimizer to whole arrays, keeping one state per key.

    Args:
        optimizer: The :class:`~mpikv.optimizer.Optimizer` to apply.

    Attributes:
        optimizer: The optimizer.
        states: ``{key: state dict}``, created at a key's first update.
    """

    def __init__(self, optimizer):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"expected an Optimizer, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.states = {}

    def __call__(self, key, grad, weight):
        """Updates ``weight`` in place from ``grad`` (MXNet's argument order).

        ``key``, ``grad`` and ``weight`` may also be equal-length lists.
        """
        if isinstance(key, (list, tuple)):
            if not len(key) == len(grad) == len(weight):
                raise ValueError("key, grad and weight lists must have the same length")
            for k, g, w in zip(key, grad, weight):
                self._update_one(k, g, w)
        else:
            self._update_one(key, grad, weight)

    def _update_one(self, key, grad, weight):
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = self.optimizer.create_state(key, weight)
        self.optimizer.update(key, weight, grad, state)

    def get_states(self):
        """A copy of the states: ``{key: {name: array}}`` (GPU states stay on their GPU)."""
        return {key: {name: _copy(arr) for name, arr in state.items()}
                for key, state in self.states.items()}

    def set_states(self, states):
        """Replaces the states with a copy of ``states`` (as from :meth:`get_states`).

        Raises:
            OptimizerError: A state's array names do not fit the optimizer.
        """
        opt = self.optimizer
        # A 16-bit weight's state may hold its master copy too (multi_precision).
        allowed = ({frozenset(opt.state_names)} | (
            {frozenset(opt.state_names_for(np.float16))} if opt.multi_precision else set()))
        copied = {}
        for key, state in states.items():
            if not isinstance(state, dict) or frozenset(state) not in allowed:
                raise OptimizerError(f"state of key {key!r} must have arrays "
                                     f"{sorted(opt.state_names)}")
            copied[key] = {name: _copy(arr) for name, arr in state.items()}
        self.states = copied


def _copy(array):
    """A copy that stays where ``array`` lives (host or GPU)."""
    if backends.is_device(array):
        with backends.on(array):
            return array.copy()
    return np.array(array, copy=True)


def get_updater(optimizer):
    """An :class:`Updater` for ``optimizer``: ``updater(key, grad, weight)``."""
    return Updater(optimizer)
