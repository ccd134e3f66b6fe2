"""The store MXNet's own clients drive: an ``mx.kv.KVStoreBase`` over an mpikv store.

Gluon's ``Trainer`` and ``mx.mod.Module`` call ``init``, ``broadcast``,
``push``, ``pull``, ``pushpull``, ``row_sparse_pull``, ``set_optimizer``,
``save_optimizer_states`` and ``load_optimizer_states`` with NDArrays; each
call becomes the mpikv store's call on numpy views of the same memory
(:mod:`mpikv.mxnet.ndarrays`), and the MXNet optimizer becomes mpikv's on the
owners (:mod:`mpikv.mxnet.optimizers`). Every check that fails on one rank
is raised on every rank, through the mpikv call's agreement.
"""

import mxnet as mx

import mpikv

from .._closing import ClosesAfterWith
from .. import errors
from .. import optimizer as mpikv_optimizer
from ..kvstore import STORE_TYPES
from ..statefile import read_manifest
from . import ndarrays, optimizers

#: registered names are this prefix and an mpikv store type
PREFIX = "mpikv_"


class _Updater:
    """What MXNet's ``Trainer.load_states`` reads: ``kvstore._updater.optimizer``."""

    __slots__ = ("optimizer",)

    def __init__(self, optimizer):
        self.optimizer = optimizer


def store_type(name):
    """The mpikv store type of a name: ``"dist_sync"`` or ``"mpikv_dist_sync"``."""
    if not isinstance(name, str):
        raise TypeError(f"store type must be a string, not {type(name).__name__}")
    low = name.lower()
    return low[len(PREFIX):] if low.startswith(PREFIX) else low


class KVStore(ClosesAfterWith, mx.kv.KVStoreBase):
    """An MXNet KVStore whose every rank is a worker and an owner (MPI, no servers).

    Create it with :func:`mpikv.mxnet.create`, or let MXNet create it by
    name: ``gluon.Trainer(..., kvstore="mpikv_dist_sync")``.

    Args:
        name: an mpikv store type ("dist_sync", "dist_sync_device", "local",
            "device"), with or without the ``mpikv_`` prefix.
        comm: an mpi4py intra-communicator (default ``MPI.COMM_WORLD``);
            creating a distributed store is collective over it.
        **options: :func:`mpikv.create`'s other options (``timeout`` ...).
    """

    #: the store type of a class registered by name (see :func:`register_names`)
    default_type = "dist_sync"

    def __init__(self, name=None, comm=None, **options):
        kind = store_type(self.default_type if name is None else name)
        self._kv = mpikv.create(kind, comm=comm, **options)
        self._type = PREFIX + kind
        self._updater = None     # _Updater of the MXNet optimizer, once one is set
        self._follower = None    # keeps the mpikv optimizer in step with it

    # -- what MXNet asks -------------------------------------------------
    @property
    def type(self):
        """``"mpikv_"`` and the store type: contains "dist" for distributed stores, as
        MXNet's Trainer and Module test."""
        return self._type

    @property
    def rank(self):
        """This worker's rank."""
        return self._kv.rank

    @property
    def num_workers(self):
        """The number of workers (MPI ranks)."""
        return self._kv.num_workers

    @property
    def kvstore(self):
        """The mpikv store underneath (:class:`mpikv.kvstore.KVStore`)."""
        return self._kv

    @property
    def optimizer(self):
        """The MXNet optimizer the owners run (the Trainer's object, or after
        :meth:`load_optimizer_states` the file's), or None. The mpikv optimizer
        it became is ``self.kvstore.optimizer``."""
        return None if self._updater is None else self._updater.optimizer

    def is_capable(self, capability):
        """True for ``KVStoreBase.OPTIMIZER``: optimizers run on the owners."""
        if str(capability).lower() == mx.kv.KVStoreBase.OPTIMIZER:
            return True
        raise ValueError(f"Unknown capability: {capability}")

    # -- data ------------------------------------------------------------
    def init(self, key, value):
        """Creates keys with rank 0's values (NDArrays, or lists of them per device)."""
        conv = ndarrays.convert(key, values=value)
        self._run(conv, self._kv.init, key, conv.values)

    def push(self, key, value, priority=0):
        """Sums the values over devices and ranks; the owners run the optimizer."""
        failure = self._follow(key)
        conv = ndarrays.convert(key, values=value)
        self._run(conv, self._kv.push, key, conv.values, priority, failure=failure)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copies the stored values into ``out``; sparse outputs are skipped unless
        ``ignore_sparse`` is False (then they get every row)."""
        conv = ndarrays.convert(key, outs=out, ignore_sparse=ignore_sparse)
        self._run(conv, self._kv.pull, key, conv.outs, priority)

    def pushpull(self, key, value, out=None, priority=0):
        """:meth:`push` then :meth:`pull` in one call; ``out=None`` writes into ``value``."""
        failure = self._follow(key)
        conv = ndarrays.convert(key, values=value, outs=out, write_values=out is None)
        self._run(conv, self._kv.pushpull, key, conv.values, conv.outs, priority,
                  failure=failure)

    def broadcast(self, key, value, out, priority=0):
        """Creates keys with rank 0's ``value``, then pulls them into ``out``."""
        conv = ndarrays.convert(key, values=value, outs=out)
        self._run(conv, self._kv.broadcast, key, conv.values, conv.outs, priority)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Pulls the rows ``row_ids`` into row_sparse outputs.

        mpikv stores values dense: the whole value is pulled and the rows are
        kept from it (a dense ``out`` gets every row).
        """
        failure = None if row_ids is not None else (
            errors.InputError, "row_sparse_pull needs row_ids (the rows to pull)")
        conv = ndarrays.convert(key, outs=out, ignore_sparse=False, row_ids=row_ids)
        self._run(conv, self._kv.pull, key, conv.outs, priority, failure=failure)

    def _run(self, conv, fn, *args, failure=None):
        """Runs the mpikv call ``fn(*args)``; a local failure (``failure``, else the
        conversion's) makes it fail on every rank."""
        failure = failure or conv.failure
        if failure is not None:
            self._kv.fail_next_call(*failure)
        fn(*args)
        conv.finish()
        if self._follower is not None:
            self._follower.written_back()

    def _follow(self, key):
        """Before a push: the MXNet optimizer's current hyperparameters (and the
        keys' multipliers) into mpikv's; a value mpikv refuses fails the push
        on every rank."""
        follower = self._follower
        if follower is None or self._kv.optimizer is not follower.mp:
            return None
        keys = key if isinstance(key, (list, tuple)) else [key]
        try:
            follower.sync([k for k in keys if type(k) in (int, str)])
        except errors.MPIKVError as exc:
            return type(exc), f"optimizer: {exc}"
        return None

    # -- optimizer -------------------------------------------------------
    def set_optimizer(self, optimizer):
        """Runs ``optimizer`` on the owners from now on; collective.

        Args:
            optimizer: an ``mx.optimizer`` SGD, NAG, Adam, RMSProp or LAMB
                (its kind, hyperparameters, schedule and per-parameter
                multipliers; later changes to the object are followed), or an
                :class:`mpikv.optimizer.Optimizer`.

        Raises:
            OptimizerError: on every rank, for an unsupported optimizer or a
                value mpikv refuses on any rank; nothing is set.
        """
        if isinstance(optimizer, mpikv_optimizer.Optimizer):
            self._kv.set_optimizer(optimizer)
            self._updater = self._follower = None
            return
        try:
            mp = optimizers.to_mpikv(optimizer)
        except errors.MPIKVError as exc:
            self._kv.fail_next_call(errors.OptimizerError, str(exc))
            mp = mpikv_optimizer.SGD()  # never installed: the call fails on every rank
        self._kv.set_optimizer(mp)
        self._follower = optimizers.Follower(optimizer, mp)
        self._updater = _Updater(optimizer)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Writes every key's optimizer state (each owner its part); collective.

        With ``dump_optimizer`` the optimizer's kind and hyperparameters are
        saved too, as data (never pickled), and a load makes it the store's.
        """
        failure = self._follow([])
        if failure is not None:
            self._kv.fail_next_call(*failure)
        self._kv.save_optimizer_states(fname, dump_optimizer=dump_optimizer)

    def load_optimizer_states(self, fname):
        """Loads states saved by :meth:`save_optimizer_states`, on any number of ranks.

        As MXNet's store does, a file saved with ``dump_optimizer=True`` brings
        its optimizer: it replaces the one set (``self.optimizer`` is then a
        new MXNet optimizer with the file's hyperparameters, which
        ``Trainer.load_states`` takes); a file without one keeps it.
        """
        file_config, fresh, mx_new, failure = self._file_optimizer(fname)
        current = self._kv.optimizer
        if failure is not None:
            self._kv.fail_next_call(*failure)
        elif fresh is not None and current is not None and not _same_states(current, fresh):
            # The file's states do not fit the optimizer set: it goes first (MXNet's
            # load replaces the optimizer and its states alike).
            self._kv.set_optimizer(fresh)
            try:
                self._kv.load_optimizer_states(fname)
            except errors.MPIKVError as exc:
                self._kv.set_optimizer(current)
                raise type(exc)(f"{exc} (the optimizer set before is back, with fresh "
                                f"states)") from None
            self._adopt(fresh, mx_new)
            return
        self._kv.load_optimizer_states(fname)
        if fresh is not None:
            live = self._kv.optimizer
            if live is not fresh:
                optimizers.copy_hyperparameters(fresh, live)
            self._adopt(live, mx_new)

    def _file_optimizer(self, fname):
        """The optimizer a state file holds: ``(config, mpikv optimizer, MXNet
        optimizer, failure)``; Nones when it holds none or cannot be read here
        (the mpikv load then reports the file on every rank)."""
        try:
            meta = read_manifest(str(fname)).meta
        except Exception:  # noqa: BLE001 - the load itself names the problem, on every rank
            return None, None, None, None
        config = meta.get("optimizer") if meta.get("kind") == "optimizer_states" else None
        if not isinstance(config, dict):
            return None, None, None, None
        try:
            fresh = mpikv_optimizer.from_config(config)
            mx_new = optimizers.to_mxnet(config, like=self.optimizer)
        except errors.MPIKVError as exc:
            return None, None, None, (type(exc), f"{fname!r}: {exc}")
        except Exception as exc:  # noqa: BLE001
            return None, None, None, (errors.StateFileError,
                                      f"{fname!r} holds an optimizer mpikv.mxnet cannot "
                                      f"rebuild ({type(exc).__name__}: {exc})")
        return config, fresh, mx_new, None

    def _adopt(self, mp, mx_new):
        """Makes ``mx_new`` the MXNet optimizer followed into the store's ``mp``."""
        mx_new.num_update = mp.num_update
        self._follower = optimizers.Follower(mx_new, mp)
        self._updater = _Updater(mx_new)

    # -- the rest of MXNet's KVStore ---------------------------------------
    def set_gradient_compression(self, compression_params):
        """MXNet's 2-bit compression (and mpikv's fp16/bf16) of later pushes; collective."""
        self._kv.set_gradient_compression(compression_params)

    def set_updater(self, updater):
        """Runs ``updater(key, input, stored)`` with NDArrays on the owners of each key.

        As MXNet's ``_set_updater``: ``stored`` is updated in place. The
        NDArrays share the store's memory (for a key split across owners: flat
        views of this owner's part). ``None`` restores the default (assign).
        """
        if updater is None:
            self._kv.set_updater(None)
        else:
            self._kv.set_updater(_NDArrayUpdater(updater))
        self._updater = self._follower = None

    _set_updater = set_updater

    def barrier(self):
        """``MPI_Barrier`` over the store's ranks."""
        self._kv.barrier()

    _barrier = barrier

    def save_checkpoint(self, fname):
        """mpikv's checkpoint: values, optimizer and states (see :class:`mpikv.kvstore.KVStore`)."""
        failure = self._follow([])
        if failure is not None:
            self._kv.fail_next_call(*failure)
        self._kv.save_checkpoint(fname)

    def load_checkpoint(self, fname):
        """Loads :meth:`save_checkpoint` files on any number of ranks."""
        self._kv.load_checkpoint(fname)

    def close(self):
        """Ends the store on every rank (collective; see :meth:`mpikv.kvstore.KVStore.close`):
        its threads and communicators are freed; later calls raise on every rank."""
        self._kv.close()
        self._updater = self._follower = None

    def __repr__(self):
        return (f"<mpikv.mxnet.KVStore type={self._type!r} rank={self.rank} "
                f"num_workers={self.num_workers}>")


def _same_states(a, b):
    """Whether optimizers ``a`` and ``b`` keep the same state arrays."""
    import numpy as np
    return type(a) is type(b) and all(
        a.state_names_for(d) == b.state_names_for(d) for d in (np.float32, np.float16))


class _NDArrayUpdater:
    """An MXNet updater run by the store on numpy arrays: NDArrays over the same memory."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, key, inp, stored):
        import numpy as np
        # numpy exports DLPack only from writeable arrays; the input is read, never written.
        if not inp.flags.writeable:
            inp = np.array(inp)
        nd_in = mx.nd.from_dlpack(inp.__dlpack__())
        nd_stored = mx.nd.from_dlpack(stored.__dlpack__())
        self.fn(key, nd_in, nd_stored)
        # MXNet's operators run asynchronously: done before the store reads `stored`
        # or reuses `inp`'s memory.
        mx.nd.waitall()


def register_names():
    """Registers ``mpikv_<type>`` for every mpikv store type with MXNet's ``KVStoreBase``,
    so ``mx.kv.create`` and a Trainer's ``kvstore=`` string find them. Idempotent.

    Returns:
        The registered names.
    """
    registry = mx.kv.KVStoreBase.kv_registry
    names = []
    for kind in STORE_TYPES:
        name = PREFIX + kind
        if not getattr(registry.get(name), "_mpikv_store", False):
            cls = type(name, (KVStore,), {
                "default_type": kind, "_mpikv_store": True, "__module__": __name__,
                "__doc__": f"mpikv's {kind!r} store, created by name ({name!r})."})
            mx.kv.KVStoreBase.register(cls)
        names.append(name)
    return names
