"""The life of a store's collective call: agree, run, record, end; and join.

:class:`mpikv.KVStore` reads a call's arguments into a checked
:class:`~mpikv.calls.Call`; everything after that happens here, the same way
for every call:

1. **agree**: the ranks compare fingerprints of their calls in one small
   collective (:meth:`mpikv.transport.base.Transport.agree`); if any rank's
   call is bad or differs, every rank raises the same error, nothing applied;
2. **run**: the data moves (:class:`mpikv.engine.Engine`) on this thread, or
   on the store's worker thread for asynchronous calls, after the calls made
   before it;
3. **record / end**: the flight recorder (:mod:`mpikv.flight`) notes each step.

A rank that has run out of data :meth:`~Protocol.join` s: it replays the
other ranks' calls with zeros until every rank has joined, and shows each
replayed call to its caller's ``on_call`` (a :class:`ReplayedCall`).
"""

import ast
import itertools
import weakref

import numpy as np

from . import backends, errors, flight
from ._executor import Executor
from ._routes import Routes
from .agreement import (explain, fingerprint, format_ranks, in_context, is_joined,
                        joined_record, record)
from .calls import Call, Item
from .dtypes import VALUE_DTYPES
from .transport import staging as _staging
from .transport.base import AGREED, JOINED

#: the calls that ranks which have not joined may make while others have
JOINABLE = ("push", "pull", "pushpull", "barrier", "gather_gradients", "allreduce_")
#: the low bits of a join ticket hold the rank
_RANK_BITS = 20
#: numbers the distributed stores of this process for the flight recorder
_DIST_STORES = itertools.count()


class Protocol:
    """Runs a store's checked calls on every rank alike.

    Args:
        transport: the store's transport.
        engine: the store's :class:`mpikv.engine.Engine`.
    """

    def __init__(self, transport, engine):
        self.transport = transport
        self.engine = engine
        self.routes = Routes(engine)
        self._executor = Executor(transport.threaded, self._background_error,
                                  lambda exc: isinstance(exc, errors.RankLostError))
        # The flight recorder numbers distributed stores in creation order (the same
        # on every rank: creation is collective) and their calls in call order.
        self._trace_id = next(_DIST_STORES) if transport.size > 1 else None
        self._calls = 0
        self._failure = None   # (error class, message) of fail_next_call, or None
        self.closed = False
        # What this rank is doing in its caller's terms (set_context):
        # (activity, hint, (activity, hint) at exit), or None.
        self.context = None
        self._exited = False
        # Callables (weakly held) run before each call: a Trainer's launcher makes
        # store calls on a thread of its own, and must be drained before a call of
        # the user's comes in (see add_settler).
        self._settlers = []

    # -- what every call goes through ------------------------------------------
    def add_settler(self, method):
        """Runs ``method()`` (a bound method, held weakly) before every later call:
        whoever makes store calls on a thread of its own waits for them there, so
        that the store never takes calls from two threads at once."""
        self._settlers.append(weakref.WeakMethod(method))

    def remove_settler(self, method):
        self._settlers = [r for r in self._settlers if r() not in (None, method)]

    def _settle(self):
        for ref in list(self._settlers):
            method = ref()
            if method is not None:
                method()

    def fail_next_call(self, exc_class, message):
        """This rank's next call fails on every rank (see :meth:`mpikv.KVStore.fail_next_call`)."""
        self._failure = (exc_class, str(message))

    def set_context(self, activity, hint=None, exit=None):
        """What this rank is doing, for the message of a call the ranks make
        differently (see :meth:`mpikv.KVStore.set_context`)."""
        if activity is None:
            self.context = None
            return
        if exit is not None:
            exit = (str(exit[0]), None if exit[1] is None else str(exit[1]))
        self.context = (str(activity), None if hint is None else str(hint), exit)

    def _said(self):
        """``(activity, hint)`` of the context, for a record; or None."""
        context = self.context
        return None if context is None else context[:2]

    def exit(self, action=None):
        """The end of this rank's process: one agreed "exit" call (unless closed).

        Ranks that all end their processes agree and ``action()`` runs (the
        store's background saves commit); a rank still
        waiting in a call of the others gets a MismatchError at once, which names
        this rank's exit (the context's exit words, else "ended its process").
        Raises that error here too.
        """
        if self.closed or self._exited:
            return
        self._failure = None    # an adapter's pending failure is not the exit's
        self._executor.drain()
        context = self.context
        exit = None if context is None else context[2]
        self.context = (*(exit or ("ended its process", None)), None)
        try:
            self.collective(Call("exit"), action or (lambda: None))
        finally:
            self.context = context
        self._exited = True

    def collective(self, call, action):
        """A call that is not a data movement: agreed, background calls drained,
        ``action()`` run. Returns what ``action`` returns."""
        entry = self._agree(call)
        self._executor.drain()
        result = action()
        flight.ended(entry)
        return result

    def run(self, call, push=False, pull=False, remember=None):
        """A data call (push, pull, pushpull): agreed, then run on this thread after
        earlier background calls.

        Args:
            remember: ``(key, out)`` of a one-key call, whose route is then kept
                for its repeats (see :meth:`one_key`).
        """
        entry = self._agree(call)
        job = self._job(call, push, pull, self._executor.busy)
        self._executor.run(job, (call.op, call.keys))
        flight.ended(entry)
        if remember is not None and type(remember[0]) in (int, str):
            self.routes.remember_one_key(call, *remember)

    def submit(self, call, push=False, pull=False, action=None):
        """A data call in the background: agreed now; returns its :class:`Handle`.

        Args:
            action: runs the call instead of a push or pull (``gather_gradients``).
        """
        entry = self._agree(call)
        job = self._job(call, push, pull, self._executor.threaded, action)
        if entry is not None:
            def traced(run=job):
                run()
                flight.ended(entry)
            job = traced
        return self._executor.submit(job, (call.op, call.keys))

    def one_key(self, op, key, value, out, priority, general):
        """Runs a repeated one-key call on its remembered route; False if it has none.

        The agreement is the general path's (the same fingerprint), so ranks that
        take different paths still agree, or all raise the same error.

        Args:
            general: returns the general path's checked call, for the errors of a
                call some rank got wrong.
        """
        if (type(key) is not int and type(key) is not str or type(priority) is not int
                or self._failure is not None or self.closed or self._executor.busy):
            return False
        route = self.routes.one_key(op, key, value, out)
        if route is None:
            return False
        self._settle()
        entry = self._begin(op, route.what[1], priority, out if value is None else value)
        verdict = self.transport.agree(route.digest(priority), False, route.what)
        if verdict != AGREED:
            self._disagree(general(), verdict == JOINED, entry)
        flight.agreed(entry)
        route.run(value, out)
        flight.ended(entry)
        return True

    def wait(self, handle=None):
        """Waits for a handle, a list of handles, or (``None``) every call made so far.

        Raises:
            mpikv.RankLostError: a rank was lost during a call waited for.
        """
        if handle is None:
            self._executor.drain()
            if self._executor.failure is not None:
                raise self._executor.failure
        elif isinstance(handle, (list, tuple)):
            for h in handle:
                h.wait()
        else:
            handle.wait()

    def close(self, release):
        """Collective: background calls drain, the ranks agree, then ``release()``;
        every later call raises on every rank."""
        if self.closed:
            return
        self._settle()
        self._executor.drain()

        def end():
            self.closed = True
            self.routes.clear()
            self._executor.stop()
            release()
        self.collective(Call("close"), end)

    # -- join ------------------------------------------------------------------
    def join(self, on_call=None, follow_optimizer=True):
        """Takes part in the other ranks' calls with zeros until every rank has joined.

        Args:
            on_call: None, or a function called with a :class:`ReplayedCall`
                before and after each call this rank takes part in (see
                :meth:`mpikv.KVStore.join`).
            follow_optimizer: whether a replayed push installs the other ranks'
                optimizer hyperparameters (:meth:`mpikv.engine.Engine.follow_optimizer`).

        Returns:
            int: the rank that joined last (see :meth:`mpikv.KVStore.join`).
        """
        self._settle()
        self._executor.drain()
        t = self.transport
        # Larger for a later join, the same on every rank for the same moment.
        ticket = ((t.agreements + 1) << _RANK_BITS) | t.rank
        what = ("join", [])
        # What this rank says in the others' records while it is joined: the
        # context it joined in (its caller may change the context meanwhile).
        mine = joined_record(self._said())
        while True:
            entry = self._begin("join", [], 0)
            active, last = t.wait_joined(ticket, what)
            flight.agreed(entry)
            if not active:
                flight.ended(entry)
                return last & ((1 << _RANK_BITS) - 1)
            records = t.allgather_records(mine, what)
            rec = next(r for r in records if not is_joined(r))
            flight.relabel(entry, f"join: {rec['op']}", [k for k, _, _ in rec["keys"]],
                           _record_nbytes(rec))
            # A call that is bad among the others, or that joined ranks cannot take
            # part in: theirs to raise; this rank waits for the next one.
            if explain(records) is None and rec["op"] in JOINABLE:
                self._replay(rec, on_call, follow_optimizer)
            flight.ended(entry)

    def _replay(self, rec, on_call, follow_optimizer):
        """A joined rank's part in another rank's call (its ``record``), shown to
        ``on_call`` before and after its data moves."""
        call = ReplayedCall(rec["op"], [k for k, _, _ in rec["keys"]], dict(rec["settings"]))
        given = None if on_call is None else on_call(call)
        if given is not None and call.op != "allreduce_":
            raise TypeError(f"kv.join(on_call=): on_call returned {type(given).__name__} "
                            f"before a {call.op}; only an allreduce_ takes this rank's array")
        if call.op == "allreduce_":
            call.array = _contribution(given, call.settings)
            self.transport.allreduce_(call.array, ("allreduce_", []))
        else:
            self._replay_data(rec, follow_optimizer)
        if on_call is not None:
            call.done = True
            if on_call(call) is not None:
                raise TypeError(f"kv.join(on_call=): on_call returned a value after a "
                                f"{call.op}; it gives an array only before an allreduce_")

    def _replay_data(self, rec, follow_optimizer):
        """A key call or a barrier, run with zeros in."""
        op = rec["op"]
        if op == "barrier":
            self.transport.barrier(("barrier", []))
            return
        keys = [k for k, _, _ in rec["keys"]]
        engine = self.engine
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
        self._job(call, op != "pull", op != "push", False)()

    # -- the steps -------------------------------------------------------------
    def _job(self, call, push, pull, background, action=None):
        """The data movement of an agreed call, as a function of no arguments.

        ``background``: it may run on the worker thread, which then needs the
        caller's GPU and streams handed over (:func:`mpikv.transport.staging.handover`).
        ``action``: the movement itself, when it is neither a push nor a pull.
        """
        engine, op, items = self.engine, call.op, call.items
        order = _bucket_order(call)
        zero_copy = call.zero_copy

        def job():
            if action is not None:
                action()
                return
            done = engine.push(op, items, order, zero_copy) if push else ()
            # After a zero-copy push with the default updater the buffers are the
            # stored values: nothing to pull.
            if pull and not (zero_copy and engine.updater_kind is None):
                engine.pull(op, items, order, done)
        gpu = None
        if background:  # (engine.gpus scans the keys: only for stores holding GPU values)
            gpu = _staging.handover(_arrays(items), engine.on_gpu,
                                    engine.gpus if engine.on_gpu else ())
        if gpu is None:
            return job

        def job_on_gpu():
            with gpu:
                job()
        return job_on_gpu

    def _agree(self, call):
        """Raises the same MPIKVError on every rank unless all ranks made this call right."""
        self._settle()
        what = (call.op, call.keys)
        if self.closed:   # the same on every rank: close() is collective
            raise errors.InputError(f"{call.op}: the store is closed (close() was called)")
        if self._failure is not None:  # an adapter's check failed (fail_next_call)
            (cls, message), self._failure = self._failure, None
            call.errors.insert(0, (cls.__name__, None, message))
        entry = self._begin(call.op, call.keys, call.settings.get("priority", 0), call.items)
        verdict = self.transport.agree(fingerprint(call, call.blob), bool(call.errors), what)
        if verdict != AGREED:
            self._disagree(call, verdict == JOINED, entry)
        flight.agreed(entry)
        return entry

    def _begin(self, op, keys, priority, data=()):
        """The call's flight-recorder entry (None for a local store).

        ``data``: the call's items, or its one array; their bytes are counted
        only when the store records.
        """
        if self._trace_id is None:
            return None
        self._calls += 1
        nbytes = data.nbytes if isinstance(data, np.ndarray) else _nbytes(data)
        return flight.RECORDER.begin(self._trace_id, self._calls, op, keys, nbytes, priority)

    def _disagree(self, call, joined=False, entry=None):
        """After an agreement that failed, or that found joined ranks: every rank's
        record; one message, raised everywhere, or (joined ranks) the call goes on."""
        what = (call.op, call.keys)
        records = self.transport.allgather_records(record(call, self._said()), what)
        verdict = explain(records)
        if verdict is None and joined and call.op not in JOINABLE:
            verdict = (errors.MismatchError, in_context(records) or (
                f"{call.op}: {format_ranks([r for r, rec in enumerate(records) if is_joined(rec)])} "
                f"joined (kv.join()); until every rank has, only {', '.join(JOINABLE)} can run"))
        if verdict is None and joined:
            return
        if verdict is None:  # fingerprints differed in a way explain() does not name
            verdict = (errors.MismatchError, f"{call.op}: ranks made different calls")
        cls, message = verdict
        flight.failed(entry, cls.__name__)
        error = cls(f"{message}; nothing was applied")
        # Raised alike on every rank that made a call: the lowest of them reports it
        # first if it ends the job (joined ranks raise nothing).
        error.first_rank = self.transport.world_rank(
            next(r for r, rec in enumerate(records) if not is_joined(rec)))
        raise error

    def _background_error(self, text):
        from .transport.watchdog import EXCEPTION_EXIT_CODE, abort
        abort(f"mpikv: rank {self.transport.rank}: {text}", EXCEPTION_EXIT_CODE)


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


def _allreduce_layout(settings):
    """An allreduce_'s ``(shape, dtype)`` from its settings."""
    name = settings["dtype"]
    dtype = VALUE_DTYPES.get(name)   # bfloat16 by its ml_dtypes name
    return ast.literal_eval(settings["shape"]), dtype if dtype is not None else np.dtype(name)


def _contribution(given, settings):
    """This rank's array in a replayed allreduce_: ``on_call``'s, checked, or zeros.

    Raises:
        ValueTypeError: ``given`` is not a writable, contiguous array of the
            other ranks' shape and dtype (the sum would be wrong, or never end).
    """
    shape, dtype = _allreduce_layout(settings)
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


def _record_nbytes(rec):
    """The bytes of a call another rank made (its keys', or an allreduce_'s array);
    keys a bad call names without a shape or dtype (unknown keys) count 0."""
    if rec["op"] == "allreduce_" and "shape" in rec["settings"]:
        shape, dtype = _allreduce_layout(rec["settings"])
        return int(np.prod(shape)) * dtype.itemsize
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
               for _, shape, dtype in rec["keys"] if shape is not None and dtype is not None)


def _nbytes(items):
    """The bytes of a call: each key's first value (or output)."""
    total = 0
    for item in items:
        arrays = item.values or item.outs
        if arrays:
            total += arrays[0].nbytes
    return total


def _arrays(items):
    return [a for item in items for arrays in (item.values, item.outs) for a in arrays]


def _bucket_order(call):
    """key -> priority when a call gives one priority per key, else None."""
    priority = call.settings.get("priority", 0)
    if isinstance(priority, list):
        return dict(zip(call.keys, priority))  # canonical order (see calls.CallReader)
    return None
