"""Ending the job instead of hanging: the watchdog, uncaught exceptions, ``MPI_Abort``.

MPI has no timeouts, and an exception on one rank leaves the others waiting
in a collective forever. These helpers end the whole job with ``MPI_Abort``
after saying why on standard error, and after every rank has shown its flight
recorder (:mod:`mpikv.flight`): the rank that ends the job asks the others
(a small message, answered by a listener thread), so that its message says
which call each rank was last in.

That exchange runs on communicators of mpikv's own, never on the user's: one
duplicate per group of ranks that made a store together (:func:`start_listener`),
so a user's ``MPI.COMM_WORLD.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)``
never takes the library's messages, nor the listener the user's.
"""

import atexit
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

#: tags of the flight-recorder exchange (on mpikv's own communicators, see start_listener)
_ASK, _ANSWER = 32011, 32012
#: how long the ending rank waits for the others' last calls
ANSWER_WAIT = 3.0
#: how long a rank leaves the first report of an error that every rank raised
#: to the rank that reports it, before it prints its own traceback; that rank
#: waits a little longer before it ends the job (see install_exception_hook)
HEADLINE_WAIT = 0.5
_LINGER = HEADLINE_WAIT + 0.5

_hook_installed = False
#: whether a distributed store asked to end the job on an uncaught exception:
#: None until one is made (then MPIKV_ABORT_ON_EXCEPTION decides)
_abort_asked = None
_aborting = threading.Lock()
_shown = threading.Lock()      # a rank shows its ring once
_listener = None
#: the flight-recorder exchange's communicators: the ranks of a group of stores
#: (``COMM_WORLD`` ranks, in the group's order) -> ``[comm, usable]``
_talk = {}
_talk_lock = threading.Lock()


def format_what(what):
    """``("push", [3, 5])`` -> ``"push (keys 3, 5)"``, with long key lists cut short."""
    op, keys = what
    if not keys:
        return op
    shown = ", ".join(repr(k) for k in keys[:8])
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    return f"{op} (key{'s' if len(keys) > 1 else ''} {shown}{more})"


def _write(text):
    """Writes ``text`` to the process's standard error, now. A process that ends here
    never returns to an excepthook that wraps mpikv's: torch's puts a buffer in
    ``sys.stderr`` and prints it only once the hook it wraps returns."""
    out = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    out.write(text)
    out.flush()


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
    _write(message.rstrip("\n") + "\n")
    time.sleep(linger)
    try:
        text = _last_calls(world, message.split("\n", 1)[0])
    except Exception as exc:  # noqa: BLE001 - the report must never stop the abort
        text = f"mpikv: (the flight recorder could not be shown: {exc!r})"
    _write(text + "\n")
    world.Abort(code)


def _lost_a_rank():
    """Whether a fault-tolerant store of this process lost a rank (:mod:`.ulfm`)."""
    ulfm = sys.modules.get(__package__ + ".ulfm")
    return ulfm is not None and ulfm.lost_a_rank()


def _end_as_survivor(message, code):
    """After a lost rank: the message, then this process ends with the other survivors."""
    from .ulfm import end_survivor
    _write(message.rstrip("\n") + "\n")
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
            _write(f"[rank {rank}] mpikv: flight recorder written to {path}\n")
        except OSError as exc:
            _write(f"[rank {rank}] mpikv: cannot write the flight recorder "
                   f"under {directory}: {exc}\n{flight.format_ring(rank, calls)}\n")
    else:
        _write(flight.format_ring(rank, calls) + "\n")
    return calls


def _comms():
    """The exchange's communicators still usable, with each member's ``COMM_WORLD`` rank."""
    with _talk_lock:
        return [(entry[0], ranks) for ranks, entry in _talk.items() if entry[1]]


def _last_calls(world, reason):
    """Shows this rank's ring, asks every rank that shares a store with this one
    to show its own, and returns the lines that say which call each rank was last in."""
    rank, size = world.Get_rank(), world.Get_size()
    lasts = {rank: flight.last_call(_show_ring(rank, reason))}
    asked, sent = set(), []
    if _listener is not None:
        for comm, ranks in _comms():
            for r, world_r in enumerate(ranks):
                if world_r is not None and world_r not in asked and world_r != rank:
                    asked.add(world_r)
                    sent.append(comm.isend((rank, reason), dest=r, tag=_ASK))
    deadline = time.monotonic() + ANSWER_WAIT
    while not asked <= set(lasts) and time.monotonic() < deadline:
        got = False
        for comm, _ in _comms():
            message = comm.improbe(tag=_ANSWER)
            if message is not None:
                r, line = message.recv()
                lasts[r] = line
                got = True
        if not got:
            _answer(rank)   # another rank may be ending the job at the same time
            time.sleep(0.01)
    for request in sent:   # kept until here: an unsent request must stay alive
        request.Test()
    where = (f"written under {os.environ['MPIKV_TRACE_DIR']} (merge them: mpikv trace DIR)"
             if os.environ.get("MPIKV_TRACE_DIR") else "printed with [rank N] prefixes")
    lines = [f"mpikv: the last call of each rank (flight recorders {where}):"]
    unasked = ("not asked (it has made no store with this rank)" if _listener is not None
               else "not asked (no listener: no store yet, or MPI is not THREAD_MULTIPLE)")
    for r in range(size):
        missing = f"no answer within {ANSWER_WAIT:g} s" if r in asked else unasked
        lines.append(f"  rank {r}: {lasts.get(r, missing)}")
    return "\n".join(lines)


def _answer(rank):
    """Answers the requests for this rank's last call that came; returns whether one did.

    Args:
        rank: this process's ``COMM_WORLD`` rank.
    """
    from mpi4py import MPI
    answered = False
    for comm, ranks in _comms():
        status = MPI.Status()
        try:
            message = comm.improbe(tag=_ASK, status=status)
        except MPI.Exception as exc:
            if exc.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                             MPI.ERR_REVOKED):
                raise
            _drop(ranks)   # ULFM: a rank of this group died; nobody asks here any more
            continue
        if message is None:
            continue
        asker, reason = message.recv()
        calls = _show_ring(rank, f"asked by rank {asker}: {reason}")
        comm.isend((rank, flight.last_call(calls)), dest=status.Get_source(),
                   tag=_ANSWER).Wait()
        answered = True
    return answered


def _drop(ranks):
    with _talk_lock:
        if ranks in _talk:
            _talk[ranks][1] = False


def start_listener(comm, ranks):
    """Makes the flight-recorder exchange's communicator for the stores over ``comm``
    and starts this process's thread that answers requests (once).

    Collective over ``comm`` when no store over the same ranks was made before
    (a store's creation, where every rank of ``comm`` takes part): a duplicate of
    ``comm`` then carries the exchange for every store over these ranks, until the
    end of the process. The thread needs MPI to allow calls from several threads;
    it stops, and the duplicates are freed, before MPI finalizes.

    Args:
        comm: the store's communicator (the user's).
        ranks: the ``COMM_WORLD`` rank of each rank of ``comm``, in its order.
    """
    global _listener
    from mpi4py import MPI
    ranks = tuple(ranks)
    if len(ranks) < 2:
        return
    with _talk_lock:
        made = ranks in _talk
    if not made:
        # Whether a group has its duplicate is the same on every rank of it: every
        # one of them took part in the creation that made it.
        talk = comm.Dup()
        talk.Set_errhandler(MPI.ERRORS_RETURN)
        with _talk_lock:
            first = not _talk
            _talk[ranks] = [talk, True]
        if first:
            # Registered after mpi4py's finalizer (MPI is up): runs before it.
            atexit.register(_end_listener)
    if _listener is not None or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return
    rank = MPI.COMM_WORLD.Get_rank()

    def listen():
        if MPI.Is_finalized():
            return False
        _answer(rank)
        return True

    _listener = Ticker(listen, 0.25, "mpikv-flight-recorder")
    _listener.start()


def _end_listener():
    """At exit: the listener stops, then the exchange's communicators are freed."""
    from mpi4py import MPI
    if _listener is not None:
        _listener.stop()
    with _talk_lock:
        comms = [entry[0] for entry in _talk.values()]
        _talk.clear()
    if MPI.Is_finalized():
        return
    for talk in comms:
        try:
            talk.Free()
        except MPI.Exception:  # noqa: PERF203 - a group that lost a rank (ULFM): nothing to free
            pass


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
        _write(line + "\n")
        os._exit(EXCEPTION_EXIT_CODE)
    if _wait_for_first(exc, MPI.COMM_WORLD.Get_rank()):
        time.sleep(_LINGER + ANSWER_WAIT + 5)   # its MPI_Abort ends this process
        abort(line, EXCEPTION_EXIT_CODE)   # it did not
    abort(line, EXCEPTION_EXIT_CODE, linger=_LINGER)


def install_exception_hook(abort_on_exception=None):
    """Makes an uncaught exception on any rank of an MPI job end the job.

    Installed at ``import mpikv`` (``abort_on_exception`` None), so that a rank
    that fails before any store exists (a bad argument to the torch drop-in, say)
    ends the job instead of leaving the others in the store's creation forever.
    Until a distributed store is made, ``MPIKV_ABORT_ON_EXCEPTION`` (default on)
    decides; from then on, the job is ended if any store was made with
    ``abort_on_exception`` on. Outside an MPI job of several ranks (MPI not
    initialised, or one rank), the hook found at installation runs instead.

    The traceback is printed with the rank on every line, then ``MPI_Abort``
    stops the other ranks, which would otherwise wait in their next collective.

    An mpikv error that the ranks' agreement raised alike on every rank of a
    call (:attr:`mpikv.MPIKVError.first_rank`) is reported once, first:
    ``mpikv: MismatchError: <message>`` by the lowest of those ranks, which
    ends the job a second later; the others print only their ``[rank N]``
    traceback, meanwhile (and end the job themselves if that rank does not).

    Args:
        abort_on_exception: a distributed store's option, or None (no store).
    """
    global _hook_installed, _abort_asked
    if abort_on_exception is not None:
        _abort_asked = bool(_abort_asked) or bool(abort_on_exception)
    if _hook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not _ends_the_job():
            return previous(exc_type, exc, tb)
        from mpi4py import MPI
        world = MPI.COMM_WORLD
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
            _write(lines)
            time.sleep(_LINGER + ANSWER_WAIT + 5)   # its MPI_Abort ends this process
            abort(f"{headline(exc)}\n{uncaught}", EXCEPTION_EXIT_CODE)   # it did not
        abort(f"{headline(exc)}\n{uncaught}{lines}", EXCEPTION_EXIT_CODE, linger=_LINGER)

    sys.excepthook = hook
    _hook_installed = True


def _ends_the_job():
    """Whether an uncaught exception now ends the job (see install_exception_hook)."""
    from .world import mpi_running
    if not mpi_running():   # (never initialises MPI)
        return False
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() == 1:
        return False
    if _abort_asked is not None:
        return _abort_asked
    raw = os.environ.get("MPIKV_ABORT_ON_EXCEPTION", "1").strip().lower()
    return raw not in ("0", "false", "no", "off")


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
