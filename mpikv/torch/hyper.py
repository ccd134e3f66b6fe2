"""Hyperparameters shared with joined ranks (``Trainer.join``).

A rank that has joined no longer steps its scheduler, so at each step it
takes the gradient scale and every numeric hyperparameter of the first rank
still training: each training rank puts its row in a vector, one row per
rank, and the store sums it.
"""

import numpy as np


def _numeric(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SharedHyperparameters:
    """The numbers of a torch optimizer's ``param_groups``, shared over the ranks.

    Args:
        kv: the store.
        param_groups: the groups (read and written in place); their fields
            are fixed here, the same on every rank.
    """

    def __init__(self, kv, param_groups):
        self._kv, self._groups = kv, param_groups
        #: ``(group index, name)`` of every number or tuple of numbers
        self.fields = [(index, name) for index, group in enumerate(param_groups)
                       for name in sorted(group)
                       if name != "params" and (_numeric(group[name]) or (
                           isinstance(group[name], tuple) and all(map(_numeric, group[name]))))]
        self._rows = np.zeros((kv.num_workers, 1 + len(self.values())), np.float64)

    def values(self):
        """The numbers of :attr:`fields`, flat."""
        out = []
        for index, name in self.fields:
            value = self._groups[index][name]
            out.extend(map(float, value) if isinstance(value, tuple) else [float(value)])
        return out

    def set_values(self, values):
        """Writes :meth:`values` output back, keeping each number's type."""
        it = iter(values)
        for index, name in self.fields:
            value = self._groups[index][name]
            self._groups[index][name] = (tuple(type(v)(next(it)) for v in value)
                                         if isinstance(value, tuple) else type(value)(next(it)))

    def rows(self, scale=None):
        """This rank's part of the sum: its row of ``scale`` and :meth:`values`,
        zeros elsewhere; all zeros for a joined rank (``scale`` None)."""
        rows = self._rows
        rows[:] = 0
        if scale is not None:
            rows[self._kv.rank] = [scale, *self.values()]
        return rows

    def share(self, scale):
        """A training rank's part: its scale and values go to the joined ranks; collective."""
        self._kv.allreduce_(self.rows(scale), tag="hyperparameters")

    def take(self, source):
        """A joined rank's part, once :meth:`rows` was summed: takes ``source``'s values.

        Returns:
            float: ``source``'s gradient scale.
        """
        self.set_values(self._rows[source, 1:])
        return float(self._rows[source, 0])


__all__ = ["SharedHyperparameters"]
