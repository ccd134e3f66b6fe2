"""Ending the job instead of hanging: the watchdog, uncaught exceptions, ``MPI_Abort``.

MPI has no timeouts, and an exception on one rank leaves the others waiting
in a collective forever. These helpers end the whole job with ``MPI_Abort``
after saying why on standard error, and after every rank has shown its flight
recorder (:mod:`mpikv.flight`): the rank that ends the job asks the others
(a small message on ``COMM_WORLD``, answered by a listener thread), so that
its message says which call each rank was last in.
"""

import os
import sys
import threading
import time
import traceback
import weakref

from .. import flight
from .ticker import Ticker

#: Exit codes passed to MPI_Abort.
EXCEPTION_EXIT_CODE = 1
TIMEOUT_EXIT_CODE = 3

#: tags of the flight-recorder exchange on COMM_WORLD (high: clear of users' usual tags)
_ASK, _ANSWER = 32011, 32012
#: how long the ending rank waits for the others' last calls
ANSWER_WAIT = 3.0
#: how long a rank leaves the first report of an error that every rank raised
#: to the rank that reports it, before it prints its own traceback; that rank
#: waits a little longer before it ends the job (see install_exception_hook)
HEADLINE_WAIT = 0.5
_LINGER = HEADLINE_WAIT + 0.5

_hook_installed = False
_aborting = threading.Lock()
_shown = threading.Lock()      # a rank shows its ring once
_listener = None


def format_what(what):
    """``("push", [3, 5])`` -> ``"push (keys 3, 5)"``, with long key lists cut short."""
    op, keys = what
    if not keys:
        return op
    shown = ", ".join(repr(k) for k in keys[:8])
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    return f"{op} (key{'s' if len(keys) > 1 else ''} {shown}{more})"


def abort(message, code, linger=0.0):
    """Prints ``message``, shows every rank's flight recorder, and aborts the job.

    Args:
        linger: seconds to wait after the message, before the flight recorders
            (the other ranks' tracebacks of the same error come in between).
    """
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if _lost_a_rank():   # ULFM: MPI_Abort would end mpiexec with status 0; end with the survivors
        _end_as_survivor(message, code)
    if not _aborting.acquire(blocking=False):
        time.sleep(ANSWER_WAIT + 5)   # another thread of this rank is ending the job
        world.Abort(code)
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    time.sleep(linger)
    try:
        text = _last_calls(world, message.split("\n", 1)[0])
    except Exception as exc:  # noqa: BLE001 - the report must never stop the abort
        text = f"mpikv: (the flight recorder could not be shown: {exc!r})"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    world.Abort(code)


def _lost_a_rank():
    """Whether a fault-tolerant store of this process lost a rank (:mod:`.ulfm`)."""
    ulfm = sys.modules.get(__package__ + ".ulfm")
    return ulfm is not None and ulfm.lost_a_rank()


def _end_as_survivor(message, code):
    """After a lost rank: the message, then this process ends with the other survivors."""
    from .ulfm import end_survivor
    sys.stderr.write(message.rstrip("\n") + "\n")
    end_survivor(code)


def _show_ring(rank, reason):
    """Prints this rank's ring, or writes it under ``MPIKV_TRACE_DIR`` (once)."""
    calls = flight.RECORDER.entries()
    if not _shown.acquire(blocking=False):
        return calls
    directory = os.environ.get("MPIKV_TRACE_DIR")
    if directory:
        try:
            path = flight.write(directory, rank, calls, reason)
            sys.stderr.write(f"[rank {rank}] mpikv: flight recorder written to {path}\n")
        except OSError as exc:
            sys.stderr.write(f"[rank {rank}] mpikv: cannot write the flight recorder "
                             f"under {directory}: {exc}\n{flight.format_ring(rank, calls)}\n")
    else:
        sys.stderr.write(flight.format_ring(rank, calls) + "\n")
    sys.stderr.flush()
    return calls


def _last_calls(world, reason):
    """Shows this rank's ring, asks every other rank to show its own, and returns
    the lines that say which call each rank was last in."""
    rank, size = world.Get_rank(), world.Get_size()
    lasts = {rank: flight.last_call(_show_ring(rank, reason))}
    if size > 1 and _listener is not None:
        sent = [world.isend((rank, reason), dest=r, tag=_ASK) for r in range(size) if r != rank]
        deadline = time.monotonic() + ANSWER_WAIT
        while len(lasts) < size and time.monotonic() < deadline:
            message = world.improbe(tag=_ANSWER)
            if message is not None:
                r, line = message.recv()
                lasts[r] = line
                continue
            _answer(world, rank)   # another rank may be ending the job at the same time
            time.sleep(0.01)
        for request in sent:   # kept until here: an unsent request must stay alive
            request.Test()
    where = (f"written under {os.environ['MPIKV_TRACE_DIR']} (merge them: mpikv trace DIR)"
             if os.environ.get("MPIKV_TRACE_DIR") else "printed with [rank N] prefixes")
    lines = [f"mpikv: the last call of each rank (flight recorders {where}):"]
    for r in range(size):
        lines.append(f"  rank {r}: {lasts.get(r, f'no answer within {ANSWER_WAIT:g} s')}")
    return "\n".join(lines)


def _answer(world, rank):
    """Answers a request for this rank's last call, if one came; returns whether one did."""
    message = world.improbe(tag=_ASK)
    if message is None:
        return False
    asker, reason = message.recv()
    calls = _show_ring(rank, f"asked by rank {asker}: {reason}")
    world.isend((rank, flight.last_call(calls)), dest=asker, tag=_ANSWER).Wait()
    return True


def start_listener():
    """Starts this process's thread that answers flight-recorder requests (once;
    MPI must allow calls from several threads). It stops before MPI finalizes."""
    global _listener
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if _listener is not None or world.Get_size() == 1 or \
            MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return
    rank = world.Get_rank()

    def listen():
        if MPI.Is_finalized():
            return False
        try:
            _answer(world, rank)
        except MPI.Exception as exc:
            if exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                         MPI.ERR_REVOKED):
                return False   # ULFM: a rank of COMM_WORLD died; nobody asks any more
            raise
        return True

    # Its exit hook is registered after mpi4py's finalizer: it runs before it.
    _listener = Ticker(listen, 0.25, "mpikv-flight-recorder", stop_at_exit=True)
    _listener.start()


def headline(exc):
    """``"mpikv: MismatchError: <message>"``: the first line of the report of ``exc``."""
    return f"mpikv: {type(exc).__name__}: {exc}"


def _wait_for_first(exc, rank):
    """Whether another rank reports ``exc`` (the same error, raised on every rank by
    their agreement): it says so first and ends the job."""
    first = getattr(exc, "first_rank", None)
    return first is not None and first != rank


def exit_failed(exc, abort_job=True):
    """Ends a process whose store's exit call failed (the others were in another
    call), without hanging: the error once on standard error, a nonzero status.

    The rank that reports the error (:attr:`mpikv.MPIKVError.first_rank`) prints
    it and ends the job, with every rank's flight recorder; another rank waits
    for that, and ends the job itself only if it does not come.

    Args:
        exc: the exception of the exit call.
        abort_job: end the whole job (``MPI_Abort``); else print and end this
            process alone (``abort_on_exception`` off).
    """
    from mpi4py import MPI
    line = headline(exc)
    if not abort_job:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(EXCEPTION_EXIT_CODE)
    if _wait_for_first(exc, MPI.COMM_WORLD.Get_rank()):
        time.sleep(_LINGER + ANSWER_WAIT + 5)   # its MPI_Abort ends this process
        abort(line, EXCEPTION_EXIT_CODE)   # it did not
    abort(line, EXCEPTION_EXIT_CODE, linger=_LINGER)


def install_exception_hook():
    """Makes an uncaught exception on any rank end the job (once per process).

    The traceback is printed with the rank on every line, then ``MPI_Abort``
    stops the other ranks, which would otherwise wait in their next collective.

    An mpikv error that the ranks' agreement raised alike on every rank of a
    call (:attr:`mpikv.MPIKVError.first_rank`) is reported once, first:
    ``mpikv: MismatchError: <message>`` by the lowest of those ranks, which
    ends the job a second later; the others print only their ``[rank N]``
    traceback, meanwhile (and end the job themselves if that rank does not).
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
        if _lost_a_rank():
            _end_as_survivor(f"mpikv: uncaught {exc_type.__name__} on rank {rank} of {size}, "
                             f"after a lost rank; ending with the survivors\n{lines}",
                             EXCEPTION_EXIT_CODE)
        uncaught = (f"mpikv: uncaught {exc_type.__name__} on rank {rank} of {size}; "
                    f"aborting the job so no rank waits forever\n")
        if getattr(exc, "first_rank", None) is None:
            abort(uncaught + lines, EXCEPTION_EXIT_CODE)
        if _wait_for_first(exc, rank):
            time.sleep(HEADLINE_WAIT)   # the reporting rank's headline comes first
            sys.stderr.write(lines)
            sys.stderr.flush()
            time.sleep(_LINGER + ANSWER_WAIT + 5)   # its MPI_Abort ends this process
            abort(f"{headline(exc)}\n{uncaught}", EXCEPTION_EXIT_CODE)   # it did not
        abort(f"{headline(exc)}\n{uncaught}{lines}", EXCEPTION_EXIT_CODE, linger=_LINGER)

    sys.excepthook = hook
    _hook_installed = True


#: the watchdogs started and not stopped, all checked by one thread: a process
#: may hold hundreds of stores, and a thread each would take turns at the GIL
_watched = weakref.WeakSet()
_watched_lock = threading.Lock()
#: held to start or stop the thread (never by the thread itself: stop joins it)
_checker_lock = threading.Lock()


def _watched_now():
    with _watched_lock:
        return list(_watched)


def _check_all():
    now = time.monotonic()
    for dog in _watched_now():
        try:
            dog._check(now)
        except Exception:  # noqa: BLE001 - one store's failure must not end the others' watch
            traceback.print_exc()


def _shortest_period():
    return min((dog.period for dog in _watched_now()), default=1.0)


_checker = Ticker(_check_all, _shortest_period, "mpikv-watchdog")


class Watchdog:
    """Ends the job when a blocking collective outlives its deadline.

    Blocking MPI calls cannot be interrupted, so a daemon thread (one for all
    the watchdogs of the process) checks the deadline that :meth:`watch` arms
    around each call. Arming costs two attribute writes; the thread wakes a few
    times per timeout period.

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
        self._started = False
        self._stopped = False
        #: seconds between checks
        self.period = min(1.0, max(timeout / 10, 0.01))
        #: ``(exception, what)`` -> raises a better error, or returns (fault-tolerant
        #: stores: :meth:`mpikv.transport.ulfm.Recovery.check`); None: nothing
        self.on_failure = None

    def stop(self):
        """Stops watching (the store is closed: nothing is armed any more)."""
        self._stopped = True
        with _checker_lock:
            with _watched_lock:
                _watched.discard(self)
                idle = not _watched
            if idle:
                _checker.stop()

    def watch(self, what, late=None):
        """A context manager that arms the deadline for one call.

        Args:
            what: ``(operation, keys)``, for the message.
            late: for an agreement, an object with ``early`` (seconds),
                ``limit`` (seconds), ``announce()`` (called once after
                ``early``) and ``missing()`` (the ranks to name on timeout).
        """
        return _Watch(self, what, late)

    def start(self):
        """Starts watching, if not yet started (and not stopped); cheap when it watches."""
        if not self._started and self.timeout != float("inf") and not self._stopped:
            self._started = True
            with _checker_lock:
                with _watched_lock:
                    _watched.add(self)
                _checker.start()

    def _check(self, now):
        """Announces late agreements, and ends the job for calls past their deadline."""
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
            dog.start()
            dog._armed[threading.get_ident()] = [time.monotonic(), self.what, self.late]

    def __exit__(self, exc_type, exc, tb):
        self.dog._armed.pop(threading.get_ident(), None)
        if exc is not None and self.dog.on_failure is not None:
            self.dog.on_failure(exc, self.what)   # a lost rank: RankLostError instead
