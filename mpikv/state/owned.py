"""What a rank owns of the optimizer side: its parts' values and states, read and loaded.

The framework layers (the torch Trainer's optimizer ``state_dict``) read the
owners' states through :meth:`mpikv.KVStore.owned_states` and load them through
:meth:`mpikv.KVStore.load_owned_states`; this module does the work of both.
"""

import dataclasses

from .. import errors
from ..calls.reader import Call


@dataclasses.dataclass(frozen=True)
class OwnedPart:
    """One part of a key that this rank owns.

    Attributes:
        start: its first element in the key's flat value.
        stop: one past its last element.
        whole: whether the part is the whole key (the key is not split).
        weight: the stored value of the part: the key's array if whole, else
            a flat view of elements ``start:stop``.
        state: its optimizer state (name -> array), or None before its first
            update.
    """

    start: int
    stop: int
    whole: bool
    weight: object
    state: object


@dataclasses.dataclass(frozen=True)
class OwnedKey:
    """What this rank holds of one key's optimizer side.

    Attributes:
        dtype: the key's stored dtype (the same on every rank).
        parts: the :class:`OwnedPart` of each part this rank owns, in order;
            empty where it owns none.
    """

    dtype: object
    parts: tuple


class OwnedStates:
    """The owned parts of an engine's keys, on rank ``rank``.

    Args:
        engine: the store's :class:`~mpikv.core.engine.Engine`.
        rank: this rank.
    """

    def __init__(self, engine, rank):
        self.engine, self.rank = engine, rank

    def read(self, keys):
        """``{key: OwnedKey}`` of ``keys``; the arrays are the store's own (no copies).

        Raises:
            UnknownKeyError: for a key the store does not hold.
        """
        engine, rank = self.engine, self.rank
        owned = {}
        for key in keys:
            entry = engine.entries.get(key)
            if entry is None:
                raise errors.UnknownKeyError(f"owned_states: key {key!r} is not in the store")
            placement = engine.plan[key]
            whole = not placement.split
            owned[key] = OwnedKey(entry.array.dtype, tuple(
                OwnedPart(s.start, s.stop, whole,
                          entry.array if whole else entry.flat[s.start:s.stop],
                          engine.states.get((key, s.start)))
                for s in placement.shards if s.owner == rank))
        return owned

    def load_call(self, states, settings=None):
        """The agreed call that loads ``{(key, part start): state}`` and its action.

        The call fails (on every rank, once agreed) for a part this rank does not
        own, or where the ranks' ``settings`` (a JSON-able dict: what else must be
        the same on every rank) differ; the action replaces those parts' states and
        keeps every other state and every key's update count.
        """
        call = Call("load_owned_states", settings=dict(settings or {}))
        engine, rank = self.engine, self.rank
        for key, start in states:
            placement = engine.plan[key] if key in engine.plan else None
            if placement is None or not any(s.start == start and s.owner == rank
                                            for s in placement.shards):
                call.fail(errors.InputError, None, f"rank {rank} does not own the part of "
                                                   f"key {key!r} that starts at {start}")
                break

        def load():
            engine.load_optimizer(engine.optimizer, {**engine.states, **states},
                                  dict(engine.counts))
        return call, load


__all__ = ["OwnedKey", "OwnedPart", "OwnedStates"]
