"""The store MXNet's own clients drive: an ``mx.kv.KVStoreBase`` over an mpikv store.

Gluon's ``Trainer`` and ``mx.mod.Module`` call ``init``, ``broadcast``,
``push``, ``pull``, ``pushpull``, ``row_sparse_pull``, ``set_optimizer``,
``save_optimizer_states`` and ``load_optimizer_states`` with NDArrays; each
call becomes the mpikv store's call on numpy views of the same memory
(:mod:`mpikv.mxnet.ndarrays`), and the MXNet optimizer becomes mpikv's on the
owners (:mod:`mpikv.mxnet.optimizers`). Every check that fails on one rank
is raised on every rank, through the mpikv call's agreement.

Row-sparse keys: a key whose initial value is a ``RowSparseNDArray`` (a Gluon
``Parameter(stype="row_sparse")``), or a dense value whose attached gradient
is row_sparse (``gluon.nn.Embedding(..., sparse_grad=True)``), becomes an
mpikv row table (:meth:`mpikv.store.kvstore.KVStore.init_rows`): its rows live on
their owners only, pushes carry rows (:class:`mpikv.RowSparse`) and
``row_sparse_pull`` fetches only the rows asked for.
"""

import functools

import mxnet as mx
import numpy as np

import mpikv

from ..closing import ClosesAfterWith
from .. import errors
from .. import optimizer as mpikv_optimizer
from ..store.factory import STORE_TYPES
from ..rows.rowsparse import RowSparse
from ..state.checkpoint import saved_optimizer
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


_MX_ERRORS = {}


def mxnet_error(cls):
    """``cls`` (an mpikv InputError class) that is also MXNet's ``MXNetError``, with the
    same name: what MXNet's own store raises for a bad key, shape or value, and what
    its clients catch."""
    if not issubclass(cls, errors.InputError) or issubclass(cls, mx.base.MXNetError):
        return cls
    if cls not in _MX_ERRORS:
        _MX_ERRORS[cls] = type(cls.__name__, (cls, mx.base.MXNetError), {
            "__module__": __name__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__doc__} (also MXNet's MXNetError)"})
    return _MX_ERRORS[cls]


_NO_ROW_IDS = "row_sparse_pull needs row_ids (the rows to pull) and out"


class RowIdsError(errors.InputError, AssertionError):
    """``row_sparse_pull`` without ``row_ids`` or ``out`` (MXNet's store asserts both)."""


def _as_mxnet_errors(fn):
    """Raises the store's input errors as :func:`mxnet_error` classes."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except errors.InputError as exc:
            cls = mxnet_error(type(exc))
            if cls is type(exc):
                raise
            new = cls(*exc.args)
            new.first_rank = exc.first_rank
            raise new.with_traceback(exc.__traceback__) from None
    return call


class KVStore(ClosesAfterWith, mx.kv.KVStore):
    """An MXNet KVStore whose every rank is a worker and an owner (MPI, no servers).

    It is an ``mx.kv.KVStore`` (MXNet's own store class, whose C handle it does
    not use), because Gluon's ``Trainer`` takes only those for sparse
    parameters and gradients; every method is mpikv's.

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
        self.handle = None       # (MXNet's C store: none)
        self._is_p3 = False
        self._kv = mpikv.create(kind, comm=comm, **options)
        self._type = PREFIX + kind
        self._updater = None     # _Updater of the MXNet optimizer, once one is set
        self._follower = None    # keeps the mpikv optimizer in step with it
        self._row_keys = {}      # key -> (shape, dtype) of the row tables made here
        self._refused = {}       # dtype -> why the MXNet optimizer set cannot update it

    def __del__(self):
        pass    # MXNet's KVStore.__del__ frees a C handle; there is none

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
        """The mpikv store underneath (:class:`mpikv.store.kvstore.KVStore`)."""
        return self._kv

    @property
    def optimizer(self):
        """The MXNet optimizer the owners run (the Trainer's object, or after
        :meth:`load_optimizer_states` the file's), or None. The mpikv optimizer
        it became is ``self.kvstore.optimizer``."""
        return None if self._updater is None else self._updater.optimizer

    def is_capable(self, capability):
        """As MXNet's ``dist_sync``: True for ``KVStoreBase.OPTIMIZER`` (optimizers run
        on the owners; the only capability MXNet 1.9 asks, case-insensitive), else
        ``ValueError("Unknown capability: ...")``."""
        if capability.lower() == mx.kv.KVStoreBase.OPTIMIZER:
            return True
        raise ValueError(f"Unknown capability: {capability}")

    # -- data ------------------------------------------------------------
    @_as_mxnet_errors
    def init(self, key, value):
        """Creates keys with rank 0's values (NDArrays, or lists of them per device).

        A row_sparse value, or a dense one whose gradient is row_sparse, makes a row
        table (see the module's doc)."""
        groups = self._groups(key, value, new=True)
        if groups is None:
            conv = ndarrays.convert(key, values=value)
            self._run(conv, self._kv.init, key, conv.values)
            return
        for rows, keys, entries in groups:
            if rows:
                self._init_rows(keys[0], entries[0])
            else:
                self.init(_one(key, keys), _one(key, entries))

    @_as_mxnet_errors
    def push(self, key, value, priority=0):
        """Sums the values over devices and ranks; the owners run the optimizer.
        A row table's values go as rows (row_sparse ones carry only theirs)."""
        groups = self._groups(key, value)
        if groups is None:
            failure = self._follow(key, value)
            conv = ndarrays.convert(key, values=value)
            self._run(conv, self._kv.push, key, conv.values, priority, failure=failure)
            return
        for rows, keys, entries in groups:
            if rows:
                self._push_rows(keys[0], entries[0])
            else:
                self.push(_one(key, keys), _one(key, entries), priority)

    @_as_mxnet_errors
    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copies the stored values into ``out``; sparse outputs are skipped unless
        ``ignore_sparse`` is False (then they get every row). A row table's whole
        value is fetched only for the outputs that take it."""
        groups = self._groups(key, out)
        if groups is None:
            conv = ndarrays.convert(key, outs=out, ignore_sparse=ignore_sparse)
            self._run(conv, self._kv.pull, key, conv.outs, priority)
            return
        for rows, keys, entries in groups:
            if rows:
                self._pull_all_rows(keys[0], entries[0], ignore_sparse)
            else:
                self.pull(_one(key, keys), _one(key, entries), priority, ignore_sparse)

    @_as_mxnet_errors
    def pushpull(self, key, value, out=None, priority=0):
        """:meth:`push` then :meth:`pull` in one call; ``out=None`` writes into ``value``."""
        if self._groups(key, value) is not None:
            self.push(key, value, priority)
            self.pull(key, value if out is None else out, priority, ignore_sparse=False)
            return
        failure = self._follow(key, value)
        conv = ndarrays.convert(key, values=value, outs=out, write_values=out is None)
        self._run(conv, self._kv.pushpull, key, conv.values, conv.outs, priority,
                  failure=failure)

    @_as_mxnet_errors
    def broadcast(self, key, value, out, priority=0):
        """Creates keys with rank 0's ``value``, then pulls them into ``out``."""
        groups = self._groups(key, value, new=True)
        if groups is None:
            conv = ndarrays.convert(key, values=value, outs=out)
            self._run(conv, self._kv.broadcast, key, conv.values, conv.outs, priority)
            return
        self.init(key, value)
        self.pull(key, out, priority, ignore_sparse=False)

    @_as_mxnet_errors
    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        try:
            self._row_sparse_pull(key, out, priority, row_ids)
        except errors.InputError as exc:
            if _NO_ROW_IDS not in str(exc) or isinstance(exc, RowIdsError):
                raise
            # (the store's agreement carries mpikv's own classes)
            new = RowIdsError(*exc.args)
            new.first_rank = exc.first_rank
            raise new.with_traceback(exc.__traceback__) from None

    def _row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Pulls the rows ``row_ids`` into ``out`` (row_sparse, or dense: the other rows
        zero).

        As MXNet's: ``row_ids`` is an NDArray (any integer-valued dtype and shape,
        repeats and any order) or a list of them, one per output; one NDArray serves
        every output. For a row table only the rows asked for (the union over this
        rank's outputs) are fetched from their owners. A dense key's whole value is
        pulled and the rows are kept.
        """
        failure = None
        if row_ids is None or out is None:
            failure = (errors.InputError, _NO_ROW_IDS)
        groups = self._groups(key, out if out is not None else key)
        if groups is not None and failure is not None:
            # the call other ranks make for a row table, failing on every rank
            first = next(keys[0] for rows, keys, _ in groups if rows)
            self._kv.fail_next_call(*failure)
            self._kv.row_sparse_pull(first, row_ids=np.zeros(0, np.int64))
            return
        if groups is None:
            conv = ndarrays.convert(key, outs=out, ignore_sparse=False, row_ids=row_ids)
            self._run(conv, self._kv.pull, key, conv.outs, priority, failure=failure)
            return
        per_key = (list(row_ids) if isinstance(key, (list, tuple)) and
                   isinstance(row_ids, (list, tuple)) and len(row_ids) == len(key)
                   else [row_ids] * (len(key) if isinstance(key, (list, tuple)) else 1))
        ids_of = dict(zip(key if isinstance(key, (list, tuple)) else [key], per_key))
        for rows, keys, entries in groups:
            if rows:
                self._pull_rows(keys[0], entries[0], ids_of[keys[0]])
            else:
                self.row_sparse_pull(_one(key, keys), _one(key, entries), priority,
                                     _one(key, [ids_of[k] for k in keys]))

    # -- row tables ------------------------------------------------------
    def _groups(self, key, entries, new=False):
        """None when no row table is involved, else ``[(is_rows, keys, entries)]``:
        runs of dense keys, and each row table's key alone, in the call's order.
        ``new``: the keys are being created (row values make row tables)."""
        if entries is None:
            return None
        pairs, _ = ndarrays.keys_and_entries(key, entries)
        if pairs is None:
            return None
        flags = []
        for k, entry in pairs:
            try:
                known = k in self._row_keys
            except TypeError:   # an unhashable key: the store names it
                return None
            flags.append(_row_value(entry) if new else known)
        if not any(flags):
            return None
        groups = []
        for (k, entry), rows in zip(pairs, flags):
            if rows or not groups or groups[-1][0]:
                groups.append((rows, [k], [entry]))
            else:
                groups[-1][1].append(k)
                groups[-1][2].append(entry)
        return groups

    def _init_rows(self, key, entry):
        """A row table with rank 0's value (every rank holds it whole, as Gluon does):
        each owner keeps its block."""
        nd = entry[0] if isinstance(entry, (list, tuple)) else entry
        shape, dtype = tuple(nd.shape), np.dtype(nd.dtype)
        reason = ndarrays.problem(nd)
        if reason is not None:
            self._kv.fail_next_call(errors.ValueTypeError, f"value for key {key!r} is {reason}")
            self._kv.init_rows(key, shape, dtype)
            return
        dense = nd.tostype("default") if ndarrays.is_sparse(nd) else nd
        value = np.array(ndarrays.view(dense, False))
        if self._kv.num_workers > 1 and value.size and len(shape):
            # Rank 0's bits: an integer sum of its bits and the others' zeros is exact.
            bits = value.reshape(-1).view(_bits_dtype(dtype))
            if self._kv.rank != 0:
                bits[...] = 0
            self._kv.allreduce_(bits, tag=f"mpikv.mxnet: the value of row table {key!r}")
        self._kv.init_rows(key, shape, dtype,
                           init=None if value.ndim == 0 else (lambda lo, hi: value[lo:hi]),
                           row_sparse_weight=nd.stype == "row_sparse")
        self._row_keys[key] = (shape, dtype)

    def _push_rows(self, key, entry):
        """A push to a row table: each device's rows (a dense value: all its rows),
        summed over the devices and ranks by the store."""
        shape, dtype = self._row_keys[key]
        nds = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        failure = self._follow(key, entry)
        indices, data = [], []
        value_shape = shape
        for nd in nds:
            if not isinstance(nd, mx.nd.NDArray):
                failure = failure or (errors.ValueTypeError, f"row table {key!r} takes "
                                      f"NDArrays, not {type(nd).__name__}")
                continue
            reason = ndarrays.problem(nd)
            if reason is not None:
                failure = failure or (errors.ValueTypeError, f"value for key {key!r} is {reason}")
                continue
            if tuple(nd.shape) != shape:
                value_shape = tuple(nd.shape)
                continue
            if nd.stype == "row_sparse":
                indices.append(nd.indices.asnumpy().astype(np.int64, copy=False))
                data.append(nd.data.asnumpy())
            else:
                dense = nd.tostype("default") if ndarrays.is_sparse(nd) else nd
                indices.append(np.arange(shape[0], dtype=np.int64))
                data.append(np.array(ndarrays.view(dense, False)))
        if indices:
            rows = RowSparse(np.concatenate(indices),
                             np.concatenate([d.astype(dtype, copy=False) for d in data]), shape)
        else:
            rows = RowSparse(np.zeros(0, np.int64), np.zeros((0, *shape[1:]), dtype), shape)
        if value_shape != shape:
            rows = RowSparse(np.zeros(0, np.int64), np.zeros((0, *value_shape[1:]), dtype),
                             value_shape)
        if failure is not None:
            self._kv.fail_next_call(*failure)
        self._kv.push(key, rows)
        if self._follower is not None:
            self._follower.written_back()

    def _pull_all_rows(self, key, entry, ignore_sparse):
        """A row table's every row into ``entry``'s dense outputs (and its row_sparse
        ones unless ``ignore_sparse``)."""
        shape, _ = self._row_keys[key]
        outs = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        takers = [o for o in outs if not (isinstance(o, mx.nd.NDArray) and
                                          ndarrays.is_sparse(o) and ignore_sparse)]
        if not takers:
            return
        self._fetch_rows(key, [(o, None) for o in takers], np.arange(shape[0], dtype=np.int64))

    def _pull_rows(self, key, entry, row_ids):
        """``row_sparse_pull`` of a row table: the union of the outputs' ids, fetched once."""
        outs = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        if isinstance(row_ids, (list, tuple)) and len(row_ids) == len(outs):
            per_out = list(row_ids)
        elif isinstance(row_ids, (list, tuple)) and len(row_ids) == 1:
            per_out = [row_ids[0]] * len(outs)
        else:
            per_out = [row_ids] * len(outs)
        failure, wanted = None, []
        for i, ids in enumerate(per_out):
            try:
                per_out[i] = _row_ids(ids)
            except (TypeError, ValueError) as exc:
                failure = failure or (errors.ValueTypeError, f"row_ids for key {key!r}: {exc}")
                per_out[i] = np.zeros(0, np.int64)
            wanted.append(per_out[i])
        self._fetch_rows(key, list(zip(outs, per_out)), np.concatenate(wanted), failure)

    def _fetch_rows(self, key, targets, ids, failure=None):
        """Fetches rows ``ids`` of row table ``key`` and fills each ``(out, its ids or
        None for all)`` of ``targets``."""
        shape, dtype = self._row_keys[key]
        for out, _ in targets:
            if failure is not None:
                break
            if not isinstance(out, mx.nd.NDArray):
                failure = (errors.ValueTypeError, f"out for key {key!r} is not an NDArray "
                                                  f"but {type(out).__name__}")
            elif ndarrays.problem(out) is not None:
                failure = (errors.ValueTypeError,
                           f"out for key {key!r} is {ndarrays.problem(out)}")
            elif tuple(out.shape) != shape:
                failure = (errors.ShapeError, f"out for key {key!r} has shape "
                                              f"{tuple(out.shape)}; row table {key!r} has {shape}")
            elif out.stype not in ("default", "row_sparse"):
                failure = (errors.ValueTypeError, f"out for key {key!r} is {out.stype}; a row "
                                                  f"table fills dense or row_sparse outputs")
        if failure is not None:
            self._kv.fail_next_call(*failure)
        got = self._kv.row_sparse_pull(key, row_ids=ids)
        for out, mine in targets:
            if mine is None:
                indices, data = got.indices, got.data
            else:
                keep = np.unique(mine)
                at = np.searchsorted(got.indices, keep)
                indices, data = keep, got.data[at]
            _fill(out, indices, data, shape, dtype)

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

    def _follow(self, key, value=None):
        """Before a push: the MXNet optimizer's current hyperparameters (and the
        keys' multipliers) into mpikv's; a value mpikv refuses, or a dtype the MXNet
        optimizer cannot update (``value``'s), fails the push on every rank."""
        follower = self._follower
        if follower is None or self._kv.optimizer is not follower.mp:
            return None
        if self._refused and value is not None:
            for nd in _ndarrays(value):
                why = self._refused.get(np.dtype(nd.dtype))
                if why is not None:
                    return errors.OptimizerError, why
        if isinstance(follower.mp, optimizers.MXNetRule) and follower.mp.whole_weight:
            plan = self._kv.plan
            for k in (key if isinstance(key, (list, tuple)) else [key]):
                if type(k) in (int, str) and k in plan and plan[k].split:
                    return errors.OptimizerError, (
                        f"MXNet's {follower.mp.kind.rpartition(':')[2]} reads the whole "
                        f"weight, but key {k!r} is split over {len(plan[k].shards)} owners "
                        f"(it has bigarray_bound elements or more: create the store with a "
                        f"larger bigarray_bound)")
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
        refused = {}
        try:
            mp = optimizers.to_mpikv(optimizer)
            if isinstance(mp, optimizers.MXNetRule):
                refused = optimizers.trial_updates(optimizer)
        except errors.MPIKVError as exc:
            self._kv.fail_next_call(errors.OptimizerError, str(exc))
            mp = mpikv_optimizer.SGD()  # never installed: the call fails on every rank
        self._kv.set_optimizer(mp)
        self._follower = optimizers.Follower(optimizer, mp)
        self._updater = _Updater(optimizer)
        self._refused = refused

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
            config = saved_optimizer(fname)
        except Exception:  # noqa: BLE001 - the load itself names the problem, on every rank
            return None, None, None, None
        if config is None:
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
        self._refused = (optimizers.trial_updates(mx_new)
                         if isinstance(mp, optimizers.MXNetRule) else {})

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
        """mpikv's checkpoint: values, optimizer and states (see :class:`mpikv.store.kvstore.KVStore`)."""
        failure = self._follow([])
        if failure is not None:
            self._kv.fail_next_call(*failure)
        self._kv.save_checkpoint(fname)

    def load_checkpoint(self, fname):
        """Loads :meth:`save_checkpoint` files on any number of ranks."""
        self._kv.load_checkpoint(fname)

    def close(self):
        """Ends the store on every rank (collective; see :meth:`mpikv.store.kvstore.KVStore.close`):
        its threads and communicators are freed; later calls raise on every rank."""
        self._kv.close()
        self._updater = self._follower = None

    def __repr__(self):
        return (f"<mpikv.mxnet.KVStore type={self._type!r} rank={self.rank} "
                f"num_workers={self.num_workers}>")


def _ndarrays(value):
    """The NDArrays in a call's values (nested lists)."""
    if isinstance(value, mx.nd.NDArray):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _ndarrays(v)


def _one(key, items):
    """``items`` as the call had its entries: a list for a key list, else the one item."""
    return items if isinstance(key, (list, tuple)) else items[0]


def _row_value(entry):
    """Whether a new key's value makes a row table: a row_sparse NDArray, or a dense one
    whose attached gradient is row_sparse (a Gluon Parameter with
    ``grad_stype="row_sparse"``)."""
    nd = entry[0] if isinstance(entry, (list, tuple)) and entry else entry
    if not isinstance(nd, mx.nd.NDArray):
        return False
    if nd.stype == "row_sparse":
        return True
    if nd.stype != "default":
        return False
    try:
        grad = nd.grad
    except Exception:  # noqa: BLE001 - no gradient attached
        return False
    return grad is not None and grad.stype == "row_sparse"


def _bits_dtype(dtype):
    """The unsigned integer dtype of ``dtype``'s size (its bits, summed exactly)."""
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def _row_ids(ids):
    """MXNet's row_ids (an NDArray of any dtype and shape, or array-like) as int64."""
    if isinstance(ids, mx.nd.NDArray):
        ids = ids.asnumpy()
    ids = np.asarray(ids).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        if not np.issubdtype(ids.dtype, np.floating) or not np.all(ids == np.round(ids)):
            raise ValueError("row ids must be whole numbers")
    return ids.astype(np.int64)


def _fill(out, indices, data, shape, dtype):
    """Writes rows into an output NDArray: row_sparse (only these rows) or dense (the
    other rows zero)."""
    if out.stype == "row_sparse":
        with mx.autograd.pause():   # (Gluon pulls rows inside its record scope)
            _fill_row_sparse(out, indices, data, shape, dtype)
        return
    dense = ndarrays.view(out, True)
    dense[...] = 0
    if len(indices):
        dense[indices] = data


def _fill_row_sparse(out, indices, data, shape, dtype):
    rows = mx.nd.sparse.row_sparse_array(
        (mx.nd.array(data.reshape(len(indices), *shape[1:]), ctx=out.context, dtype=dtype),
         mx.nd.array(indices, ctx=out.context, dtype="int64")),
        shape=shape, ctx=out.context, dtype=dtype)
    rows.copyto(out)


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
