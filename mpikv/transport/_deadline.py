"""Ending the job instead of hanging: timeouts and uncaught exceptions.

MPI has no timeouts, and an exception on one rank leaves the others waiting
in a collective forever. These helpers end the whole job with ``MPI_Abort``
after saying why on standard error.
"""

import sys
import threading
import time
import traceback

#: Exit codes passed to MPI_Abort.
EXCEPTION_EXIT_CODE = 1
TIMEOUT_EXIT_CODE = 3

_hook_installed = False


def format_what(what):
    """``("push", [3, 5])`` -> ``"push (keys 3, 5)"``, with long key lists cut short."""
    op, keys = what
    if not keys:
        return op
    shown = ", ".join(repr(k) for k in keys[:8])
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    return f"{op} (key{'s' if len(keys) > 1 else ''} {shown}{more})"


def abort(message, code):
    """Prints ``message`` and aborts every process of the job."""
    from mpi4py import MPI
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)


def install_exception_hook():
    """Makes an uncaught exception on any rank end the job (once per process).

    The traceback is printed with the rank on every line, then ``MPI_Abort``
    stops the other ranks, which would otherwise wait in their next collective.
    """
    global _hook_installed
    if _hook_installed:
        return
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return

    def hook(exc_type, exc, tb):
        rank, size = world.Get_rank(), world.Get_size()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        lines = "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())
        abort(f"mpikv: uncaught {exc_type.__name__} on rank {rank} of {size}; "
              f"aborting the job so no rank waits forever\n{lines}", EXCEPTION_EXIT_CODE)

    sys.excepthook = hook
    _hook_installed = True


class Watchdog:
    """Ends the job when a blocking collective outlives its deadline.

    Blocking MPI calls cannot be interrupted, so a daemon thread checks the
    deadline that :meth:`watch` arms around each call. Arming costs two
    attribute writes; the thread wakes a few times per timeout period.

    Args:
        timeout: seconds (``math.inf``: never).
        rank: this rank, for the message.
    """

    def __init__(self, timeout, rank):
        self.timeout = timeout
        self.rank = rank
        # thread id -> [start, what, late(, announced)]: the comm thread and the caller
        self._armed = {}
        # The caller's agreement, armed by plain writes (it is the hot path):
        # [start, what, late] or None.
        self.agreement = None
        self._thread = None

    def watch(self, what, late=None):
        """A context manager that arms the deadline for one call.

        Args:
            what: ``(operation, keys)``, for the message.
            late: for an agreement, an object with ``early`` (seconds),
                ``limit`` (seconds), ``announce()`` (called once after
                ``early``) and ``missing()`` (the ranks to name on timeout).
        """
        return _Watch(self, what, late)

    def _start(self):
        if self._thread is None and self.timeout != float("inf"):
            self._thread = threading.Thread(target=self._run, name="mpikv-watchdog", daemon=True)
            self._thread.start()

    def _run(self):
        period = min(1.0, max(self.timeout / 10, 0.01))
        while True:
            time.sleep(period)
            now = time.monotonic()
            entries = list(self._armed.items())
            agreement = self.agreement
            if agreement is not None:
                entries.append(("agreement", agreement))
            for ident, armed in entries:
                start, what, late = armed[:3]
                if late is None:
                    if now > start + self.timeout:
                        abort(f"mpikv: rank {self.rank}: {format_what(what)} did not complete "
                              f"within {self.timeout:g} s (a rank is stuck or gone); ending the "
                              f"job. create(timeout=) or MPIKV_TIMEOUT sets the limit.",
                              TIMEOUT_EXIT_CODE)
                    continue
                if self._current(ident) is not armed:
                    continue   # finished meanwhile
                if now > start + late.early and len(armed) == 3:
                    armed.append(True)   # announced once
                    late.announce()
                if now > start + late.limit and self._current(ident) is armed:
                    late.expire(what)

    def _current(self, ident):
        return self.agreement if ident == "agreement" else self._armed.get(ident)


class _Watch:
    __slots__ = ("dog", "what", "late")

    def __init__(self, dog, what, late=None):
        self.dog, self.what, self.late = dog, what, late

    def __enter__(self):
        dog = self.dog
        if dog.timeout != float("inf"):
            dog._start()
            dog._armed[threading.get_ident()] = [time.monotonic(), self.what, self.late]

    def __exit__(self, *exc):
        self.dog._armed.pop(threading.get_ident(), None)
