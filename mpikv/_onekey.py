"""Repeated one-key calls (MXNet Gluon's per-parameter ``pushpull``): checked and run
with a few dictionary lookups and one agreement, nothing else.

A :class:`OneKeyCall` is made after a one-key call succeeded on the general
path; it holds what that call computed (the fingerprint per priority, the
stored value, the reducers). A later call with arrays of the same kind runs
here; anything unusual, or a change of the store's state (its
:attr:`~mpikv.engine.Engine.epoch`), sends it back to the general path. The
fingerprint is the general path's, so ranks on either path still agree.
"""

import numpy as np

from .agreement import fingerprint, keys_blob
from .calls import plain_fits


class OneKeyCall:
    """A remembered ``push``, ``pull`` or ``pushpull`` of one key with the default updater.

    Args:
        engine: the store's :class:`mpikv.engine.Engine`.
        call: the general path's checked :class:`mpikv.calls.Call` of it.
        route: :meth:`mpikv.engine.Engine.one_key_route` of its key.
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
        :func:`mpikv.calls.plain_fits`): the route must never run a call that
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
