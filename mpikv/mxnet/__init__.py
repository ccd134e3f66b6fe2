"""MXNet's own clients on an mpikv store: ``mpikv.mxnet``.

Gluon's ``Trainer`` and ``mx.mod.Module`` drive it unchanged, by name or as
an object (MXNet 1.9.1 with numpy < 1.24: ``pip install mpikv[mxnet]``)::

    import mpikv.mxnet        # registers the store names with MXNet
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore="mpikv_dist_sync")      # the one changed argument

Importing this package does not import MXNet: the names are registered when
MXNet is imported (at once if it already is), and :func:`create` imports it.
"""

import sys

from ._hook import after_import

#: the mpikv store types, each registered with MXNet as ``"mpikv_" + type``
STORE_TYPES = ("local", "device", "dist_sync", "dist_sync_device", "dist_device_sync")

__all__ = ["create", "register", "KVStore", "STORE_TYPES"]


def create(name="dist_sync", comm=None, **options):
    """Creates an MXNet KVStore on mpikv (an ``mx.kv.KVStoreBase``); collective for
    distributed types.

    Args:
        name: "dist_sync" (default), "dist_sync_device", "local" or "device",
            with or without the ``mpikv_`` prefix.
        comm: an mpi4py intra-communicator (default ``MPI.COMM_WORLD``).
        **options: :func:`mpikv.create`'s options (``timeout``, ``bigarray_bound`` ...).

    Returns:
        :class:`mpikv.mxnet.store.KVStore`.
    """
    register()
    from .store import KVStore
    return KVStore(name, comm=comm, **options)


def register():
    """Registers the ``mpikv_*`` names with MXNet's ``KVStoreBase`` (imports MXNet).

    Returns:
        The registered names (``"mpikv_dist_sync"``, ...).
    """
    from .store import register_names
    return register_names()


def __getattr__(name):
    if name == "KVStore":
        from .store import KVStore
        return KVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_quietly():
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - a broken MXNet must not break its own import
        import warnings
        warnings.warn(f"mpikv.mxnet could not register its stores with MXNet: "
                      f"{type(exc).__name__}: {exc}", stacklevel=2)


if "mxnet" in sys.modules:
    _register_quietly()
else:
    after_import("mxnet", _register_quietly)
