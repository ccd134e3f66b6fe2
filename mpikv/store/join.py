"""``kv.join()``: a rank out of data takes part in the others' calls with zeros.

A rank that has run out of batches joins: until every rank has joined it
waits for the other ranks' calls, reads each one's record, and replays its
part in it (zeros in a push, its share of the owners' updates, a barrier...),
showing each replayed call to its caller's ``on_call`` as a
:class:`ReplayedCall`. Calls that joined ranks cannot take part in are the
other ranks' error to raise (:data:`mpikv.store.protocol.JOINABLE`).
"""

import ast

import numpy as np

from ..arrays import backends
from .. import errors, flight
from .protocol import JOINABLE
from ..calls.agreement import explain, is_joined, joined_record
from ..calls.reader import Call, Item
from ..dtypes import VALUE_DTYPES

#: the low bits of a join ticket hold the rank
_RANK_BITS = 20


class Joiner:
    """A store's ``join``: its rank's part in the others' calls, over its protocol.

    Args:
        protocol: the store's :class:`mpikv.store.protocol.Protocol`.
    """

    def __init__(self, protocol):
        self.protocol = protocol

    def join(self, on_call=None, follow_optimizer=True):
        """Takes part in the other ranks' calls with zeros until every rank has joined.

        For uneven data, as Horovod's ``join``: a rank that has run out of
        batches calls it; until every rank has called it, this rank adds
        zeros to the others' pushes, pushpulls and :meth:`~mpikv.KVStore.allreduce_` calls,
        runs its owner's share of the updates, and takes part in their pulls,
        barriers and ``gather_gradients``. Any other call made by a rank that
        has not joined (init, a save...) is a :class:`MismatchError` on the
        ranks that made it (the joined ranks keep waiting). Collective: it
        returns on every rank once the last rank has joined.

        Args:
            on_call: for a layer above the store that has its own part in the
                others' calls (``mpikv.torch.Trainer.join``): called on this
                thread with a :class:`ReplayedCall` (``op``, ``keys``,
                ``settings``, ``done``, ``array``) before each call this rank
                takes part in, and with the same object after its data moved.
                Before an allreduce_ it may return this rank's array (the
                others' shape and dtype, writable and contiguous; the sum is
                written into it) instead of zeros; otherwise it returns None
                (else ``TypeError``). An exception it raises leaves ``join``
                on this rank only: the others wait, until the exception ends
                the job (``abort_on_exception``) or the timeout does.
            follow_optimizer: a replayed push installs the others' optimizer
                hyperparameters (a ``set_learning_rate`` this rank did not
                see) as a fresh optimizer with this rank's update count and
                states. False keeps this rank's optimizer object, for a caller
                that shares the hyperparameters itself.

        Returns:
            int: the rank that joined last (of ranks that joined in the same
            call of the others, the highest).
        """
        p = self.protocol
        p.settle()
        p.enter("join")   # one thread at a time, as every call of the store
        try:
            return self._join(p, on_call, follow_optimizer)
        finally:
            p.leave()

    def _join(self, p, on_call, follow_optimizer):
        p.drain()
        t = p.transport
        # Larger for a later join, the same on every rank for the same moment.
        ticket = ((t.agreements + 1) << _RANK_BITS) | t.rank
        what = ("join", [])
        # What this rank says in the others' records while it is joined: the
        # context it joined in (its caller may change the context meanwhile).
        mine = joined_record(p.said())
        while True:
            entry = p.begin("join", [], 0)
            active, last = t.wait_joined(ticket, what)
            flight.agreed(entry)
            if not active:
                flight.ended(entry)
                return last & ((1 << _RANK_BITS) - 1)
            records = t.allgather_records(mine, what)
            rec = next(r for r in records if not is_joined(r))
            flight.relabel(entry, f"join: {rec['op']}", [k for k, _, _ in rec["keys"]],
                           record_nbytes(rec))
            # A call that is bad among the others, or that joined ranks cannot take
            # part in: theirs to raise; this rank waits for the next one.
            if explain(records) is None and rec["op"] in JOINABLE:
                self.replay(rec, on_call, follow_optimizer)
            flight.ended(entry)

    def replay(self, rec, on_call, follow_optimizer):
        """A joined rank's part in another rank's call (its ``record``), shown to
        ``on_call`` before and after its data moves."""
        call = ReplayedCall(rec["op"], [k for k, _, _ in rec["keys"]], dict(rec["settings"]))
        given = None if on_call is None else on_call(call)
        if given is not None and call.op != "allreduce_":
            raise TypeError(f"kv.join(on_call=): on_call returned {type(given).__name__} "
                            f"before a {call.op}; only an allreduce_ takes this rank's array")
        if call.op == "allreduce_":
            call.array = contribution(given, call.settings)
            self.protocol.transport.allreduce_(call.array, ("allreduce_", []))
        else:
            self.replay_data(rec, follow_optimizer)
        if on_call is not None:
            call.done = True
            if on_call(call) is not None:
                raise TypeError(f"kv.join(on_call=): on_call returned a value after a "
                                f"{call.op}; it gives an array only before an allreduce_")

    def replay_data(self, rec, follow_optimizer):
        """A key call or a barrier, run with zeros in."""
        op, p = rec["op"], self.protocol
        if op == "barrier":
            p.transport.barrier(("barrier", []))
            return
        keys = [k for k, _, _ in rec["keys"]]
        engine = p.engine
        if op == "gather_gradients":
            engine.gather_grads(op, keys)
            return
        # Zeros pushed from the key list's own gradient buffers, if it has them, leave
        # the owned sums there, as a zero-copy push does on the other ranks.
        bufs = None if op == "pull" else engine.zero_copy_views(keys)
        if bufs is not None:
            for key in keys:
                bufs[key][...] = 0
        items = [Item(key, outs=[], shape=tuple(shape), dtype=np.dtype(dtype),
                      values=([] if op == "pull" else
                              [engine.zeros_of(key) if bufs is None else bufs[key]]))
                 for key, shape, dtype in rec["keys"]]
        if follow_optimizer:
            engine.follow_optimizer(rec["settings"].get("optimizer"))
        call = Call(op, items=items, settings=rec["settings"])
        call.zero_copy = bufs is not None
        p.job(call, op != "pull", op != "push", False)()


class ReplayedCall:
    """A call of the other ranks that a joined rank takes part in, as ``on_call`` sees it.

    :meth:`mpikv.KVStore.join` hands the same object to ``on_call`` twice:
    before the call's data moves (``done`` False) and after (``done`` True).

    Attributes:
        op: "push", "pull", "pushpull", "barrier", "gather_gradients" or
            "allreduce_".
        keys: the call's keys in the store's order; ``[]`` for a barrier or an
            allreduce_.
        settings: a copy of the call's settings as the other ranks made it:
            ``priority``, ``updater``, ``optimizer`` (its config),
            ``compression``; an allreduce_'s ``shape`` and ``dtype`` (strings)
            and its ``tag``, if it has one.
        done: whether the data has moved.
        array: an allreduce_'s array on this rank once done (the sum, in
            the array ``on_call`` gave, or in zeros); None otherwise.
    """

    __slots__ = ("op", "keys", "settings", "done", "array")

    def __init__(self, op, keys, settings):
        self.op, self.keys, self.settings = op, keys, settings
        self.done = False
        self.array = None

    def __repr__(self):
        return (f"<ReplayedCall {self.op} keys={self.keys!r} "
                f"{'done' if self.done else 'before its data moves'}>")


def allreduce_layout(settings):
    """An allreduce_'s ``(shape, dtype)`` from its settings."""
    name = settings["dtype"]
    dtype = VALUE_DTYPES.get(name)   # bfloat16 by its ml_dtypes name
    return ast.literal_eval(settings["shape"]), dtype if dtype is not None else np.dtype(name)


def contribution(given, settings):
    """This rank's array in a replayed allreduce_: ``on_call``'s, checked, or zeros.

    Raises:
        ValueTypeError: ``given`` is not a writable, contiguous array of the
            other ranks' shape and dtype (the sum would be wrong, or never end).
    """
    shape, dtype = allreduce_layout(settings)
    if given is None:
        return np.zeros(shape, dtype)
    array = backends.as_native(given, writable=True, what="on_call's allreduce_ array")[1]
    if tuple(array.shape) != tuple(shape) or array.dtype != dtype:
        raise errors.ValueTypeError(
            f"on_call's allreduce_ array is {array.dtype} {tuple(array.shape)}; the other "
            f"ranks sum {dtype} {tuple(shape)}")
    if not array.flags.c_contiguous:
        raise errors.ValueTypeError("on_call's allreduce_ array is not contiguous")
    return array


def record_nbytes(rec):
    """The bytes of a call another rank made (its keys', or an allreduce_'s array);
    keys a bad call names without a shape or dtype (unknown keys) count 0."""
    if rec["op"] == "allreduce_" and "shape" in rec["settings"]:
        shape, dtype = allreduce_layout(rec["settings"])
        return int(np.prod(shape)) * dtype.itemsize
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
               for _, shape, dtype in rec["keys"] if shape is not None and dtype is not None)


__all__ = ["Joiner", "ReplayedCall", "contribution"]
