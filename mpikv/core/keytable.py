"""A store's keys: each key's stored value and placement, the key type, the
ownership plan, and what a checkpoint load installs.

:class:`KeyTable` is the one place that adds or replaces an :class:`Entry`;
the other pieces of :class:`mpikv.core.engine.Engine` read entries and ask it to
change them.
"""

from types import MappingProxyType

import numpy as np

from ..arrays import backends
from ..dtypes import is_floating
from .plan import OwnershipPlan


class Entry:
    """A stored value.

    Attributes:
        array: the value (a view into ``arena`` for fused keys).
        flat: a flat view of it.
        placement: its :class:`mpikv.core.plan.Placement`.
        arena / offset: the buffer it lives in and its element offset there.
        stale: whether this rank's copy is behind the owners' (after a push
            with an updater, or a checkpoint load), until the next pull.
    """

    __slots__ = ("array", "flat", "placement", "arena", "offset", "stale")

    def __init__(self, arena, offset, shape, placement):
        self.arena = arena
        self.offset = offset
        size = placement.size
        self.flat = arena[offset:offset + size]
        self.array = self.flat.reshape(shape)
        self.placement = placement
        self.stale = False

    def moved_to(self, arena, offset, array=None):
        """This value's entry at ``offset`` in ``arena`` (its staleness kept);
        ``array``: a view of it to hand out as the value, if one exists already."""
        new = Entry(arena, offset, self.array.shape, self.placement)
        if array is not None:
            new.array = array
        new.stale = self.stale
        return new


class KeyTable:
    """key -> :class:`Entry`, with what the store knows of its keys.

    Args:
        num_ranks: the store's size.
        bigarray_bound: arrays with this many elements or more are split
            (see :class:`mpikv.core.plan.OwnershipPlan`).
    """

    def __init__(self, num_ranks, bigarray_bound):
        self.num_ranks = num_ranks
        self._plan = OwnershipPlan(num_ranks, bigarray_bound)
        self._entries = {}
        self._view = MappingProxyType(self._entries)  # never replaced, only changed
        self._key_type = None
        self._int_keys = set()  # keys of integer dtype (no optimizer for them)
        self._on_gpu = False
        self._gpus = None       # cache of :attr:`gpus`

    # -- read ------------------------------------------------------------
    @property
    def entries(self):
        """key -> :class:`Entry`, read only."""
        return self._view

    @property
    def plan(self):
        """The :class:`mpikv.core.plan.OwnershipPlan`."""
        return self._plan

    @property
    def key_type(self):
        """The type of the store's keys (int or str), None while it has none."""
        return self._key_type

    @property
    def on_gpu(self):
        """Whether any stored value lives on a GPU."""
        return self._on_gpu

    @property
    def gpus(self):
        """The ids of the GPUs holding stored values (cached until an entry changes)."""
        if self._gpus is None:
            self._gpus = frozenset(e.arena.device.id for e in self._entries.values()
                                   if type(e.arena) is not np.ndarray)
        return self._gpus

    def lookup(self, key):
        """``(shape, dtype)`` of a stored key, or None if there is no such key."""
        entry = self._entries.get(key)
        return None if entry is None else (entry.array.shape, entry.array.dtype)

    def int_keys_in(self, keys):
        """The keys of ``keys`` (in their order) that hold integers."""
        int_keys = self._int_keys
        return [k for k in keys if k in int_keys] if int_keys else []

    def zeros_of(self, key):
        """Zeros shaped like ``key``'s value, where it lives."""
        e = self._entries[key]
        return backends.zeros_on(e.arena, e.array.size, e.array.dtype).reshape(e.array.shape)

    # -- changed ---------------------------------------------------------
    def place(self, sizes):
        """Places new keys (``(key, elements, itemsize)`` each) in the plan:
        key -> :class:`mpikv.core.plan.Placement`."""
        return self._plan.add(sizes)

    def put(self, key, entry):
        """Installs ``key``'s entry: a new key, or its value moved to another arena."""
        self._entries[key] = entry
        self._on_gpu = self._on_gpu or not isinstance(entry.arena, np.ndarray)
        self._gpus = None

    def note_keys(self, keys_and_dtypes):
        """Records new keys' integer dtypes and the store's key type."""
        for key, dtype in keys_and_dtypes:
            if not is_floating(dtype):
                self._int_keys.add(key)
            if self._key_type is None:
                self._key_type = type(key)

    def add_loaded(self, entries):
        """Installs the keys a load created (key -> :class:`Entry`)."""
        for key, entry in entries.items():
            self.put(key, entry)
        self.note_keys((key, entry.array.dtype) for key, entry in entries.items())

    def replace_plan(self, plan):
        """Installs a load's plan."""
        self._plan = plan

    def load_values(self, pieces):
        """Copies loaded values in, ``(key, start, stop, array)`` each, and marks every
        value stale until the next pull (other ranks loaded the other parts)."""
        for key, start, stop, array in pieces:
            backends.copyto(self._entries[key].flat[start:stop], array)
        self.set_stale(self._entries, self.num_ranks > 1)

    def set_stale(self, keys, stale=True):
        """Marks this rank's copies of ``keys`` as behind the owners' or not."""
        entries = self._entries
        for key in keys:
            entries[key].stale = stale

    def clear(self):
        """Drops every entry (the store is closed)."""
        self._entries.clear()
        self._gpus = None
