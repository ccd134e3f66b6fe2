"""mpikv: MXNet's KVStore API on MPI, with no parameter servers."""

from .store.executor import Handle
from ._version import __version__
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .rows.rowsparse import RowSparse

__all__ = ["create", "KVStore", "Handle", "RowSparse", "__version__", *_errors_all]


def _heartbeat_if_mpi_runs():
    # MPI started before mpikv was imported (``from mpi4py import MPI`` first) under a
    # ULFM launch: the detector's heartbeats from now on, not at the first store only.
    import sys
    if "mpi4py.MPI" in sys.modules:
        from .transport.ulfm import heartbeat_for_launch
        heartbeat_for_launch()


_heartbeat_if_mpi_runs()


def _end_the_job_on_an_uncaught_exception():
    # From import on, not at the first store: a rank that fails before any store
    # exists must not leave the others waiting in the store's creation forever.
    from .transport.watchdog import install_exception_hook
    install_exception_hook()


_end_the_job_on_an_uncaught_exception()


def create(name="local", comm=None, timeout=None, **options):  # noqa: D401
    """Creates a key-value store (see :func:`mpikv.store.factory.create`).

    ``fault_tolerant=True`` (or ``MPIKV_FAULT_TOLERANT=1``): a rank lost during a
    call of a distributed store is one :class:`mpikv.RankLostError` on every
    survivor; refused with :class:`mpikv.FaultToleranceUnavailableError` on every
    rank without a ULFM launch (docs/fault-tolerance.md).
    """
    from .store.factory import create as _create
    return _create(name, comm=comm, timeout=timeout, **options)


def __getattr__(name):
    # The store class on first use: importing it loads the transports and numpy's
    # array code, which ``import mpikv`` alone (a launcher's check) does not need.
    if name == "KVStore":
        from .store.kvstore import KVStore
        return KVStore
    raise AttributeError(f"module 'mpikv' has no attribute {name!r}")
