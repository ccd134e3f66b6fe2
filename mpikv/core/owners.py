"""What an owner does with a summed gradient: assign it, run the updater, or step the
optimizer with the state of the shards it owns (sharded state: ZeRO-1's idea).

The engine sums each bucket to its owners (:meth:`mpikv.reducers.Reducer.reduce_to_owners`)
and hands each owned key or shard here with the stored value it updates.
"""

import traceback
from types import MappingProxyType

import numpy as np

from ..arrays import halfbits


class Owners:
    """A store's updater or optimizer, and the optimizer state of what this rank owns.

    Args:
        transport: the store's transport (its rank, and the partial sums of
            split keys for optimizers such as LAMB).
    """

    def __init__(self, transport):
        self.transport = transport
        self._updater = None
        self._kind = None       # None (assign), "function" or "optimizer"
        self._optimizer = None
        self._states = {}       # (key, shard start) -> optimizer state, owned shards only
        self._counts = {}       # key -> pushes through the optimizer, the same on every rank
        self._generation = 0    # +1 whenever the states are replaced rather than updated

    # -- what is set -------------------------------------------------------------
    @property
    def kind(self):
        """None (the sum is assigned), "function" (an updater) or "optimizer"."""
        return self._kind

    @property
    def updater(self):
        """The updater function, or None."""
        return self._updater

    @property
    def optimizer(self):
        """The :class:`mpikv.optimizer.Optimizer`, or None."""
        return self._optimizer

    @property
    def states(self):
        """(key, shard start) -> optimizer state of the shards this rank owns, read only."""
        return MappingProxyType(self._states)

    @property
    def counts(self):
        """key -> pushes through the optimizer, the same on every rank, read only."""
        return MappingProxyType(self._counts)

    @property
    def generation(self):
        """A number that changes whenever the states are replaced rather than updated by
        a push (an updater or optimizer set, a load, the store closed); the same on every
        rank, as those calls are collective."""
        return self._generation

    def state_nbytes(self):
        """Bytes of optimizer state this rank holds."""
        return sum(a.nbytes for state in self._states.values() for a in state.values())

    def set_updater(self, updater):
        """``updater(key, input, stored)`` from now on (None: assign); drops the optimizer."""
        self._optimizer, self._states = None, {}
        self._generation += 1
        self._updater = updater
        self._kind = None if updater is None else "function"

    def set_optimizer(self, optimizer):
        """``optimizer`` from now on, with fresh states."""
        self._optimizer, self._states = optimizer, {}
        self._generation += 1
        self._updater, self._kind = None, "optimizer"

    def follow_optimizer(self, config):
        """Takes the other ranks' optimizer hyperparameters (a joined rank, which did not
        see their changes); update counts and states stay."""
        opt = self._optimizer
        if config is None or opt is None or _same_config(opt.get_config(), config):
            return
        from ..optimizer import from_config
        fresh = from_config(config)
        fresh.num_update = opt.num_update
        self._optimizer = fresh

    def load(self, optimizer, states, counts):
        """Installs what a load read: ``optimizer`` if none is set (returns whether it
        was), the states of the shards this rank owns and every key's push count."""
        installed = self._optimizer is None and optimizer is not None
        if installed:
            self.set_optimizer(optimizer)
        self._states = states
        self._counts = counts
        self._generation += 1
        opt = self._optimizer
        if opt is not None and counts:
            opt.num_update = max(opt.num_update, max(counts.values()))
        return installed

    def clear(self):
        """Drops the states and counts (the store is closed)."""
        self._states.clear()
        self._counts.clear()
        self._generation += 1

    # -- a push ------------------------------------------------------------------
    def count(self, keys):
        """One more push of ``keys`` through the optimizer (before their updates)."""
        opt = self._optimizer
        if opt is None or not keys:
            return
        counts = self._counts
        for key in keys:
            counts[key] = counts.get(key, opt.begin_num_update) + 1
        # The schedule sees MXNet's num_update (the largest count of any key), the
        # same on every rank whichever keys it owns.
        opt.num_update = max(opt.num_update, max(counts[k] for k in keys))

    def update(self, key, start, grad, stored, split, pending):
        """Updates one owned key or shard in place.

        Args:
            key: the key.
            start: the shard's first element (0 for a whole key).
            grad: its summed gradient.
            stored: its stored value (a flat shard, or the whole array).
            split: whether it is a shard of a split key (an optimizer's partial
                sums then wait in ``pending`` for :meth:`finish`).
            pending: the push's ``(key, update)`` list of such partial sums.
        """
        if self._optimizer is not None:
            run = lambda: self._optimize(key, start, grad, stored, split, pending)  # noqa: E731
        else:
            grad = halfbits.astype(grad, stored.dtype)
            run = lambda: self._updater(key, grad, stored)  # noqa: E731
        if self.transport.size == 1:
            run()
            return
        try:
            run()
        except BaseException:
            # Only this owner knows; its copy and the others' now disagree.
            from ..transport.watchdog import EXCEPTION_EXIT_CODE, abort
            abort(f"mpikv: rank {self.transport.rank}: the update of key {key!r} raised; "
                  f"the store cannot stay consistent, ending the job\n"
                  f"{traceback.format_exc()}", EXCEPTION_EXIT_CODE)

    def _optimize(self, key, start, grad, weight, split, pending):
        opt = self._optimizer
        state = self._states.get((key, start))
        if state is None:
            state = self._states[(key, start)] = opt.create_state(key, weight)
        update = opt.begin_update(key, weight, grad, state)
        if update.partials is not None:
            if split:
                pending.append((key, update))
            else:
                opt.finish_update(update, update.partials.copy())

    def needs_finish(self, split_keys):
        """Whether a push of a key list with these split keys must call :meth:`finish`."""
        opt = self._optimizer
        return bool(opt is not None and opt.num_partials and split_keys)

    def finish(self, op, split_keys, pending):
        """Sums the partials (LAMB's norms) of split keys over their owners, then
        finishes their updates. Collective: every rank calls it, owner or not."""
        opt = self._optimizer
        width = opt.num_partials
        slot = {k: i for i, k in enumerate(split_keys)}
        sums = np.zeros(len(split_keys) * width, np.float64)
        for key, update in pending:
            sums[slot[key] * width:(slot[key] + 1) * width] += update.partials
        self.transport.allreduce_(sums, (op, split_keys))
        for key, update in pending:
            opt.finish_update(update, sums[slot[key] * width:(slot[key] + 1) * width])


def _same_config(a, b):
    import json
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
