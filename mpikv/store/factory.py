"""Making a store: :func:`create`, the ranks' agreement on its options, the exit hooks.

:func:`create` resolves the options once (keywords, else the environment:
:mod:`mpikv.store.config`), makes the transport, lets the ranks of a distributed
store compare their options (a bad or differing option is one error on every
rank) and builds the :class:`~mpikv.store.kvstore.KVStore` face over it. A
distributed store not closed makes one agreed "exit" call at the end of the
process (:func:`_end_of_process`).
"""

import atexit

from . import config
from .. import errors, flight
from ..tuning import table as tuning
from ..logs import get_logger
from ..calls.agreement import format_ranks
from ..core.fusion import sizes
from .kvstore import KVStore
from .protocol import next_store_number
from ..transport import make_transport, world

#: store type -> transport kind
STORE_TYPES = {
    "local": "local",
    "device": "local",
    "dist_sync": "mpi",
    "dist_sync_device": "mpi",
    "dist_device_sync": "mpi",  # MXNet accepts both spellings
}

#: options that change which collectives a store calls: they must be equal on every rank
AGREED_OPTIONS = ("bigarray_bound", "bucket_bytes", "direct_bytes", "shared_memory", "reducer",
                  "autotune", "staging_piece")


def create(name="local", comm=None, timeout=None, bigarray_bound=None, abort_on_exception=None,
           bucket_bytes=None, shared_memory=None, reducer=None, autotune=None, direct_bytes=None,
           staging_piece=None, fault_tolerant=None):
    """Creates a store. Collective over ``comm`` for distributed types.

    Args:
        name: "local", "device", "dist_sync" or "dist_sync_device".
        comm: mpi4py intra-communicator of a distributed store (default
            ``MPI.COMM_WORLD``); every rank of it is a worker and an owner.
        timeout: seconds a collective may wait for the other ranks before the
            job is ended, this creation's own collectives included (default
            ``MPIKV_TIMEOUT`` or 600; 0 means never).
        bigarray_bound: arrays of at least this many elements are split over
            all owners (default ``MPIKV_BIGARRAY_BOUND`` or 1,000,000).
        abort_on_exception: end the whole job when an exception escapes on
            any rank (default ``MPIKV_ABORT_ON_EXCEPTION`` or on).
        bucket_bytes: the largest bucket small keys are fused into (default
            ``MPIKV_BUCKET_BYTES`` or 4 MiB); also the largest piece one
            ``Allreduce`` moves.
        shared_memory: put :meth:`KVStore.gradient_buffers` in node-local MPI
            shared memory and sum them straight from the peers' buffers
            (default ``MPIKV_SHARED_MEMORY`` or on).
        reducer: the reduction strategy: "auto" (the tuning table, see
            :mod:`mpikv.tuning.table`) or one of :data:`mpikv.reducers.NAMES`
            (default ``MPIKV_REDUCER`` or "auto").
        autotune: with no tuning cache for this MPI and layout, measure the
            strategies for a few seconds at creation (default
            ``MPIKV_AUTOTUNE`` or on); off: the measured default table.
        direct_bytes: keys of at least this many bytes are summed straight
            from the caller's arrays rather than packed into buckets (default
            ``MPIKV_DIRECT_BYTES`` or 256 KiB). ``device`` stores pack every
            key they do not split, in buckets of at least 32 MiB
            (:func:`mpikv.core.fusion.sizes`).
        staging_piece: device buffers staged through host memory (MPI not
            CUDA-aware) for an ``Allreduce``, ``Reduce`` or ``Bcast`` move in
            pieces of this many bytes, their copies overlapping MPI (default
            ``MPIKV_STAGING_PIECE`` or 4 MiB; 0: whole buffers).
        fault_tolerant: a rank lost during a call of a distributed store is one
            :class:`mpikv.RankLostError` on every survivor (default
            ``MPIKV_FAULT_TOLERANT`` or off); needs a ULFM launch (``scripts/mpirun.sh
            --ft``), else :class:`mpikv.FaultToleranceUnavailableError` on every rank.
            A ``local`` store ignores it. See docs/fault-tolerance.md.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: unknown store type or bad option.
    """
    if not isinstance(name, str):
        raise TypeError(f"store type must be a string, not {type(name).__name__}")
    kind = STORE_TYPES.get(name.lower())
    if kind is None:
        raise ValueError(f"unknown store type {name!r}; valid types: "
                         f"{', '.join(sorted(STORE_TYPES))}")
    if kind == "local" and comm is not None:
        raise ValueError(f"a {name!r} store has no communicator; use a dist_* type with comm=")
    device = "device" in name.lower()
    # A bad option on one rank of a distributed store must not leave the others
    # waiting in the collectives below: every rank raises, after they compared notes.
    try:
        options, failure = config.resolve(
            timeout, bigarray_bound, abort_on_exception, bucket_bytes, shared_memory, reducer,
            autotune, direct_bytes, staging_piece, fault_tolerant=fault_tolerant), None
    except ValueError as exc:
        if kind == "local":
            raise
        options, failure = config.Options(), str(exc)
    if kind == "mpi":
        world.refuse_a_lone_rank()
        transport, device, table = _make_distributed(comm, options, failure, device)
    else:
        transport = make_transport(kind, comm, options)
        table = tuning.resolve(transport, options.reducer, options.autotune)
    store = KVStore(name.lower(), transport, options, table, device,
                    remake=remake_store, on_release=_forget)
    if kind == "mpi":
        _OPEN.append(store)
        _log_made(store, name, transport, options, table, device)
    return store


def _make_distributed(comm, options, failure, device):
    """The transport, the agreed options and the tuning table of a distributed store.

    Its collectives run under the store's watchdog (``timeout``): a rank that
    never comes ends the job, and while it is made the flight recorder names the
    step "create" (the entry leaves the ring once the store is made).
    """
    entry = flight.RECORDER.begin(next_store_number(), 0, "create", [], 0, 0)
    try:
        transport = make_transport("mpi", comm, options)
        _drain_at_exit()
        device = _agree_on_options(transport, options, failure, device)
        flight.agreed(entry)
        table = tuning.resolve(transport, options.reducer, options.autotune)
    except BaseException as exc:
        flight.failed(entry, type(exc).__name__)
        raise
    flight.RECORDER.withdraw(entry)
    return transport, device, table


def _log_made(store, name, transport, options, table, device):
    bucket, direct = sizes(device, options.bucket_bytes, options.direct_bytes)
    get_logger().info(
        "store %s: %d ranks; strategies from %s (4 MiB in place: %s, out of place: %s); "
        "buckets of %d bytes; %s; timeout %g s; "
        "arrays of %d elements or more split; background calls %s", name, transport.size,
        table.source, table.choose(4 << 20, True), table.choose(4 << 20, False),
        bucket, "every key fused" if direct is None else
        f"keys of {direct} bytes or more unfused", options.timeout,
        options.bigarray_bound, "on a worker thread" if transport.threaded
        else "run inline (MPI is not THREAD_MULTIPLE)")


def remake_store(made, lost, **options):
    """A fault-tolerant store over the survivors of a loss; collective over them.

    The one way a store is made again after a lost rank (``kv.run``, the torch
    Trainer's ``run``, :func:`mpikv.store.recovery.create_on_survivors`).

    Args:
        made: the store that lost the rank (its type and options are taken; it is
            abandoned first, on this rank alone), or a store type.
        lost: the :class:`mpikv.RankLostError` every survivor got.
        **options: :func:`create`'s keywords, over the store's own.

    Returns:
        The store; its ranks are the survivors, in their old order.
    """
    if not isinstance(lost, errors.RankLostError) or lost.comm is None:
        raise errors.ValueTypeError(f"a store over the survivors takes the RankLostError "
                                    f"they got, not {type(lost).__name__}")
    if isinstance(made, str):
        name = made
    else:
        made.abandon()
        name, options = made.type, {**made.options, **options}
    options["fault_tolerant"] = True
    return create(name, comm=lost.comm, **options)


_drain_registered = False


def _drain_at_exit():
    """Background calls finish at exit before shared windows are freed and MPI
    finalizes: registered after both (atexit runs the last registered first)."""
    global _drain_registered
    if not _drain_registered:
        import importlib
        importlib.import_module("mpikv.transport.shm")  # registers its hook first
        from .executor import drain_all
        atexit.register(drain_all)
        # Runs before drain_all, the shared windows' release, the flight-recorder
        # listener's end and MPI's finalization: all registered before it.
        atexit.register(_end_of_process)
        _drain_registered = True


#: the distributed stores not closed yet, in creation order (the same on every rank)
_OPEN = []


def open_stores():
    """The distributed stores of this process not closed yet, oldest first (a copy)."""
    return list(_OPEN)


def _forget(store):
    """A store closed: no exit call for it."""
    if store in _OPEN:
        _OPEN.remove(store)


def _end_of_process():
    """At the end of the process, every store still open makes one agreed "exit" call.

    When every rank ends its process, the calls agree and nothing is printed.
    A rank still in a call of the store (in a training step, say) gets a
    MismatchError at once that says this rank's process ended, instead of
    waiting for the timeout; here, the same error is printed on standard error
    and the process ends with a nonzero status
    (:func:`mpikv.transport.watchdog.exit_failed`).
    """
    from ..transport.world import mpi_running
    if not mpi_running():   # the program finalised MPI itself
        return
    # Newest first: a rank waiting in a call of the others waits, most likely, in
    # the store they made last (the order is the same on every rank).
    for store in list(reversed(_OPEN)):
        try:
            store.exit_process()
        except Exception as exc:  # noqa: BLE001 - the process must end, not hang
            from ..transport.watchdog import exit_failed
            exit_failed(exc, store.options["abort_on_exception"])


def _agree_on_options(transport, options, failure, device):
    """Raises the same error on every rank if an option was bad, or differs, on any rank.

    Returns whether the store packs keys as a ``device`` store does
    (:func:`mpikv.core.fusion.sizes`): where any rank's type is a device one. Ranks may
    make different types (a Trainer picks one by where its parameters are); their
    buckets must still be the same.
    """
    mine = {"error": failure, "device": device,
            **{name: getattr(options, name) for name in AGREED_OPTIONS}}
    everyone = transport.allgather_records(mine, ("create", []))
    bad = [(r, o["error"]) for r, o in enumerate(everyone) if o["error"]]
    if bad:
        raise errors.InputError("create: " + "; ".join(
            f"{format_ranks([r])}: {text}" for r, text in bad) + "; no store was created")
    differ = []
    for name in AGREED_OPTIONS:
        values = {}
        for rank, o in enumerate(everyone):
            values.setdefault(repr(o[name]), []).append(rank)
        if len(values) > 1:
            differ.append(f"{name} is " + ", ".join(f"{v} on {format_ranks(rs)}"
                                                     for v, rs in values.items()))
    if differ:
        raise errors.MismatchError("create: ranks gave different store options: "
                                   + "; ".join(differ) + "; no store was created")
    return any(o["device"] for o in everyone)


__all__ = ["AGREED_OPTIONS", "STORE_TYPES", "create", "open_stores", "remake_store"]
