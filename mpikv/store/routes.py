"""Remembered routes: repeated calls checked with a few lookups, run without the reader.

A training loop makes the same calls every step, and reading a call in full
(:class:`mpikv.calls.reader.CallReader`) costs more than moving a small key. Two
routes are remembered after a call succeeded on the general path:

- :class:`OneKeyCall`: a ``push``, ``pull`` or ``pushpull`` of one key with the
  default updater (MXNet Gluon's per-parameter calls): it holds what that call
  computed (the fingerprint per priority, the stored value, the reducer);
- :class:`ZeroCopyCall`: a ``push`` or ``pushpull`` of exactly a key list's
  zero-copy buffers: one identity check per key.

A route takes only arrays the general reader accepts as they are
(:func:`mpikv.calls.reader.plain_fits`) and declines anything else, or any change
of the store's state (:attr:`mpikv.core.engine.Engine.epoch`), which then goes to
the general path. Its fingerprint is the general path's, so ranks on either
path still agree, or all raise the same error.
"""

import operator

import numpy as np

from ..calls.agreement import fingerprint, keys_blob
from ..calls.reader import Call, plain_fits


class Routes:
    """A store's remembered routes.

    Args:
        engine: the store's :class:`mpikv.core.engine.Engine`.
    """

    def __init__(self, engine):
        self._engine = engine
        self._one_key = {}     # (op, key, out None, out is value) -> OneKeyCall
        self._zero_copy = {}   # (op, keys, key types) -> ZeroCopyCall

    def clear(self):
        self._one_key.clear()
        self._zero_copy.clear()

    # -- one key ---------------------------------------------------------------
    def one_key(self, op, key, value, out):
        """The remembered route of a one-key call that can take it, else None."""
        found = self._one_key.get((op, key, out is None, out is value))
        if found is None or not found.accepts(value, out):
            return None
        return found

    def remember_one_key(self, call, key, out):
        """Keeps the route of a one-key call that succeeded, for its repeats."""
        e = self._engine
        if e.optimizer is not None or call.errors or len(call.items) != 1:
            return
        item = call.items[0]
        value = item.values[0] if item.values else None
        target = item.outs[0] if item.outs else None
        if value is not None and (len(item.values) != 1 or type(value) is not np.ndarray):
            return
        if target is not None and (len(item.outs) != 1 or type(target) is not np.ndarray):
            return
        route = e.one_key_route(item.key)
        if route is not None:
            self._one_key[(call.op, key, target is None, target is value)] = OneKeyCall(
                e, call, route)

    # -- zero copy -------------------------------------------------------------
    def zero_copy_call(self, op, key, value, settings):
        """The checked :class:`~mpikv.calls.reader.Call` of a repeated push of a key list's
        zero-copy buffers, else None (the reader then runs)."""
        if type(key) is not list:
            return None
        found = self._zero_copy.get((op, tuple(key), tuple(map(type, key))))
        if found is None or not found.matches(value):
            return None
        return found.call(settings)

    def remember_zero_copy(self, op, key, value, call):
        """Caches a call that hands over exactly the zero-copy buffers of its keys.

        Such a call is then read with one identity check per key: its keys,
        shapes and dtypes cannot have changed, since the buffers are the store's.
        """
        if type(key) is not list or call.errors:
            return
        views = self._engine.zero_copy_views(call.keys)
        # Identity, not same memory: a torch tensor can be pointed at other memory
        # later, and a remembered call is not checked again.
        if views is None or not all(len(i.values) == 1 and i.values[0] is views[i.key]
                                    for i in call.items):
            return
        self._zero_copy[(op, tuple(key), tuple(map(type, key)))] = ZeroCopyCall(
            list(value), call)


class ZeroCopyCall:
    """A remembered push or pushpull of a key list's zero-copy buffers."""

    def __init__(self, values, call):
        self.values = values
        self.template = call
        self.blob = keys_blob(call)

    def matches(self, values):
        # The sum is written into the buffers: one made read-only since is read
        # again (and refused) by the general path.
        return (type(values) in (list, tuple) and len(values) == len(self.values)
                and all(map(operator.is_, values, self.values))
                and all(getattr(getattr(v, "flags", None), "writeable", True) for v in values))

    def call(self, settings):
        t = self.template
        return Call.remembered(t.op, t.items, settings, t.user_keys, self.blob, t.keys,
                               zero_copy=True)


class OneKeyCall:
    """A remembered ``push``, ``pull`` or ``pushpull`` of one key with the default updater.

    Args:
        engine: the store's :class:`mpikv.core.engine.Engine`.
        call: the general path's checked :class:`mpikv.calls.reader.Call` of it.
        route: :meth:`mpikv.core.engine.Engine.one_key_route` of its key.
    """

    __slots__ = ("engine", "op", "shape", "dtype", "stored", "reducer",
                 "what", "epoch", "template", "blob", "digests")

    def __init__(self, engine, call, route):
        item = call.items[0]
        self.engine = engine
        self.op = call.op
        self.shape, self.dtype = item.shape, item.dtype
        self.stored, self.reducer, keys = route
        self.what = (call.op, keys)
        self.epoch = engine.epoch
        self.template = call
        self.blob = keys_blob(call)
        self.digests = {}

    def _array(self, a, written):
        return (plain_fits(a, self.shape, self.dtype, written) and a.flags.c_contiguous
                and not np.may_share_memory(a, self.stored))

    def accepts(self, value, out):
        """Whether this call's arrays can take the remembered route.

        Only arrays the general reader accepts as they are (see
        :func:`mpikv.calls.reader.plain_fits`): the route must never run a call that
        the general path, on another rank, refuses.
        """
        if self.epoch != self.engine.epoch:
            return False
        # pushpull(key, value) writes the sum into value: it is an output too.
        if self.op != "pull" and not self._array(value, out is value):
            return False
        return out is None or out is value or self._array(out, True)

    def digest(self, priority):
        """The general path's fingerprint of the call with this priority."""
        found = self.digests.get(priority)
        if found is None:
            settings = {"priority": priority}
            if self.op != "pull":
                settings["updater"] = None
            self.template.settings = settings
            found = self.digests[priority] = fingerprint(self.template, self.blob)
        return found

    def run(self, value, out):
        """Moves the data of an agreed call."""
        stored, what = self.stored, self.what
        if self.op == "pull":
            np.copyto(out, stored.reshape(self.shape))
            return
        flat = value.reshape(-1)
        if out is value:  # pushpull(key, value): sum in the caller's array, keep a copy
            self.reducer.allreduce(flat, None, what)
            np.copyto(stored, flat)
            return
        self.reducer.allreduce(stored, flat, what)
        if out is not None:
            np.copyto(out, stored.reshape(self.shape))
