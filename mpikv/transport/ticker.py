"""A daemon thread that calls a function every few seconds: watchdogs, listeners, heartbeats."""

import atexit
import threading


class Ticker:
    """Calls ``tick()`` on a daemon thread every ``period`` seconds until stopped.

    Args:
        tick: called on the thread; a False result (not None) ends the thread.
        period: seconds between calls, or a callable that returns them (read
            before each wait).
        name: the thread's name.
        stop_at_exit: stop and join the thread at the end of the process. The
            hook is registered at :meth:`start`, so it runs before every hook
            registered earlier (mpi4py's ``MPI_Finalize`` among them).
    """

    def __init__(self, tick, period, name, stop_at_exit=False):
        self._tick = tick
        self._period = period if callable(period) else (lambda: period)
        self._name = name
        self._stop_at_exit = stop_at_exit
        self._stopped = threading.Event()
        self._thread = None

    def start(self):
        """Starts the thread (once)."""
        if self._thread is not None:
            return
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        if self._stop_at_exit:
            atexit.register(self.stop)

    def stop(self):
        """Ends the thread and waits for it (a no-op when it is not running)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopped.set()
        if thread is not threading.current_thread():
            thread.join()

    def _run(self):
        while not self._stopped.wait(self._period()):
            if self._tick() is False:
                return
