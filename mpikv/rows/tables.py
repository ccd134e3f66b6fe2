"""Row tables: keys whose rows live on their owners only, pushed and pulled by rows.

An embedding table too large for one rank is cut into blocks of rows, one per
rank (rank ``r`` owns rows ``[bounds[r], bounds[r+1])``); each rank allocates
and fills only its block. A push of :class:`~mpikv.rows.rowsparse.RowSparse`
gradients adds up each rank's repeats, then sends each row to its owner (the
counts, then ``Alltoallv`` of the indices and of the rows), where the rows from
every rank add up and the updater or optimizer runs on the touched rows
(``lazy_update``, MXNet's default for sparse gradients) or on the whole block
(``lazy_update=False``). A ``row_sparse_pull`` asks each owner for the rows it
holds and gets them back the same way. No rank ever holds the whole table.
"""

import numpy as np

from .. import errors
from ..arrays.values import check_dtype
from ..calls.reader import Call, Item, check_priority, expect, read_keys
from ..dtypes import is_floating
from ..keys import is_key, normalize_key
from ..optimizer.base import COUNT
from ..core.plan import sort_key, split_bounds
from .rowsparse import RowSparse, read_parts, read_shape, sum_rows, unique_ids


class RowTable:
    """One key's block of rows on this rank.

    Attributes:
        shape, dtype: the whole table's.
        bounds: ``bounds[r]`` is rank ``r``'s first row (``bounds[-1]`` the row count).
        block: this rank's rows.
        state: the optimizer state of the block, or None.
        row_sparse_weight: the value is row-sparse (MXNet's row_sparse weights):
            a rule with a kernel of its own for such weights steps only the rows
            pushed (see :func:`_lazy`). Set at creation, not saved.
    """

    def __init__(self, shape, dtype, rank, size, row_sparse_weight=False):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.bounds = [a for a, _ in split_bounds(self.shape[0], size)] + [self.shape[0]]
        self.cuts = np.asarray(self.bounds, np.int64)
        self.ones, self.steps = [1] * size, list(range(size))   # counts' exchange
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.block = np.zeros((self.hi - self.lo, *self.shape[1:]), self.dtype)
        self.state = None
        self.row_sparse_weight = bool(row_sparse_weight)

    @property
    def row_size(self):
        """Elements in one row."""
        return int(np.prod(self.shape[1:], dtype=np.int64))

    def owners(self, rows):
        """The owner of each row index."""
        return np.searchsorted(self.bounds, rows, side="right") - 1


class RowTables:
    """This rank's row tables and their collective traffic.

    Args:
        transport: the store's transport (rank, size, ``alltoallv``).
    """

    def __init__(self, transport):
        self.transport = transport
        self.tables = {}

    def __contains__(self, key):
        return key in self.tables

    def make(self, shape, dtype, init, row_sparse_weight=False):
        """This rank's block of a new table, filled with ``init(first_row, stop_row)``
        (this rank's rows), a number, or zeros (None); not installed yet.

        Raises:
            ShapeError: ``init`` gave another shape than the block's.
            DTypeError: ``init`` gave values the table does not take (see :func:`takes`).
        """
        t = self.transport
        table = RowTable(shape, dtype, t.rank, t.size, row_sparse_weight)
        if init is None:
            return table
        rows = np.asarray(init(table.lo, table.hi) if callable(init) else init)
        if not takes(table.dtype, rows.dtype):
            raise errors.DTypeError(f"the initializer gave {rows.dtype} values; the table "
                                    f"is {table.dtype} and takes "
                                    f"{_KINDS[is_floating(table.dtype)]}")
        if callable(init) and rows.shape != table.block.shape:
            raise errors.ShapeError(f"the row table's initializer gave shape {rows.shape} "
                                    f"for rows {table.lo}..{table.hi}, not "
                                    f"{table.block.shape}")
        table.block[...] = rows
        return table

    def install(self, key, table):
        """Makes ``table`` (from :meth:`make`) the table of ``key``."""
        self.tables[key] = table

    # -- the store's calls: checked here, run by the protocol -----------------------------
    # Each call reads its arguments as the general reader does (mpikv.calls.reader): a bad
    # one fails the Call, never raises, so every rank learns of it at the agreement and
    # raises the same error, with nothing applied.
    def key_type(self):
        """The type of the row tables' keys (int or str), None while there are none."""
        return type(next(iter(self.tables))) if self.tables else None

    def _store_key_type(self, engine):
        return engine.key_type or self.key_type()

    def is_rows_call(self, key, value):
        """Whether a push goes to row tables: a RowSparse value, or a row table's key."""
        keys = key if isinstance(key, (list, tuple)) else [key]
        values = value if isinstance(value, (list, tuple)) else [value]
        return any(isinstance(v, RowSparse) for v in values) or any(
            is_key(k) and k in self for k in keys)

    def init_call(self, key, shape, dtype, init, row_sparse_weight, engine):
        """Creates a row table: ``key``'s rows live on their owners only.

        Rank ``r`` owns the ``r``-th of ``num_workers`` near-equal blocks of rows
        and allocates only those; no rank ever holds the whole table. Push
        :class:`~mpikv.RowSparse` rows to it (:meth:`~mpikv.KVStore.push`) and read rows with
        :meth:`~mpikv.KVStore.row_sparse_pull`. Collective.

        Args:
            key: a new key (int or str, of the type of the store's other keys).
            shape: the whole table's shape (rows first): a tuple of ints.
            dtype: its dtype, one the store holds (float16, float32, float64,
                int32, int64, bfloat16).
            init: ``init(first_row, stop_row)`` returning this rank's rows, a
                number for every element, or None (zeros). Its values must be of a
                kind the table takes (no complex numbers for a float table, no
                floats for an integer one): nothing is cast with a loss unseen.
            row_sparse_weight: the value is row-sparse, as an MXNet
                ``row_sparse`` weight: an optimizer whose MXNet kernel for such
                weights steps only the rows present (Ftrl) does so here too.

        Returns ``(call, action)`` for :meth:`mpikv.store.protocol.Protocol.collective`;
        ``engine`` is the store's :class:`mpikv.core.engine.Engine` (its dense keys).
        """
        call = Call("init_rows")
        made = []
        try:
            self._read_init(call, key, shape, dtype, init, row_sparse_weight, engine, made)
        except Exception as exc:  # noqa: BLE001 - nothing may escape before the ranks agree
            call.fail(errors.InputError, None, f"its arguments cannot be read "
                      f"({type(exc).__name__}: {exc})")
        return call, lambda: self.install(*made)

    def _read_init(self, call, key, shape, dtype, init, row_sparse_weight, engine, made):
        keys = read_keys(call, [key], self._store_key_type(engine))
        call.settings["row_sparse_weight"] = bool(row_sparse_weight)
        key = keys[0] if keys else None
        if key is not None and (key in self or engine.lookup(key) is not None):
            # (first, as the general reader's init: whatever else is wrong)
            call.fail(errors.DuplicateInitError, key, f"key {key!r} is already initialised")
            return
        try:
            shape = read_shape(shape, "shape")
            if not shape:
                raise errors.ShapeError("a row table has rows: its shape has at least one axis")
            dtype = _read_dtype(dtype)
        except errors.MPIKVError as exc:
            call.fail(type(exc), key, f"row table {key!r}: {exc}")
            return
        if key is None:
            return
        call.items = [Item(key, shape=shape, dtype=dtype)]
        try:   # this rank's rows first: an initializer that fails fails every rank
            made.extend([key, self.make(shape, dtype, init, row_sparse_weight)])
        except errors.MPIKVError as exc:
            call.fail(type(exc), key, f"row table {key!r}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the user's initializer
            call.fail(errors.InputError, key, f"the initializer of row table {key!r} "
                      f"raised {type(exc).__name__}: {exc}")

    def pull_call(self, key, out, row_ids, priority, engine):
        """Copies rows ``row_ids`` of ``key`` into ``out``; only they are fetched.

        As MXNet's: ids may repeat and come in any order. Collective (every rank
        calls it, each with its own ids).

        Args:
            key: a row table's key.
            out: None, a :class:`~mpikv.RowSparse` of the table's shape and dtype (it
                gets the rows, each id once, in increasing order) or a writable numpy
                array of the table's shape and dtype (those rows filled, the others
                zeroed): as for ``pull``, nothing is cast.
            row_ids: 1-D integers in ``[0, rows)``.
            priority: an int, the same on every rank (accepted for MXNet compatibility).
            engine: the store's :class:`mpikv.core.engine.Engine`.

        Returns:
            the rows as a :class:`~mpikv.RowSparse` (``out`` itself if given one).

        Returns ``(call, action)`` for :meth:`mpikv.store.protocol.Protocol.collective`.
        """
        call = Call("row_sparse_pull", settings={"priority": priority})
        read = []
        try:
            self._read_pull(call, key, out, row_ids, engine, read)
        except Exception as exc:  # noqa: BLE001 - nothing may escape before the ranks agree
            call.fail(errors.InputError, None, f"its arguments cannot be read "
                      f"({type(exc).__name__}: {exc})")
        return call, lambda: _fill(out, self.pull((call.op, call.keys), *read))

    def _read_pull(self, call, key, out, row_ids, engine, read):
        check_priority(call, 1)
        keys = read_keys(call, [key], self._store_key_type(engine))
        if not keys:
            return
        key = keys[0]
        table = self.tables.get(key)
        if table is None:
            call.fail(errors.UnknownKeyError, key, f"{key!r} is not a row table "
                      f"(make it with init_rows)")
            return
        call.items = [Item(key, shape=table.shape, dtype=table.dtype)]
        try:
            ids = _read_ids(key, row_ids, table)
            _check_out(key, out, table)
        except errors.MPIKVError as exc:
            call.fail(type(exc), key, str(exc))
            return
        read.extend([key, ids])

    def push_call(self, key, value, engine, priority=0):
        """A push to row tables, checked, and its action: each row to its owner.

        Every rule of a dense push holds (keys, one value per key, the priority, the
        updater and optimizer agreed), and each value is read again here, however it
        was changed since it was made: a :class:`~mpikv.RowSparse` of the table's
        shape, its indices in range, its rows of a dtype the store holds and of a
        kind the table takes (no complex rows into a float table: as ``push``, they
        are refused, not cast).

        Args:
            engine: the store's :class:`mpikv.core.engine.Engine` (updater, optimizer, owners).
        """
        call = Call("push_rows", settings={"priority": priority,
                                           "updater": engine.updater_kind})
        if engine.optimizer is not None:
            call.settings["optimizer"] = engine.optimizer.get_config()
        read = {}   # key -> its checked (indices, data)
        try:
            self._read_push(call, key, value, engine, read)
        except Exception as exc:  # noqa: BLE001 - nothing may escape before the ranks agree
            call.fail(errors.InputError, None, f"its arguments cannot be read "
                      f"({type(exc).__name__}: {exc})")
        owners = engine.owners
        # In the canonical key order: the same exchanges, in the same order, on every rank.
        return call, lambda: [self.push((call.op, [k]), k, *read[k], owners)
                              for k in call.keys]

    def _read_push(self, call, key, value, engine, read):
        keys = list(key) if isinstance(key, (list, tuple)) else [key]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        check_priority(call, len(keys))
        if len(keys) != len(values):
            call.fail(errors.InputError, None, f"{len(keys)} keys but {len(values)} value "
                      f"entries; give one entry per key")
            return
        known = read_keys(call, keys, self._store_key_type(engine))
        by_key = {}
        for raw, v in zip(keys, values):
            try:
                by_key.setdefault(normalize_key(raw), v)
            except errors.KeyTypeError:
                pass   # (failed by read_keys)
        items = []
        for k in known:
            v = by_key[k]
            table = self.tables.get(k)
            try:
                if table is None:
                    raise errors.UnknownKeyError(f"{k!r} is not a row table (make it with "
                                                 f"init_rows; dense keys take dense pushes)")
                items.append(Item(k, shape=table.shape, dtype=table.dtype))
                read[k] = _read_rows(k, v, table)
                if engine.optimizer is not None and not is_floating(table.dtype):
                    raise errors.OptimizerError(f"row table {k!r} holds integers; optimizers "
                                                f"update floating-point values only")
            except errors.MPIKVError as exc:
                call.fail(type(exc), k, str(exc))
        call.items = sorted(items, key=lambda item: sort_key(item.key))
        priority = call.settings.get("priority")
        if isinstance(priority, list) and not call.errors:
            of = dict(zip(call.user_keys, priority))
            call.settings["priority"] = [of[item.key] for item in call.items]

    def refuse_tables(self, call):
        """Fails a dense ``init`` or ``broadcast`` of keys that are row tables, or of
        keys of another type than the row tables' (the general reader knows only the
        dense keys' type)."""
        for k in call.keys:
            if k in self:
                call.fail(errors.DuplicateInitError, k, f"key {k!r} is a row table already")
        mine = self.key_type()
        if mine is not None and any(type(k) is not mine for k in call.keys) and not any(
                e[2].startswith("mixed") for e in call.errors):
            call.errors.insert(0, (errors.KeyTypeError.__name__, None,
                                   f"mixed key types are not allowed: this store has "
                                   f"{mine.__name__} keys"))

    # -- the exchange --------------------------------------------------------------------
    def _counts(self, what, table, sorted_ids):
        """``(counts to each rank, counts from each rank)`` of ``sorted_ids`` (increasing,
        so grouped by owner already): an ``Alltoallv`` of one number per rank pair (the
        transport has no ``Alltoall``; it measured 6-23 us slower here, of 10+ ms)."""
        t = self.transport
        counts = np.diff(np.searchsorted(sorted_ids, table.cuts)).astype(np.int64, copy=False)
        got = np.empty(t.size, np.int64)
        t.alltoallv(counts, table.ones, table.steps, got, table.ones, table.steps, what)
        return counts, got

    def _exchange(self, what, send, counts, got, row_size=1):
        """``Alltoallv`` of ``send`` (grouped by destination rank, ``counts[r]`` rows to
        rank r; ``got[r]`` rows from rank r): returns what came, grouped by source."""
        recv = np.empty((int(got.sum()), *send.shape[1:]), send.dtype)
        scounts, rcounts = counts * row_size, got * row_size
        sdispls = np.cumsum(scounts) - scounts
        rdispls = np.cumsum(rcounts) - rcounts
        self.transport.alltoallv(np.ascontiguousarray(send).reshape(-1), scounts, sdispls,
                                 recv.reshape(-1), rcounts, rdispls, what)
        return recv

    def push(self, what, key, indices, data, owners):
        """Sends rows ``indices`` (checked: 1-D int64 in range), ``data[i]`` row
        ``indices[i]``, to their owners and applies them there.

        Args:
            owners: the store's :class:`~mpikv.core.owners.Owners` (its updater or optimizer).
        """
        table = self.tables[key]
        # In the table's dtype (every rank sends the same), each rank's repeats added
        # before sending (fewer bytes); the summed ids increase: grouped by owner.
        ids, data = sum_rows(indices, data.astype(table.dtype, copy=False), table.shape[0])
        counts, got = self._counts(what, table, ids)
        came = self._exchange(what, ids, counts, got)
        if table.lo:
            came -= table.lo
        data = self._exchange(what, data, counts, got, table.row_size)
        # Each rank's ids came once each and increasing: the owner adds up the ranks'.
        mine, data = sum_rows(came, data, max(table.hi - table.lo, 1))
        _apply(key, table, RowSparse(mine, data, table.block.shape), owners)

    def pull(self, what, key, row_ids):
        """The rows ``row_ids`` of ``key`` from their owners: a RowSparse with each id
        once, in increasing order."""
        table = self.tables[key]
        wanted = unique_ids(np.asarray(row_ids, np.int64).reshape(-1))
        counts, got = self._counts(what, table, wanted)
        asked = self._exchange(what, wanted, counts, got)
        if table.lo:
            asked -= table.lo
        rows = self._exchange(what, table.block[asked], got, counts, table.row_size)
        return RowSparse(wanted, rows, table.shape)


def _read_dtype(dtype):
    """``dtype`` as a numpy dtype the store holds; DTypeError otherwise."""
    try:
        dtype = np.dtype(dtype)
    except Exception as exc:  # noqa: BLE001 - np.dtype('nope'): numpy's TypeError
        raise errors.DTypeError(f"dtype {dtype!r} is not a dtype ({exc})") from None
    check_dtype(dtype, "the table")
    return dtype


def takes(table_dtype, dtype):
    """Whether a table of ``table_dtype`` takes values of ``dtype`` (cast to its own):
    real numbers into a floating-point table, integers (or bools) into an integer one.
    Complex values (their imaginary parts), strings and objects are refused."""
    dtype = np.dtype(dtype)
    if is_floating(table_dtype):
        return dtype.kind in "biuf" or is_floating(dtype)
    return dtype.kind in "biu"


def _read_rows(key, rows, table):
    """The checked ``(indices, data)`` of a push of ``rows`` to ``table`` (read again
    here: the caller may have changed the RowSparse since it was made)."""
    if not isinstance(rows, RowSparse):
        raise errors.ValueTypeError(f"row table {key!r} takes a RowSparse push, "
                                    f"not {type(rows).__name__}")
    try:
        indices, data, shape = read_parts(rows.indices, rows.data, rows.shape)
    except errors.MPIKVError as exc:
        raise type(exc)(f"the rows pushed to row table {key!r}: {exc}") from None
    if shape != table.shape:
        raise errors.ShapeError(f"the push has shape {shape}; row table {key!r} "
                                f"has {table.shape}")
    check_dtype(data.dtype, f"the data of the RowSparse pushed to row table {key!r}")
    if not takes(table.dtype, data.dtype):
        raise errors.DTypeError(f"the data of the RowSparse pushed to row table {key!r} has "
                                f"dtype {data.dtype}; the table is {table.dtype} and takes "
                                f"{_KINDS[is_floating(table.dtype)]} (nothing is cast with "
                                f"a loss unseen)")
    return indices, data


def _read_ids(key, row_ids, table):
    """``row_ids`` of a ``row_sparse_pull``, checked: a flat int64 copy (the caller's
    ids cannot change under the call)."""
    try:
        ids = np.array([] if row_ids is None else row_ids, copy=True).reshape(-1)
    except Exception as exc:  # noqa: BLE001 - a ragged list: numpy's ValueError
        raise errors.ValueTypeError(f"row_ids for row table {key!r} are not an array of "
                                    f"integers ({type(exc).__name__}: {exc})") from None
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise errors.ValueTypeError(f"row_ids for row table {key!r} must be integers, "
                                    f"not {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise errors.ShapeError(f"row_ids for row table {key!r}: indices must lie in "
                                f"[0, {table.shape[0]}); got {int(ids.min())}..{int(ids.max())}")
    return ids.astype(np.int64, copy=False)


#: what a table takes, by whether it is floating-point (for messages)
_KINDS = {True: "real numbers", False: "integers"}


def _check_out(key, out, table):
    """Refuses an ``out`` of ``row_sparse_pull`` that is not a writable numpy array or a
    RowSparse of the table's shape and dtype (as ``pull``'s out: nothing is cast)."""
    if out is None:
        return
    if isinstance(out, RowSparse):
        if tuple(out.shape) != table.shape:
            raise errors.ShapeError(f"out for key {key!r} has shape {tuple(out.shape)}, "
                                    f"the row table has shape {table.shape}")
        if np.dtype(out.dtype) != table.dtype:
            raise errors.DTypeError(f"out for key {key!r} has dtype {out.dtype}, "
                                    f"the row table has dtype {table.dtype}")
        return
    if not isinstance(out, np.ndarray):
        raise errors.ValueTypeError(f"out for key {key!r} is a {type(out).__name__}, not a "
                                    f"RowSparse or a numpy array")
    if not out.flags.writeable:
        raise errors.ValueTypeError(f"out for key {key!r} is read-only")
    expect(key, "out", out, (table.shape, table.dtype))


def _fill(out, rows):
    """``row_sparse_pull``'s result: ``rows`` into ``out`` (a RowSparse, an array of the
    table's shape: those rows, zeros elsewhere; or None)."""
    if isinstance(out, RowSparse):
        out.indices, out.data, out.shape = rows.indices, rows.data, rows.shape
        return out
    if out is not None:
        out[...] = 0
        out[rows.indices] = rows.data
    return rows


# -- checkpoints: each owner writes its block's element range, as for a dense key ----------
#: the names of a row table's arrays in a save (apart from dense keys' "value", "opt.")
VALUE = "rows.value"
STATE = "rows.opt."


def part_entries(tables, rank, with_values):
    """This rank's arrays of every row table, as :func:`mpikv.statefile.write_part` takes them."""
    out = []
    for key, table in tables.tables.items():
        n, lo, hi = table.row_size, table.lo, table.hi
        if with_values and hi > lo:
            out.append((key, VALUE, lo * n, hi * n, table.shape, table.block.reshape(-1)))
        for name, arr in (table.state or {}).items():
            if name == COUNT:
                if rank == 0:   # one copy: every owner counts every push
                    out.append((key, STATE + COUNT, 0, 1, (1,), arr.reshape(-1)))
            elif hi > lo:
                out.append((key, STATE + name, lo * n, hi * n, table.shape, arr.reshape(-1)))
    return out


def describe(tables):
    """The row tables of a save's manifest: ``[[key, shape, dtype], ...]``."""
    return [[key, list(t.shape), str(t.dtype)] for key, t in tables.tables.items()]


def stage(tables, man, saved, opt, with_values, read_slices):
    """Reads this rank's rows of the saved row tables; changes nothing.

    Returns:
        ``[(key, shape, dtype, block or None, state or None)]`` for :func:`install`.

    Raises:
        StateFileError: a table saved with another shape or dtype than the store's.
    """
    t = tables.transport
    names = {}
    for key, name in man.arrays():
        if name.startswith(STATE):
            names.setdefault(key, []).append(name[len(STATE):])
    staged = []
    for entry in saved or []:
        key, shape, dtype = entry[0], tuple(entry[1]), np.dtype(entry[2])
        mine = tables.tables.get(key)
        if mine is not None and (mine.shape, mine.dtype) != (shape, dtype):
            raise errors.StateFileError(f"row table {key!r} is saved as {dtype} {shape}, but "
                                        f"is {mine.dtype} {mine.shape} here")
        if mine is None and not with_values:
            continue   # (as for dense keys: states of tables not made are not loaded)
        table = RowTable(shape, dtype, t.rank, t.size) if mine is None else mine
        n, lo, hi = table.row_size, table.lo, table.hi
        wanted = [(key, VALUE, lo * n, hi * n)] if with_values and hi > lo else []
        state_names = names.get(key, [])
        if opt is not None and state_names:
            wanted += [(key, STATE + nm, 0, 1) if nm == COUNT else (key, STATE + nm, lo * n, hi * n)
                       for nm in state_names if nm == COUNT or hi > lo]
        got = read_slices(man, wanted) if wanted else {}
        block = (got[(key, VALUE, lo * n, hi * n)].reshape(table.block.shape)
                 if with_values and hi > lo else None)
        state = None
        if opt is not None and state_names:
            state = opt.create_state(key, table.block)
            for nm in state_names:
                if nm == COUNT:
                    state[COUNT][...] = got[(key, STATE + COUNT, 0, 1)]
                elif hi > lo and nm in state:
                    state[nm][...] = got[(key, STATE + nm, lo * n, hi * n)].reshape(
                        state[nm].shape)
        staged.append((key, table, block, state))
    return staged


def install(tables, staged):
    """Installs what :func:`stage` read (after every rank read its part)."""
    for key, table, block, state in staged:
        if block is not None:
            table.block[...] = block
        if state is not None:
            table.state = state
        tables.tables[key] = table


def _apply(key, table, rows, owners):
    """The owner's update of its touched rows (local indices, each once)."""
    opt = owners.optimizer
    if opt is None and owners.kind is None:   # the default: the sum is stored
        table.block[rows.indices] = rows.data
        return
    if opt is None:   # an updater: it sees the touched rows, dense
        weight = table.block[rows.indices]
        owners.updater(key, rows.data.astype(table.dtype, copy=False), weight)
        table.block[rows.indices] = weight
        return
    if table.state is None:
        table.state = opt.create_state(key, table.block)
    if not _lazy(opt, table):
        # Dense semantics: every row steps, the untouched ones with a zero gradient.
        grad = np.zeros_like(table.block)
        grad[rows.indices] = rows.data
        opt.update(key, table.block, grad, table.state)
        return
    touched = rows.indices
    weight = table.block[touched]
    state = {name: (a if name == COUNT else a[touched]) for name, a in table.state.items()}
    opt.update(key, weight, rows.data.astype(weight.dtype, copy=False), state)
    table.block[touched] = weight
    for name, a in state.items():
        if name != COUNT:
            table.state[name][touched] = a


def _lazy(opt, table):
    """Whether ``opt`` steps only the pushed rows of ``table``: its ``lazy_update``, or a
    row-sparse weight and a rule whose kernel for those is lazy (MXNet's Ftrl: a dense
    step would zero the rows never pushed, MXNet's row_sparse kernel keeps them)."""
    return bool(getattr(opt, "lazy_update", False)) or (
        table.row_sparse_weight and bool(getattr(opt, "lazy_on_row_sparse_weights", False)))


__all__ = ["RowTable", "RowTables", "takes", "part_entries", "describe", "stage", "install"]
