"""A lost rank as one agreed error: ULFM (MPI's User-Level Failure Mitigation).

Under a ULFM launch (``scripts/mpirun.sh --ft``, i.e. ``mpiexec --with-ft ulfm``)
the launcher no longer ends the job when a rank dies, and an MPI call that
involves the dead rank returns ``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED``
once a peer revoked the communicator) instead of aborting. A fault-tolerant
store turns the first such error into :class:`mpikv.RankLostError` on every
survivor: it revokes the store's communicators (every survivor still inside,
or later entering, a call of the store gets ``MPI_ERR_REVOKED`` at once), then
``MPI_Comm_shrink`` agrees on the survivors (the failed set is the ranks the
shrunk communicator lacks: the same on every survivor, whoever saw what), and
the survivors exchange which call each was in, so the message is the same
everywhere. See docs/fault-tolerance.md.

After a loss ``MPI_Finalize`` would wait for the dead rank forever, and a
survivor whose process ends makes the launcher end the others: the survivors
end together (:func:`end_survivor`: a barrier on the survivors' communicator,
then ``os._exit``), at the interpreter's exit or from the exception hook.

A rank declared lost may still have a process: one stopped (SIGSTOP) or hung
stops its heartbeats without dying, and the launcher would wait for it forever
after the survivors ended. The survivors kill the lost ranks' processes on their
host (:func:`fence`): a stopped one at the recovery, any one left at their end.
"""

import atexit
import os
import signal
import sys
import threading
import time

from mpi4py import MPI

from ..errors import FaultToleranceUnavailableError, MismatchError, RankLostError
from .ticker import Ticker

#: MPI error classes that mean "a process of this communicator failed".
FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})
#: mpi4py 4's ULFM methods (the store calls Revoke, Shrink and Is_revoked; all of
#: them must be there: mpi4py 3 has none)
NEEDED = ("Revoke", "Shrink", "Agree", "Get_failed", "Ack_failed", "Is_revoked")
#: launcher programs whose command line says whether the launch is ULFM's
LAUNCHERS = ("prterun", "prte", "mpiexec", "mpirun", "orterun")

_TRUE = ("1", "true", "yes", "on", "enabled", "t", "y")


def is_failure(exc):
    """Whether ``exc`` is an MPI error that reports a failed process or a revoked communicator."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURE_CLASSES


# -- is ULFM there? ---------------------------------------------------------------
def library_support():
    """Why mpi4py or the MPI library cannot do ULFM, or None when they can."""
    missing = [name for name in NEEDED if not hasattr(MPI.Comm, name)]
    if missing:
        import mpi4py
        return (f"mpi4py {mpi4py.__version__} has no Comm.{', Comm.'.join(missing)} "
                f"(ULFM needs mpi4py 4)")
    library = MPI.Get_library_version().replace("\x00", "").strip()
    if "Open MPI" not in library:
        return (f"the MPI library is {library.splitlines()[0][:60]!r}; mpikv's fault "
                f"tolerance is built and tested on Open MPI 5 with ULFM")
    try:
        MPI.COMM_SELF.Is_revoked()
    except (NotImplementedError, MPI.Exception) as exc:
        return f"the MPI library has no ULFM (MPI_Comm_is_revoked: {exc})"
    return None


def _parent_argv():
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def launch_support(environ=None, parent_argv=None):
    """Why this process's launch is not a ULFM launch, or None when it is.

    Two signals, both needed:

    - ``OMPI_MCA_mpi_ft_enable`` is true: Open MPI's ULFM is on in this
      process. ``mpiexec --with-ft ulfm`` sets it in every rank's environment
      (a plain launch does not: checked with the pip Open MPI 5.0.11).
    - the launcher keeps the job alive when a rank dies: where this rank's
      parent is the launcher itself (``prterun``/``mpiexec``: always rank 0's
      node), its command line has ``--with-ft`` or ``--enable-recovery``. A
      plain ``mpiexec`` with ``OMPI_MCA_mpi_ft_enable=1`` in the environment
      ends the whole job at a rank's death (measured), so it is refused.
      A rank started by a ``prted`` on another host cannot see the command
      line; there the first signal alone decides (rank 0's decides the job).

    Args:
        environ: the environment (default ``os.environ``).
        parent_argv: the parent process's command line (default: read from /proc).
    """
    env = os.environ if environ is None else environ
    flag = env.get("OMPI_MCA_mpi_ft_enable")
    if flag is None or str(flag).strip().lower() not in _TRUE:
        return ("the launch has no ULFM (OMPI_MCA_mpi_ft_enable is not set): launch with "
                "scripts/mpirun.sh --ft (mpiexec --with-ft ulfm)")
    argv = _parent_argv() if parent_argv is None else parent_argv
    if argv and os.path.basename(argv[0]) in LAUNCHERS and not any(
            a.startswith("--with-ft") or "recovery" in a for a in argv[1:]):
        return (f"the launcher ({os.path.basename(argv[0])}) was started without "
                f"--with-ft ulfm: it would end the whole job when a rank dies; launch with "
                f"scripts/mpirun.sh --ft")
    return None


def _ranks(ranks):
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def agree_on_support(comm, requested):
    """Whether the store on ``comm`` is fault tolerant: the same answer, or the
    same error, on every rank. Collective (one small ``allgather``), made at every
    store's creation so that a rank that alone asked for it cannot hang the others.

    Raises:
        mpikv.FaultToleranceUnavailableError: fault tolerance was asked for and
            some rank has no ULFM (library or launch).
        mpikv.MismatchError: some ranks asked for it and others did not.
    """
    reason = (library_support() or launch_support()) if requested else None
    records = comm.allgather((bool(requested), reason))
    asked = [r for r, (q, _) in enumerate(records) if q]
    if not asked:
        return False
    if len(asked) < len(records):
        others = [r for r in range(len(records)) if r not in asked]
        raise MismatchError(f"create: fault_tolerant=True on {_ranks(asked)} but not on "
                            f"{_ranks(others)}; no store was created")
    reasons = {}
    for r, (_, why) in enumerate(records):
        if why:
            reasons.setdefault(why, []).append(r)
    if reasons:
        raise FaultToleranceUnavailableError(
            "create(fault_tolerant=True): " + "; ".join(
                f"{_ranks(rs)}: {why}" for why, rs in reasons.items())
            + "; no store was created")
    return True


def set_errors_return(*comms):
    """Failures come back as exceptions (``MPI_ERRORS_RETURN``), never ``MPI_Abort``."""
    for comm in comms:
        if comm is not None and comm != MPI.COMM_NULL:
            comm.Set_errhandler(MPI.ERRORS_RETURN)


# -- heartbeats while the program computes ----------------------------------------------
#: seconds between the heartbeat thread's calls into MPI
HEARTBEAT_PERIOD = 0.1
_heartbeat = None


def start_heartbeat(period=HEARTBEAT_PERIOD):
    """Keeps MPI's progress engine turning while no thread is in MPI (once per process).

    Open MPI's failure detector sends its heartbeats from the progress engine.
    A rank that computes for longer than the detector's timeout without an MPI
    call sends none and is declared dead by its peers (measured: a rank asleep
    5 s between two ``Allreduce`` calls, detector timeout 2 s: ``MPI_ERR_PROC_FAILED``
    on the others). Open MPI's own detector thread (``mpi_ft_detector_thread``)
    made even a trivial job hang in ``MPI_Finalize`` here; a daemon thread that
    calls ``Iprobe`` on ``COMM_SELF`` every ``period`` seconds keeps the heartbeats
    going (the same sleeping rank: no error). Needs ``MPI_THREAD_MULTIPLE``; stops
    before MPI finalizes.
    """
    global _heartbeat
    if _heartbeat is not None or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return

    def beat():
        if MPI.Is_finalized():
            return False
        try:
            MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, 32013)
        except MPI.Exception:
            return False
        return True

    # Its exit hook is registered after mpi4py's finalizer: it runs before it.
    _heartbeat = Ticker(beat, period, "mpikv-heartbeat", stop_at_exit=True)
    _heartbeat.start()


def heartbeat_for_launch(environ=None):
    """Starts :func:`start_heartbeat` when this is a ULFM launch and MPI is running,
    whether or not any store is fault tolerant.

    Under ``--ft`` the failure detector watches every rank from ``MPI_Init`` on: a
    rank that computes past its timeout before a fault-tolerant store exists (an
    import of torch after MPI started, a store made with ``fault_tolerant=False``)
    would be declared dead (seen in ``bench ft`` under load).

    Args:
        environ: the environment (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    if str(env.get("OMPI_MCA_mpi_ft_enable", "")).strip().lower() in _TRUE and \
            MPI.Is_initialized() and not MPI.Is_finalized():
        start_heartbeat()


# -- after a failure ----------------------------------------------------------------
class Recovery:
    """Turns a store's first MPI failure into one agreed :class:`RankLostError`.

    Args:
        comms: returns the store's communicators (all are revoked).
        agree_comm: the communicator the survivors shrink (every rank of the
            store reaches it: each of its calls begins with an agreement there).
        world_rank: store rank -> ``COMM_WORLD`` rank (or None).
        timeout: seconds the survivors wait for each other at their end.
        describe: ``what`` (``(operation, keys)``) -> text, for the message.
    """

    def __init__(self, comms, agree_comm, world_rank, timeout, describe=str,
                 calls=lambda: 0):
        self._comms = comms
        self._agree_comm = agree_comm
        self._world_rank = world_rank
        self._timeout = timeout
        self._describe = describe
        self._calls = calls
        self._lock = threading.Lock()
        #: the agreed loss once recovered: a dict of :class:`RankLostError`'s arguments
        self.lost = None
        self.seconds = None  # from the first failure seen here to the agreed error

    def check(self, exc, what):
        """Raises :class:`RankLostError` if ``exc`` reports a failure; else returns."""
        if not is_failure(exc):
            return
        with self._lock:
            if self.lost is None:
                start = time.monotonic()
                self.lost = self._recover(what)
                self.seconds = time.monotonic() - start
        raise RankLostError(**self.lost) from exc

    def _recover(self, what):
        for comm in self._comms():
            try:
                comm.Revoke()
            except MPI.Exception:
                pass   # already revoked, or freed
        old = self._agree_comm
        size, me = old.Get_size(), old.Get_rank()
        shrunk = old.Shrink()   # collective over the survivors: the agreed failed set
        set_errors_return(shrunk)
        group, new = old.Get_group(), shrunk.Get_group()
        where = group.Translate_ranks(list(range(size)), new)
        group.Free()
        new.Free()
        lost = [r for r, w in enumerate(where) if w == MPI.UNDEFINED]
        survivors = [r for r, w in enumerate(where) if w != MPI.UNDEFINED]
        lost_world = [self._world_rank(r) for r in lost]
        # Which call each survivor was in: the store's calls each begin with one
        # agreement, counted alike on every rank. A survivor whose data arrived
        # before the death (a root that sent, then died) completed call k and
        # met the loss entering call k + 1, while another still waited in call k.
        mine = (self._calls(), self._describe(what))
        try:
            records = shrunk.allgather(mine)
        except MPI.Exception:   # another rank died meanwhile: say what this rank knows
            records = [mine]
            survivors_known = [me]
        else:
            survivors_known = survivors
        first = min(n for n, _ in records)
        behind = [r for r, (n, _) in zip(survivors_known, records) if n == first]
        ahead = [r for r, (n, _) in zip(survivors_known, records) if n > first]
        doing = sorted({w for n, w in records if n == first})
        during = "during " + (doing[0] if len(doing) == 1 else " / ".join(doing))
        world = ("" if lost_world == lost else
                 f" (COMM_WORLD {_ranks(w for w in lost_world if w is not None)})")
        split = ""
        if ahead:
            split = (f"; that call completed on {_ranks(ahead)} but not on {_ranks(behind)}: "
                     f"what it gave there is not the others' (RankLostError.completed_on)")
        message = (f"{_ranks(lost)} of {size} lost{world} {during}: the process died; "
                   f"{len(survivors)} survive ({', '.join(map(str, survivors))}){split}. "
                   f"This store is unusable now; a store made on the survivors' "
                   f"communicator (this error's .comm) goes on")
        _SURVIVORS.update(comm=shrunk, timeout=self._timeout)
        _LOST_WORLD.update(w for w in lost_world if w is not None)
        fence(lost_world, stopped_only=True)
        _register_end()
        return dict(message=message, lost=lost, lost_world=lost_world, survivors=survivors,
                    comm=shrunk, call=first, completed_on=ahead, completed_here=me in ahead)


def lost_while_making(comm, exc, timeout, made=()):
    """Raises the agreed :class:`RankLostError` of a rank of ``comm`` lost while a
    store was being made on it (``made``: the communicators made so far, revoked
    with it). Collective over the survivors."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    world_ranks = group.Translate_ranks(list(range(comm.Get_size())), world)
    group.Free()
    world.Free()
    recovery = Recovery(lambda: [comm, *made], comm,
                        lambda r: None if world_ranks[r] == MPI.UNDEFINED else world_ranks[r],
                        timeout, describe=lambda what: what[0])
    recovery.check(exc, ("the store's creation", []))
    raise exc   # (not a failure: check returned)


# -- the lost ranks' processes ------------------------------------------------------------
def processes_of(world_ranks, proc="/proc"):
    """The processes on this host of this job's ``COMM_WORLD`` ranks ``world_ranks``
    (the ranks' own and those they started, wrappers such as ``sh -c`` included):
    those whose environment has this process's ``PMIX_NAMESPACE`` (the job: the
    launcher's name and pid) and one of those ``PMIX_RANK``. Empty without PMIx
    (a singleton, another launcher). Never this process."""
    space = os.environ.get("PMIX_NAMESPACE")
    wanted = {str(r).encode() for r in world_ranks if r is not None}
    if not space or not wanted:
        return []
    space, found = space.encode(), []
    for entry in os.listdir(proc):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"{proc}/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:   # gone, or another user's
            continue
        if env.get(b"PMIX_NAMESPACE") == space and env.get(b"PMIX_RANK") in wanted:
            found.append(int(entry))
    return found


def _stopped(pid, proc="/proc"):
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def fence(world_ranks, stopped_only=False):
    """Kills (SIGKILL) the processes of the lost ``COMM_WORLD`` ranks ``world_ranks``
    that run on this host (:func:`processes_of`); ``stopped_only``: only those
    stopped (SIGSTOP, a debugger). A lost rank's process that never dies keeps
    the launcher waiting after the survivors ended (``prterun`` waits for every
    process it started); a stopped one could otherwise also wake up later in a
    job that went on without it. A lost rank on another host is left to that
    host's survivors (docs/fault-tolerance.md)."""
    for pid in processes_of(world_ranks):
        if stopped_only and not _stopped(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# -- the survivors' end -----------------------------------------------------------------
#: the latest survivors' communicator of this process, once a rank was lost
_SURVIVORS = {}
#: the ``COMM_WORLD`` ranks this process's stores lost
_LOST_WORLD = set()
_registered = False
_ending = threading.Lock()
#: survivor exit status at the interpreter's normal end
NORMAL_EXIT_CODE = 0


def lost_a_rank():
    """Whether a fault-tolerant store of this process has lost a rank."""
    return bool(_SURVIVORS)


def _register_end():
    global _registered
    if not _registered:
        # Registered at the loss, after every hook of mpikv and mpi4py: runs first.
        atexit.register(end_survivor, NORMAL_EXIT_CODE)
        _registered = True


def end_survivor(code):
    """Ends this survivor together with the others: output flushed, a barrier on the
    survivors' communicator (bounded by the store's timeout), then ``os._exit(code)``.

    MPI_Finalize would wait for the dead rank forever; and the launcher ends every
    rank still running as soon as one survivor's process ends, so no survivor
    leaves before all have reached their end. A lost rank's process still on this
    host (stopped, hung) is killed after the barrier: the launcher would wait
    for it. A survivor lost before the barrier (:func:`wait_for_survivors`) is named
    on standard error: the launcher ends it with this process, its last output
    possibly unwritten.
    """
    if not _ending.acquire(blocking=False):   # another thread is ending this process
        time.sleep(3600)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - ending regardless
            pass
    comm = _SURVIVORS.get("comm")
    if comm is not None:
        why = wait_for_survivors(comm, min(_SURVIVORS.get("timeout", 600.0), 600.0))
        if why is not None:
            # The launcher ends the others once this process ends: say why they may
            # end without their last words.
            _say(f"mpikv: rank {MPI.COMM_WORLD.Get_rank()}: {why}; ending without them")
        fence(_LOST_WORLD)
    os._exit(code)


def wait_for_survivors(comm, seconds, world=None):
    """Waits until every survivor of ``comm`` has reached its end (a barrier, at
    most ``seconds``).

    Args:
        comm: the survivors' communicator.
        seconds: the longest wait.
        world: the communicator whose ranks a further loss is named by
            (default ``COMM_WORLD``).

    Returns:
        None once all have; else why not, as text: a survivor lost meanwhile (one
        that died, or that stalled longer than the failure detector's timeout:
        MPI takes it for dead), or the wait's end.
    """
    limit = time.monotonic() + seconds
    try:
        request = comm.Ibarrier()
        while not request.Test():
            if time.monotonic() >= limit:
                return f"the other survivors did not reach their end within {seconds:g} s"
            time.sleep(0.005)
    except MPI.Exception as exc:
        world = MPI.COMM_WORLD if world is None else world
        named = _failed_in(comm, world)
        who = f"COMM_WORLD {_ranks(named)}" if named else "another survivor"
        return (f"{who} lost too, before the survivors' end (MPI error class "
                f"{exc.Get_error_class()}; the failure detector takes a rank that stalls "
                f"longer than its timeout for dead)")
    return None


def _failed_in(comm, world):
    """The ranks in ``world`` of the processes MPI reports failed in ``comm``."""
    try:
        failed = comm.Get_failed()
    except (MPI.Exception, NotImplementedError):
        return []
    group = world.Get_group()
    ranks = failed.Translate_ranks(list(range(failed.Get_size())), group)
    failed.Free()
    group.Free()
    return [r for r in ranks if r != MPI.UNDEFINED]


def _say(line):
    # watchdog._write's twin: importing watchdog here would close an import circle
    out = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    try:
        out.write(line + "\n")
        out.flush()
    except Exception:  # noqa: BLE001 - ending regardless
        pass


__all__ = ["FAILURE_CLASSES", "Recovery", "agree_on_support", "end_survivor", "fence",
           "is_failure", "launch_support", "library_support", "lost_a_rank", "processes_of",
           "set_errors_return", "wait_for_survivors"]
