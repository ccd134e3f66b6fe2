"""mpikv: MXNet's KVStore API on MPI, with no parameter servers."""

from ._executor import Handle
from ._version import __version__
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .rowsparse import RowSparse

__all__ = ["create", "Handle", "RowSparse", "__version__", *_errors_all]


def create(name="local", comm=None, timeout=None, **options):  # noqa: D401
    """Creates a key-value store (see :func:`mpikv.kvstore.create`)."""
    from .kvstore import create as _create
    return _create(name, comm=comm, timeout=timeout, **options)
