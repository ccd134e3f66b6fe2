"""The row-table calls' bad inputs (issue 38), at 1-4 ranks: each raises the same
``mpikv.MPIKVError`` subclass, with the same message, on every rank, whether one rank
or every rank made it bad; nothing was applied (the tables and the dense key hold what
they held), and the store still works.

Each of these once raised a raw error on the bad rank alone (the others then waited
for the watchdog), or went on silently: complex rows lost their imaginary parts, an
int key went into a store of str keys, an object table broke every later save, a
float64 ``out`` was cast, an id changed after the RowSparse was made was dropped.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

import mpikv
from mpikv import errors

pytestmark = pytest.mark.mpi

#: a rank left waiting by one that raised alone ends the job this soon
HANG_TIMEOUT = 30
ROWS, DIM = 7, 2
SHAPE = (ROWS, DIM)
EVERY = "every"
ONE_RANK = (EVERY, 0, -1)


def _initial(lo=0, hi=ROWS):
    return np.arange(lo * DIM, hi * DIM, dtype=np.float32).reshape(hi - lo, DIM)


def tables(kv):
    """``emb`` (float32, row i is ``2i, 2i+1``), ``count`` (int32, ones) and a dense
    ``w``: str keys. Returns what each holds."""
    kv.init("w", np.ones(3, np.float32))
    kv.init_rows("emb", SHAPE, np.float32, init=_initial)
    kv.init_rows("count", SHAPE, np.int32, init=1)
    return {"emb": _initial(), "count": np.ones(SHAPE, np.int32), "w": np.ones(3, np.float32)}


def only_tables(kv):
    """A store whose only key is the row table ``emb`` (str)."""
    kv.init_rows("emb", SHAPE, np.float32, init=_initial)
    return {"emb": _initial()}


def _rows(ids=(0, 3), dtype=np.float32, shape=SHAPE):
    ids = np.asarray(ids, np.int64)
    return mpikv.RowSparse(ids, np.ones((ids.size, *shape[1:]), dtype), shape)


def _good_push(kv):
    kv.push("emb", _rows())


def _good_pull(kv):
    kv.row_sparse_pull("emb", row_ids=[0, 3])


def _good_init(kv):
    kv.init_rows("new", (4, DIM))


def _readonly(shape=SHAPE, dtype=np.float32):
    a = np.zeros(shape, dtype)
    a.flags.writeable = False
    return a


def _changed_ids(value):
    """A RowSparse whose id array the caller changed after making it."""
    def make(kv):
        rows = _rows()
        rows.indices[1] = value
        kv.push("emb", rows)
    return make


def _ids_replaced(kv):
    rows = _rows()
    rows.indices = np.array([0.0, 3.0])
    kv.push("emb", rows)


def _new_key_free(kv):
    """The key the failed init named is still free, on every rank."""
    kv.init_rows("new", (4, DIM), init=2.0)
    assert (kv.row_sparse_pull("new", row_ids=np.arange(4)).data == 2).all()


@dataclass(frozen=True)
class Case:
    """One bad row call: ``bad(kv)`` where the run makes it bad, ``good(kv)`` elsewhere."""

    name: str
    bad: Callable
    good: Callable
    error: type
    bad_on: tuple = ONE_RANK
    setup: Callable = tables
    after: Callable = None


CASES = [
    # -- arguments a rank cannot read ----------------------------------------------------
    Case("ragged row_ids", lambda kv: kv.row_sparse_pull("emb", row_ids=[[0, 1], [2]]),
         _good_pull, errors.ValueTypeError),
    Case("float row_ids", lambda kv: kv.row_sparse_pull("emb", row_ids=[0.5]),
         _good_pull, errors.ValueTypeError),
    Case("row_ids out of range", lambda kv: kv.row_sparse_pull("emb", row_ids=[ROWS]),
         _good_pull, errors.ShapeError),
    Case("init_rows shape ('x', 4)", lambda kv: kv.init_rows("new", ("x", 4)), _good_init,
         errors.ShapeError, after=_new_key_free),
    Case("init_rows shape (2.5, 2)", lambda kv: kv.init_rows("new", (2.5, DIM)), _good_init,
         errors.ShapeError, after=_new_key_free),
    Case("init_rows dtype 'nope'", lambda kv: kv.init_rows("new", (4, DIM), "nope"),
         _good_init, errors.DTypeError, after=_new_key_free),
    Case("rows of strings", lambda kv: kv.push("emb", mpikv.RowSparse(
        [0], np.array([["a", "b"]]), SHAPE)), _good_push, errors.DTypeError),
    Case("rows of objects", lambda kv: kv.push("emb", mpikv.RowSparse(
        [0], np.ones((1, DIM), object), SHAPE)), _good_push, errors.DTypeError),
    Case("row_sparse_pull priority 'high'",
         lambda kv: kv.row_sparse_pull("emb", row_ids=[0], priority="high"), _good_pull,
         errors.InputError),
    # -- nothing cast with a loss unseen -------------------------------------------------
    Case("complex64 rows to a float32 table", lambda kv: kv.push("emb", _rows(
        dtype=np.complex64)), _good_push, errors.DTypeError),
    Case("float rows to an int32 table", lambda kv: kv.push("count", _rows(
        dtype=np.float32)), lambda kv: kv.push("count", _rows(dtype=np.int32)),
         errors.DTypeError),
    Case("complex initializer", lambda kv: kv.init_rows(
        "new", (4, DIM), init=lambda lo, hi: np.full((hi - lo, DIM), 1 + 1j)), _good_init,
         errors.DTypeError, after=_new_key_free),
    Case("row_sparse_pull out float64",
         lambda kv: kv.row_sparse_pull("emb", out=np.zeros(SHAPE), row_ids=[0]),
         lambda kv: kv.row_sparse_pull("emb", out=np.zeros(SHAPE, np.float32), row_ids=[0]),
         errors.DTypeError),
    Case("row_sparse_pull out RowSparse float64",
         lambda kv: kv.row_sparse_pull("emb", out=_rows(dtype=np.float64), row_ids=[0]),
         lambda kv: kv.row_sparse_pull("emb", out=_rows(), row_ids=[0]), errors.DTypeError),
    Case("row_sparse_pull read-only out",
         lambda kv: kv.row_sparse_pull("emb", out=_readonly(), row_ids=[0]),
         lambda kv: kv.row_sparse_pull("emb", out=np.zeros(SHAPE, np.float32), row_ids=[0]),
         errors.ValueTypeError),
    Case("row_sparse_pull out a list",
         lambda kv: kv.row_sparse_pull("emb", out=[[0.0] * DIM] * ROWS, row_ids=[0]),
         _good_pull, errors.ValueTypeError),
    # -- keys ------------------------------------------------------------------------------
    Case("init_rows key 1.5", lambda kv: kv.init_rows(1.5, (4, DIM)), _good_init,
         errors.KeyTypeError, after=_new_key_free),
    Case("init_rows key True", lambda kv: kv.init_rows(True, (4, DIM)), _good_init,
         errors.KeyTypeError, after=_new_key_free),
    Case("init_rows int key in a store of str keys", lambda kv: kv.init_rows(3, (4, DIM)),
         _good_init, errors.KeyTypeError, bad_on=(EVERY,), after=_new_key_free),
    Case("init_rows int key in a store of str row tables",
         lambda kv: kv.init_rows(3, (4, DIM)), _good_init, errors.KeyTypeError,
         bad_on=(EVERY,), setup=only_tables, after=_new_key_free),
    Case("dense init of an int key in a store of str row tables",
         lambda kv: kv.init(3, np.ones(2, np.float32)), None, errors.KeyTypeError,
         bad_on=(EVERY,), setup=only_tables),
    Case("broadcast of a row table's key",
         lambda kv: kv.broadcast("emb", np.ones(SHAPE, np.float32),
                                 out=np.zeros(SHAPE, np.float32)),
         None, errors.DuplicateInitError, bad_on=(EVERY,)),
    Case("row_sparse_pull key 1.5", lambda kv: kv.row_sparse_pull(1.5, row_ids=[0]),
         _good_pull, errors.KeyTypeError),
    Case("row_sparse_pull of a list key", lambda kv: kv.row_sparse_pull([["emb"]], row_ids=[0]),
         _good_pull, errors.KeyTypeError),
    Case("push of an unhashable key", lambda kv: kv.push([["emb"]], [_rows()]),
         _good_push, errors.KeyTypeError),
    Case("push of a key twice", lambda kv: kv.push(["emb", "emb"], [_rows(), _rows()]),
         _good_push, errors.InputError),
    # -- tables the store cannot hold (every later save would fail) ----------------------
    Case("object table", lambda kv: kv.init_rows("new", (4, DIM), object), _good_init,
         errors.DTypeError, after=_new_key_free),
    Case("complex128 table", lambda kv: kv.init_rows("new", (4, DIM), np.complex128),
         _good_init, errors.DTypeError, after=_new_key_free),
    # -- a RowSparse changed after it was made: read again at the call -------------------
    Case("id changed to the row count", _changed_ids(ROWS), _good_push, errors.ShapeError),
    Case("id changed to -1", _changed_ids(-1), _good_push, errors.ShapeError),
    Case("ids replaced by floats", _ids_replaced, _good_push, errors.ValueTypeError),
]

assert len({c.name for c in CASES}) == len(CASES)
RUNS = [(case, where) for case in CASES for where in case.bad_on]


def _run_id(run):
    case, where = run
    return f"{case.name}-{'every rank' if where == EVERY else f'rank {where} only'}"


def pulled_everything(kv, held):
    """Every key of ``held``, pulled (row tables: all their rows)."""
    got = {}
    for key, value in held.items():
        if key == "w":
            got[key] = np.zeros(value.shape, value.dtype)
            kv.pull(key, out=got[key])
        else:
            got[key] = kv.row_sparse_pull(key, row_ids=np.arange(ROWS)).data
    return got


@pytest.mark.parametrize("case,where", RUNS, ids=[_run_id(r) for r in RUNS])
def test_a_bad_row_call_fails_every_rank_with_nothing_applied(make_store, comm, case, where):
    size = comm.size
    bad = set(range(size)) if where == EVERY else {where % size}
    if where != EVERY and (size == 1 or (where == -1 and size - 1 == 0)):
        pytest.skip("at one rank, the same run as every rank's")
    kv = make_store(timeout=HANG_TIMEOUT)
    held = case.setup(kv)
    try:
        (case.bad if comm.rank in bad else case.good)(kv)
        got = None
    except Exception as exc:  # noqa: BLE001 - any class: every rank must say the same
        got = (type(exc), str(exc))
    everyone = comm.allgather(None if got is None else (got[0].__name__, got[1]))
    assert all(e is not None for e in everyone), everyone
    assert len(set(everyone)) == 1, everyone
    cls, message = got
    assert issubclass(cls, case.error) and issubclass(cls, errors.MPIKVError), everyone[0]
    assert message.endswith("nothing was applied"), message
    if where != EVERY and size > 1:
        assert f"rank {min(bad)}: " in message, message
    if case.after is not None:
        case.after(kv)
    # Nothing applied: every key as the setup left it, on every rank.
    got = pulled_everything(kv, held)
    for key, value in held.items():
        np.testing.assert_array_equal(got[key], value)
    # The store still works: every rank adds one to rows 0 and 3 (the sum is stored).
    kv.push("emb", _rows())
    want = _initial()
    want[[0, 3]] = size
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data,
                                  want)


def test_an_optimizer_refuses_an_int_table_on_every_rank(make_store, comm):
    kv = make_store(timeout=HANG_TIMEOUT)
    tables(kv)
    kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.1))
    try:
        kv.push("count", _rows(dtype=np.int32))
        got = None
    except Exception as exc:  # noqa: BLE001
        got = f"{type(exc).__name__}: {exc}"
    everyone = comm.allgather(got)
    assert len(set(everyone)) == 1 and everyone[0].startswith("OptimizerError: "), everyone
    np.testing.assert_array_equal(kv.row_sparse_pull("count", row_ids=np.arange(ROWS)).data,
                                  np.ones(SHAPE, np.int32))


def test_keys_of_a_row_push_may_come_in_any_order(make_store, comm):
    """As for a dense push: ranks naming the same tables in another order agree, and
    each table takes every rank's rows."""
    kv = make_store(timeout=HANG_TIMEOUT)
    tables(kv)
    keys = ["emb", "count"] if comm.rank % 2 == 0 else ["count", "emb"]
    values = {"emb": _rows(), "count": _rows([1], np.int32)}
    kv.push(keys, [values[k] for k in keys])
    emb, count = _initial(), np.ones(SHAPE, np.int32)
    emb[[0, 3]] = comm.size
    count[1] = comm.size
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data, emb)
    np.testing.assert_array_equal(kv.row_sparse_pull("count", row_ids=np.arange(ROWS)).data,
                                  count)
