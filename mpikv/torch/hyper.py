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

    def share(self, scale, joined, source):
        """One sum over the ranks; a joined rank takes ``source``'s values; collective.

        Args:
            scale: this rank's gradient scale.
            joined: whether this rank has joined (it sends nothing, and takes).
            source: the rank whose values joined ranks take.

        Returns:
            float: the gradient scale to use here.
        """
        rows = self._rows
        rows[:] = 0
        if not joined:
            rows[self._kv.rank] = [scale, *self.values()]
        self._kv.allreduce_(rows)
        if not joined:
            return scale
        self.set_values(rows[source, 1:])
        return float(rows[source, 0])


__all__ = ["SharedHyperparameters"]
