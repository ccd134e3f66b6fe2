"""The Trainer's launcher: the store calls that backward starts, made off autograd's thread.

Each bucket's ``push_async`` (and ``gather_gradients_async``) first agrees
with the other ranks (:meth:`mpikv.store.protocol.Protocol.submit`): one small
blocking collective. Made in autograd's hook, it would hold backward until
every rank had reached that bucket. The :class:`Launcher` makes those calls
on a thread of its own, in the order they were queued (buckets leave in
order, the same on every rank), so backward goes on and a fast rank computes
while a slow one catches up.

The store is not made for calls from two threads at once. The invariant:
while the launcher holds calls, the Trainer makes no other store call; each
of its store calls first waits for the launcher (:meth:`Launcher.drain`), the
Trainer's own through ``Trainer.kvstore``, its helpers' through a
:class:`SettledStore`.
"""

import atexit
import queue
import threading
import weakref

#: the launchers with a thread, drained at the end of the process
_live = weakref.WeakSet()
_at_exit = []


class Launcher:
    """Makes queued calls in order, on one daemon thread, or inline.

    Args:
        threaded: whether to use a thread (MPI must allow calls from several
            threads); if not, :meth:`submit` makes the call before it returns.
        abort_on_exception: the store's option: how a call that fails at the
            end of the process ends it (see :func:`_end_of_process`).
    """

    def __init__(self, threaded, abort_on_exception=True):
        self.threaded = bool(threaded)
        self.abort_on_exception = abort_on_exception
        self._queue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error = None
        self._thread = None
        if self.threaded:
            _live.add(self)
            _end_at_exit()

    @property
    def thread(self):
        """A threaded launcher's thread, from its first call until :meth:`close`; else
        None."""
        return self._thread

    def submit(self, fn):
        """Queues ``fn()`` behind the calls queued before it (inline: calls it now).

        After a queued call raised, the later ones are dropped until
        :meth:`drain` has re-raised its exception: every rank's agreement
        failed at the same call, so every rank drops the same calls.
        """
        if not self.threaded:
            fn()
            return
        with self._idle:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="mpikv-launcher",
                                                daemon=True)
                self._thread.start()
        self._queue.put(fn)

    def drain(self):
        """Waits until every queued call was made; re-raises, here, the first
        exception one of them raised (and forgets it)."""
        if not self.threaded:
            return
        with self._idle:
            while self._pending:
                self._idle.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self):
        """Ends the thread after the calls queued (no wait, nothing re-raised): for a
        Trainer dropped without ``close()``."""
        if self._thread is not None:
            self._queue.put(None)

    def on_thread(self):
        """Whether the caller is the launcher's own thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self):
        """:meth:`drain` (re-raising), then ends the thread; later calls run inline."""
        try:
            self.drain()
        finally:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
                thread.join()
            self.threaded = False
            _live.discard(self)

    def _work(self):
        while True:
            fn = self._queue.get()
            if fn is None:   # close()
                return
            error = None
            if self._error is None:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - re-raised by drain()
                    error = exc
            # The call's closure holds the Trainer's arrays and store: not while idle.
            fn = None
            with self._idle:
                if error is not None:
                    self._error = error
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()


class SettledStore:
    """A store seen through ``settle``: each attribute is looked up after
    ``settle()`` (the Trainer's: its launcher drained), so a helper's store call
    never overlaps the launcher's.

    Args:
        kv: the store.
        settle: a bound method, held weakly (a module's hooks may outlive the
            Trainer; the store must not keep it alive).
    """

    __slots__ = ("_kv", "_settle")

    def __init__(self, kv, settle):
        self._kv = kv
        self._settle = weakref.WeakMethod(settle)

    def __getattr__(self, name):
        settle = self._settle()
        if settle is not None:
            settle()
        return getattr(self._kv, name)

    def __repr__(self):
        return f"<settled {self._kv!r}>"


def _end_at_exit():
    """Registers :func:`_end_of_process` once. A launcher is made after its store,
    so this comes after the stores' own exit hook (registered by :func:`mpikv.create`),
    and atexit runs it first: the launchers are empty before the stores make
    their agreed "exit" calls, which must not overlap a launcher's agreement."""
    if not _at_exit:
        atexit.register(_end_of_process)
        _at_exit.append(True)


def _end_of_process():
    """Makes the calls still queued (a process that ends between backward and
    step) and ends the threads. A call that fails there (the other ranks ended
    their processes, or are in another call) ends this process as the store's
    failed exit call does: the error on standard error, a nonzero status."""
    from ..transport.world import mpi_running
    if not mpi_running():   # the program finalised MPI itself
        return
    for launcher in list(_live):
        try:
            launcher.close()
        except Exception as exc:  # noqa: BLE001 - the process must end, not hang
            from ..transport.watchdog import exit_failed
            exit_failed(exc, launcher.abort_on_exception)


__all__ = ["Launcher", "SettledStore"]
