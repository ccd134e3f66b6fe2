"""The life of a store's collective call: agree, run, record, end.

:class:`mpikv.KVStore` reads a call's arguments into a checked
:class:`~mpikv.calls.reader.Call`; everything after that happens here, the same way
for every call:

1. **agree**: the ranks compare fingerprints of their calls in one small
   collective (:meth:`mpikv.transport.base.Transport.agree`); if any rank's
   call is bad or differs, every rank raises the same error, nothing applied;
2. **run**: the data moves (:class:`mpikv.core.engine.Engine`) on this thread, or
   on the store's worker thread for asynchronous calls, after the calls made
   before it;
3. **record / end**: the flight recorder (:mod:`mpikv.flight`) notes each step.

A rank that has run out of data joins (:class:`mpikv.store.join.Joiner`, over this
protocol's public steps): it replays the other ranks' calls with zeros until
every rank has joined.
"""

import itertools
import threading
import weakref

import numpy as np

from .. import errors, flight
from .executor import Executor
from .routes import Routes
from ..calls.agreement import explain, fingerprint, format_ranks, in_context, is_joined, record
from ..calls.reader import Call
from ..transport import staging as _staging
from ..transport.base import AGREED, JOINED

#: the calls that ranks which have not joined may make while others have
JOINABLE = ("push", "pull", "pushpull", "barrier", "gather_gradients", "allreduce_")
#: numbers the distributed stores of this process for the flight recorder
_DIST_STORES = itertools.count()
#: the number the next distributed store gets (its creation is recorded under it)
_next_store = [0]


def next_store_number():
    """The flight-recorder number the next distributed store of this process gets."""
    return _next_store[0]


def _take_store_number():
    number = next(_DIST_STORES)
    _next_store[0] = number + 1
    return number


class CallHook:
    """The handle of a call hook: ``remove()`` takes the hook off (torch's
    ``RemovableHandle`` shape); removing it again does nothing."""

    def __init__(self, hooks, ref):
        self._hooks, self._ref = hooks, ref

    def remove(self):
        """Stops calling the hook."""
        # In place and in one step: close on one thread and a collection on another
        # may remove hooks at once; hooks whose objects are gone leave too.
        self._hooks[:] = [r for r in self._hooks if r is not self._ref and r() is not None]


class Protocol:
    """Runs a store's checked calls on every rank alike.

    Args:
        transport: the store's transport.
        engine: the store's :class:`mpikv.core.engine.Engine`.
    """

    def __init__(self, transport, engine):
        self.transport = transport
        self.engine = engine
        self.routes = Routes(engine)
        self._executor = Executor(transport.threaded, self._background_error,
                                  lambda exc: isinstance(exc, errors.RankLostError))
        # The flight recorder numbers distributed stores in creation order (the same
        # on every rank: creation is collective) and their calls in call order.
        self._trace_id = _take_store_number() if transport.size > 1 else None
        self._calls = 0
        self._failure = None   # (error class, message) of fail_next_call, or None
        self.closed = False
        # What this rank is doing in its caller's terms (set_context):
        # (activity, hint, (activity, hint) at exit), or None.
        self.context = None
        self._exited = False
        # Callables (weakly held) run before each call: a Trainer's launcher makes
        # store calls on a thread of its own, and must be drained before a call of
        # the user's comes in (see add_call_hook).
        self._settlers = []
        # One thread at a time in the store's calls (see one_caller): the thread
        # inside and how deep, the call it is in, and a refusal not yet agreed on.
        self._inside = threading.Lock()
        self._owner = None
        self._depth = 0
        self._owner_op = None
        self._refused = None

    # -- what every call goes through ------------------------------------------
    def add_call_hook(self, fn):
        """Runs ``fn()`` (a bound method, held weakly) before every later call:
        whoever makes store calls on a thread of its own waits for them there, so
        that the store never takes calls from two threads at once.

        Returns:
            a :class:`CallHook` whose ``remove()`` takes the hook off.

        Raises:
            ValueTypeError: ``fn`` is not a bound method.
        """
        if getattr(fn, "__self__", None) is None or not hasattr(fn, "__func__"):
            raise errors.ValueTypeError(f"add_call_hook takes a bound method, not "
                                        f"{type(fn).__name__}")
        ref = weakref.WeakMethod(fn)
        self._settlers.append(ref)
        return CallHook(self._settlers, ref)

    def settle(self):
        """Runs the call hooks (:meth:`add_call_hook`): before any call of this thread."""
        for ref in list(self._settlers):
            method = ref()
            if method is not None:
                method()

    def enter(self, op):
        """Marks the start of a call of this thread (a call within a call of the same
        thread nests); pair it with :meth:`leave`.

        A store takes calls from one thread at a time: a call while another thread
        is in one is refused here, before any collective, and the other thread's
        call goes on unaffected; this rank's next call then fails on every rank
        with the same error (see docs/store.md, "Threads").

        Raises:
            ConcurrentCallError: another thread of this rank is in a call of the store.
        """
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        if not self._inside.acquire(blocking=False):
            self._refuse(op)
        self._owner, self._depth, self._owner_op = me, 1, op
        if self._refused is not None:
            # Refused on this rank only: every rank learns it from this call's agreement.
            if self._failure is None:
                self._failure = (errors.ConcurrentCallError, self._refused)
            self._refused = None

    def leave(self):
        """Marks the end of the call :meth:`enter` started."""
        self._depth -= 1
        if not self._depth:
            self._owner = self._owner_op = None
            self._inside.release()

    def _refuse(self, op):
        names = {t.ident: t.name for t in threading.enumerate()}
        rule = (f"{op} called from thread {threading.current_thread().name!r} while thread "
                f"{names.get(self._owner, self._owner)!r} was in this store's "
                f"{self._owner_op} call: a store takes calls from one thread at a time "
                f"(docs/store.md, Threads)")
        self._refused = f"refused earlier: {rule}"
        raise errors.ConcurrentCallError(
            f"{rule}; nothing was applied, the other thread's call goes on; this rank's next "
            f"call of the store raises this error on every rank")

    def fail_next_call(self, exc_class, message):
        """Makes this rank's next collective call fail on every rank, nothing applied.

        For adapters (:mod:`mpikv.mxnet`) whose own checks of a call's
        arguments run before the store reads them: a failure found on one rank
        then reaches every rank through the call's agreement, as the store's
        own input errors do, instead of leaving the others waiting.

        Args:
            exc_class: an :class:`~mpikv.errors.MPIKVError` subclass.
            message: the error's text (every rank's message names this rank).
        """
        self._failure = (exc_class, str(message))

    def set_context(self, activity, hint=None, exit=None):
        """Says what this rank is doing, in its caller's terms; not collective.

        Each later call carries it in the record the ranks gather when their
        calls differ (it is not compared: ranks in different contexts that make
        the same call agree). When the ranks made different calls and differ
        in context, the :class:`~mpikv.errors.MismatchError` says what each
        rank was doing, the ranks with a hint first, then the hints:
        ``rank 0 called save_checkpoint after step 12 while rank 1 is in step
        13: save_checkpoint is collective: every rank must call it``. The torch
        Trainer sets it for its steps and its collective calls.

        Args:
            activity: words that complete "rank N ...", for one rank ("is in
                step 13"; a leading is/has/was becomes are/have/were for
                several); None forgets the context.
            hint: what to do about a difference, when this rank's call is the
                odd one ("save_checkpoint is collective: every rank must call
                it"), or None.
            exit: ``(activity, hint)`` for the end of the process in this
                context (see below), or None: ``"ended its process"``, no hint.
                Its hint also ends the message of a call of this rank's that
                times out waiting for ranks that did not arrive.

        At the end of the process every store not closed makes one agreed
        "exit" call, so a rank still in a call of the others gets this error
        within seconds rather than at the timeout.
        """
        if activity is None:
            self.context = None
            self.transport.late_hint = None
            return
        if exit is not None:
            exit = (str(exit[0]), None if exit[1] is None else str(exit[1]))
        self.context = (str(activity), None if hint is None else str(hint), exit)
        # (the exit's hint: a rank that does not come is as one that ended its process)
        self.transport.late_hint = None if exit is None else exit[1]

    def said(self):
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
        # An adapter's pending failure, or a call refused to another thread, is not
        # the exit's: the end of the process has nothing left to keep apart.
        self._failure = self._refused = None
        self._executor.drain()
        context = self.context
        exit = None if context is None else context[2]
        self.context = (*(exit or ("ended its process", None)), None)
        try:
            self.collective(Call("exit"), action or (lambda: None))
        finally:
            self.context = context
        self._exited = True

    def drain(self):
        """Waits for this store's background calls (their errors stay with their handles)."""
        self._executor.drain()

    def collective(self, call, action):
        """A call that is not a data movement: agreed, background calls drained,
        ``action()`` run. Returns what ``action`` returns."""
        self.settle()
        self.enter(call.op)
        try:
            entry = self._agree(call)
            self._executor.drain()
            result = action()
            flight.ended(entry)
            return result
        finally:
            self.leave()

    def run(self, call, push=False, pull=False, remember=None):
        """A data call (push, pull, pushpull): agreed, then run on this thread after
        earlier background calls.

        Args:
            remember: ``(key, out)`` of a one-key call, whose route is then kept
                for its repeats (see :meth:`one_key`).
        """
        self.settle()
        self.enter(call.op)
        try:
            entry = self._agree(call)
            job = self.job(call, push, pull, self._executor.busy)
            self._executor.run(job, (call.op, call.keys))
            flight.ended(entry)
            if remember is not None and type(remember[0]) in (int, str):
                self.routes.remember_one_key(call, *remember)
        finally:
            self.leave()

    def submit(self, call, push=False, pull=False, action=None):
        """A data call in the background: agreed now; returns its :class:`Handle`.

        Args:
            action: runs the call instead of a push or pull (``gather_gradients``).
        """
        self.settle()
        self.enter(call.op)
        try:
            entry = self._agree(call)
            job = self.job(call, push, pull, self._executor.threaded, action)
            if entry is not None:
                def traced(run=job):
                    run()
                    flight.ended(entry)
                job = traced
            return self._executor.submit(job, (call.op, call.keys))
        finally:
            self.leave()

    def one_key(self, op, key, value, out, priority, general):
        """Runs a repeated one-key call on its remembered route; False if it has none.

        The agreement is the general path's (the same fingerprint), so ranks that
        take different paths still agree, or all raise the same error.

        Args:
            general: returns the general path's checked call, for the errors of a
                call some rank got wrong.
        """
        if (type(key) is not int and type(key) is not str or type(priority) is not int
                or self._failure is not None or self._refused is not None or self.closed
                or self._executor.busy):
            return False
        route = self.routes.one_key(op, key, value, out)
        if route is None:
            return False
        self.settle()
        self.enter(op)
        try:
            entry = self.begin(op, route.what[1], priority, out if value is None else value)
            verdict = self.transport.agree(route.digest(priority), False, route.what)
            if verdict != AGREED:
                self._disagree(general(), verdict == JOINED, entry)
            flight.agreed(entry)
            route.run(value, out)
            flight.ended(entry)
        finally:
            self.leave()
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
        """Ends the store on every rank (collective, as ``MPI_Comm_free``).

        Waits for this rank's background calls, agrees with the other ranks,
        then releases the store's worker and watchdog threads, its two
        communicators, its optimizer states and scratch buffers. Arrays handed
        out (:meth:`~mpikv.KVStore.value_buffers`,
        :meth:`~mpikv.KVStore.gradient_buffers`) stay valid: node shared-memory windows are freed at exit, not here. Any later call
        raises :class:`~mpikv.errors.InputError` on every rank; closing again
        does nothing. ``with mpikv.create(...) as kv:`` closes on leaving the
        block normally (after an exception the store is left open: the other
        ranks may still be in a call).

        Here: background calls drain, the ranks agree, then ``release()``.
        """
        if self.closed:
            return
        self.settle()
        self.enter("close")
        try:
            self._executor.drain()
        finally:
            self.leave()

        def end():
            self.closed = True
            self.routes.clear()
            self._executor.stop()
            release()
        self.collective(Call("close"), end)

    # -- the steps -------------------------------------------------------------
    def job(self, call, push, pull, background, action=None):
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
        what = (call.op, call.keys)
        if self.closed:   # the same on every rank: close() is collective
            raise errors.InputError(f"{call.op}: the store is closed (close() was called)")
        if self._failure is not None:  # an adapter's check failed (fail_next_call)
            (cls, message), self._failure = self._failure, None
            call.errors.insert(0, (cls.__name__, None, message))
        entry = self.begin(call.op, call.keys, call.settings.get("priority", 0), call.items)
        verdict = self.transport.agree(fingerprint(call, call.blob), bool(call.errors), what)
        if verdict != AGREED:
            self._disagree(call, verdict == JOINED, entry)
        flight.agreed(entry)
        return entry

    def begin(self, op, keys, priority, data=()):
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
        records = self.transport.allgather_records(record(call, self.said()), what)
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
        from ..transport.watchdog import EXCEPTION_EXIT_CODE, abort
        abort(f"mpikv: rank {self.transport.rank}: {text}", EXCEPTION_EXIT_CODE)


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
