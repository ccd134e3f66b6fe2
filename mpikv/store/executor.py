"""Running data movement in the background, in the order calls were made.

Every rank submits the same calls in the same order (the collective rule), so
one worker thread per store, taking calls first in, first out, issues the same
MPI collectives in the same order on every rank. Blocking MPI calls release
the GIL, so the caller computes while a bucket moves.
"""

import queue
import sys
import threading
import traceback
import weakref

_live = weakref.WeakSet()


def drain_all():
    """Waits for every store's background calls (before MPI or its windows go away)."""
    for executor in list(_live):
        executor.drain()


class Handle:
    """A call running in the background; :meth:`wait` for it before touching its arrays."""

    __slots__ = ("_event", "_error", "what")

    def __init__(self, what, done=False):
        self.what = what
        self._error = None   # what the call raised, where the executor hands it over
        self._event = threading.Event()
        if done:
            self._event.set()

    def done(self):
        """Whether the call has finished."""
        return self._event.is_set()

    def wait(self):
        """Blocks until the call has finished.

        Raises:
            mpikv.RankLostError: a rank was lost during the call (a fault-tolerant
                store: the same error on every survivor).
        """
        self._event.wait()
        if self._error is not None:
            raise self._error

    def __repr__(self):
        return f"<mpikv.Handle {self.what[0]} {'done' if self.done() else 'running'}>"


class Executor:
    """Runs store operations inline, or on one worker thread when asked to.

    Args:
        threaded: whether background execution is possible (MPI must allow
            calls from several threads); if not, "asynchronous" calls run
            before they return.
        on_error: called with the formatted traceback when a background call
            raises; it must end the job (the other ranks would wait forever).
        hands_over: whether an exception a background call raised is one that
            every rank meets alike (a fault-tolerant store's agreed
            :class:`mpikv.RankLostError`): it is then raised by the call's
            :meth:`Handle.wait` instead of ending the job.
    """

    def __init__(self, threaded, on_error, hands_over=lambda exc: False):
        self.threaded = threaded
        self._on_error = on_error
        self._hands_over = hands_over
        #: the first exception handed over to a handle (later waits raise it too)
        self.failure = None
        self._queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = None
        _live.add(self)

    @property
    def busy(self):
        """Whether submitted calls are still running (a new call would go to the worker)."""
        return bool(self._pending)

    def run(self, fn, what):
        """Runs ``fn`` now, after everything submitted before it."""
        if self._pending:
            self.submit(fn, what).wait()
        else:
            fn()

    def submit(self, fn, what):
        """Queues ``fn``; returns its :class:`Handle`."""
        if not self.threaded:
            fn()
            return Handle(what, done=True)
        handle = Handle(what)
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="mpikv-comm", daemon=True)
            self._thread.start()
        self._queue.put((fn, handle))
        return handle

    def drain(self):
        """Waits until every submitted call has finished."""
        with self._idle:
            while self._pending:
                self._idle.wait()

    def stop(self):
        """Waits for every submitted call, then ends the worker thread (if it started)."""
        self.drain()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        _live.discard(self)

    def _work(self):
        while True:
            item = self._queue.get()
            if item is None:   # stop()
                return
            fn, handle = item
            try:
                fn()
            except BaseException as exc:
                if not self._hands_over(exc):
                    self._on_error(f"{handle.what[0]} failed in the background\n"
                                   f"{traceback.format_exc()}")
                    sys.exit(1)  # not reached: on_error ends the job
                # Every survivor's call fails alike (the ranks agreed on the loss):
                # its waiter raises it, the calls queued after it fail the same way.
                handle._error = exc
                if self.failure is None:
                    self.failure = exc
            fn = None   # (its closure holds the caller's arrays)
            handle._event.set()
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
