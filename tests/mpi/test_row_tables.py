"""Row tables at 1-4 ranks: row-sparse pushes and row_sparse_pull against one dense
numpy table that takes every rank's rows, checkpoints that resume on any rank count,
and the errors, on every rank."""

import types

import numpy as np
import pytest

import mpikv
from mpikv import optimizer as mx_optimizer
from mpikv.rows.tables import RowTables

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi

ROWS, DIM = 37, 3


def _initial(dtype):
    return (np.arange(ROWS * DIM).reshape(ROWS, DIM) % 11 - 5).astype(dtype)


def _init(dtype):
    full = _initial(dtype)
    return lambda lo, hi: full[lo:hi]


#: how each rank picks the rows it pushes at step s (rank r of n)
IDS = {
    "duplicates": lambda r, n, s, g: np.array([3, 3, 3 + r, 36, 0, 3], np.int64),
    "empty-on-some": lambda r, n, s, g: (np.array([], np.int64) if r % 2
                                         else g.integers(0, ROWS, 5)),
    "all-rows": lambda r, n, s, g: np.arange(ROWS),
    "unsorted-repeated": lambda r, n, s, g: g.integers(0, ROWS, 20)[::-1],
}

#: the owners' rule: (what the store gets, the same rule applied to the dense table)
RULES = ["assign", "updater", "sgd-lazy", "sgd-momentum-dense", "adam-lazy"]


def _rule(name):
    if name == "assign":
        return None
    if name == "updater":
        def add_twice(key, grad, stored):
            stored += 2 * grad
        return add_twice
    if name == "sgd-lazy":
        return mx_optimizer.SGD(learning_rate=0.5, lazy_update=True)
    if name == "sgd-momentum-dense":
        return mx_optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)
    return mx_optimizer.Adam(learning_rate=0.01, lazy_update=True)


def _set(kv, rule):
    if isinstance(rule, mx_optimizer.Optimizer):
        kv.set_optimizer(rule)
    elif rule is not None:
        kv.set_updater(rule)


def _reference_step(rule, table, state, grads, touched):
    """The rule on one dense table: the summed rows, on the touched rows only where lazy."""
    if rule is None:
        table[touched] = grads[touched]
    elif not isinstance(rule, mx_optimizer.Optimizer):
        rule("emb", grads[touched], w := table[touched])
        table[touched] = w
    elif not rule.lazy_update:
        rule.update("emb", table, grads, state)
    else:
        rows = {k: (v if k == mx_optimizer.COUNT else v[touched]) for k, v in state.items()}
        w = table[touched]
        rule.update("emb", w, grads[touched], rows)
        table[touched] = w
        for k, v in rows.items():
            if k != mx_optimizer.COUNT:
                state[k][touched] = v


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rule_name", RULES)
@pytest.mark.parametrize("ids", sorted(IDS))
def test_row_pushes_and_pulls_equal_one_dense_table(make_store, comm, ids, rule_name, dtype):
    if dtype == np.float16 and rule_name not in ("assign", "updater"):
        pytest.skip("float16 tables are tested with the assigning and custom updates")
    kv = make_store()
    kv.init_rows("emb", (ROWS, DIM), dtype, init=_init(dtype))
    rule, ref_rule = _rule(rule_name), _rule(rule_name)
    _set(kv, rule)
    table = _initial(dtype).astype(np.float64 if dtype == np.float16 else dtype)
    state = ref_rule.create_state("emb", table) if isinstance(ref_rule, mx_optimizer.Optimizer) \
        else None
    for step in range(3):
        gens = [np.random.default_rng(1000 * step + r) for r in range(comm.size)]
        pushed = [(IDS[ids](r, comm.size, step, gens[r]),) for r in range(comm.size)]
        pushed = [(i, np.random.default_rng(7 + 31 * step + r).standard_normal(
                      (i.size, DIM)).astype(dtype)) for r, (i,) in enumerate(pushed)]
        mine = pushed[comm.rank]
        kv.push("emb", mpikv.RowSparse(mine[0], mine[1], (ROWS, DIM)))
        grads = np.zeros_like(table)
        for i, d in pushed:
            np.add.at(grads, i, d.astype(grads.dtype))
        touched = np.unique(np.concatenate([i for i, _ in pushed]))
        _reference_step(ref_rule, table, state, grads, touched)
    want = table.astype(dtype)
    asked = np.random.default_rng(comm.rank).integers(0, ROWS, 9)
    got = kv.row_sparse_pull("emb", row_ids=asked)
    assert got.indices.tolist() == sorted(set(asked.tolist()))
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == np.float16 else {"rtol": 1e-5, "atol": 1e-6}
    np.testing.assert_allclose(got.data, want[got.indices], **tol)
    dense = np.full((ROWS, DIM), 99, dtype)
    kv.row_sparse_pull("emb", out=dense, row_ids=np.arange(ROWS)[::-1])
    np.testing.assert_allclose(dense, want, **tol)
    kv.close()


def test_a_pull_of_no_rows_and_rows_of_other_ranks(make_store, comm):
    kv = make_store()
    kv.init_rows(7, (ROWS, DIM), init=2.5)
    out = mpikv.RowSparse([], np.zeros((0, DIM), np.float32), (ROWS, DIM))
    ids = [] if comm.rank == 0 else [ROWS - 1, ROWS - 1, 0]
    got = kv.row_sparse_pull(7, out=out, row_ids=ids)
    assert got is out and out.indices.tolist() == sorted(set(ids))
    assert (out.data == 2.5).all() and out.data.shape == (len(set(ids)), DIM)
    kv.close()


def test_each_rank_holds_only_its_block(comm):
    # White-box, on the piece: the store's RowTables over a transport of this rank.
    tables = RowTables(types.SimpleNamespace(rank=comm.rank, size=comm.size))
    table = tables.make((1000, 8), np.float64, lambda lo, hi: np.full((hi - lo, 8), lo))
    blocks = comm.allgather(table.block.shape[0])
    assert sum(blocks) == 1000 and max(blocks) - min(blocks) <= 1
    assert (table.block == table.lo).all() and table.lo == sum(blocks[:comm.rank])


@pytest.mark.parametrize("after", [1, 2, 3, 4])
def test_a_row_table_checkpoint_resumes_on_another_rank_count(make_store, comm, tmp_path_factory,
                                                              after):
    """Saved by these ranks, loaded by the first ``after`` of them (a new store on a
    communicator of that size): values, Adam's moments and count, exactly."""
    if after > comm.size:
        pytest.skip(f"{after} ranks needed")
    path = comm.bcast(str(tmp_path_factory.mktemp("rows") / "ck") if comm.rank == 0 else None)
    kv = make_store()
    kv.init_rows("emb", (ROWS, DIM), init=_init(np.float32))
    kv.set_optimizer(mx_optimizer.Adam(learning_rate=0.01, lazy_update=True))
    pushes = [np.random.default_rng(s).integers(0, ROWS, 8) for s in range(4)]
    grads = [np.random.default_rng(10 + s).standard_normal((8, DIM)).astype(np.float32)
             for s in range(4)]
    for s in range(2):
        kv.push("emb", mpikv.RowSparse(pushes[s], grads[s], (ROWS, DIM)))
    kv.save_checkpoint(path)
    for s in range(2, 4):   # the run that never stopped
        kv.push("emb", mpikv.RowSparse(pushes[s], grads[s], (ROWS, DIM)))
    want = kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data
    kv.close()
    sub = comm.Split(0 if comm.rank < after else 1, comm.rank)
    if comm.rank < after:
        again = make_store(comm=sub)
        again.load_checkpoint(path)   # makes the table, the optimizer from the file
        for s in range(2, 4):
            # The pushes of the ranks that are gone, from these ranks.
            total = np.concatenate([pushes[s]] * comm.size) if sub.rank == 0 else \
                np.array([], np.int64)
            data = np.concatenate([grads[s]] * comm.size) if sub.rank == 0 else \
                np.zeros((0, DIM), np.float32)
            again.push("emb", mpikv.RowSparse(total, data, (ROWS, DIM)))
        got = again.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        again.close()
    sub.Free()


def test_row_table_errors_reach_every_rank_with_nothing_applied(make_store, comm):
    kv = make_store()
    kv.init("dense", np.zeros((4, 2), np.float32))
    kv.init_rows("emb", (ROWS, DIM), init=1.0)
    rows = mpikv.RowSparse([1], np.ones((1, DIM), np.float32), (ROWS, DIM))
    raises_everywhere(comm, mpikv.UnknownKeyError,
                      lambda: kv.push("dense", mpikv.RowSparse([0], np.ones((1, 2)), (4, 2))))
    raises_everywhere(comm, mpikv.ValueTypeError, lambda: kv.push("emb", np.ones((ROWS, DIM))))
    bad = rows if comm.rank else mpikv.RowSparse([1], np.ones((1, 2), np.float32), (ROWS, 2))
    raises_everywhere(comm, mpikv.ShapeError, lambda: kv.push("emb", bad))
    raises_everywhere(comm, mpikv.DuplicateInitError, lambda: kv.init_rows("emb", (3, 3)))
    raises_everywhere(comm, mpikv.UnknownKeyError,
                      lambda: kv.row_sparse_pull("nope", row_ids=[0]))
    ids = [0] if comm.rank else [ROWS]
    raises_everywhere(comm, mpikv.ShapeError, lambda: kv.row_sparse_pull("emb", row_ids=ids))
    if comm.size > 1:
        raises_everywhere(comm, mpikv.MismatchError, lambda: kv.init_rows(
            "other", (ROWS + comm.rank, DIM)))
        raises_everywhere(comm, mpikv.MismatchError, lambda: kv.init_rows(
            "other", (ROWS, DIM), row_sparse_weight=comm.rank == 1))
    # nothing was applied: every row is still 1
    assert (kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data == 1).all()
    kv.close()


def test_an_initializer_that_fails_on_one_rank_fails_every_rank(make_store, comm):
    kv = make_store()

    def init(lo, hi):
        return np.zeros((hi - lo, DIM + (comm.rank == comm.size - 1)), np.float32)
    raises_everywhere(comm, mpikv.ShapeError, lambda: kv.init_rows("emb", (ROWS, DIM), init=init))
    kv.init_rows("emb", (ROWS, DIM), init=1.0)   # not made: the key is free
    kv.close()


def test_pushes_of_other_dtypes_than_the_tables_are_cast(make_store, comm):
    kv = make_store()
    kv.init_rows("emb", (ROWS, DIM), init=0.0)
    dtype = np.float64 if comm.rank % 2 else np.float32
    kv.push("emb", mpikv.RowSparse([ROWS - 1 - comm.rank, 0], np.ones((2, DIM), dtype),
                                   (ROWS, DIM)))
    got = kv.row_sparse_pull("emb", row_ids=np.arange(ROWS)).data
    want = np.zeros((ROWS, DIM), np.float32)
    want[0] = comm.size
    for r in range(comm.size):
        want[ROWS - 1 - r] += 1
    np.testing.assert_array_equal(got, want)
    kv.close()


@pytest.mark.parametrize("sums", ["scipy", "numpy"])
@pytest.mark.parametrize("dtype,row_shape", [(np.float32, (16,)), (np.float16, (16,)),
                                             (np.float32, ()), (np.float64, (2, 3))])
def test_many_repeats_add_up_as_one_dense_table(make_store, comm, monkeypatch, sums, dtype,
                                                row_shape):
    """Thousands of Zipf-like ids with long runs of repeats on every rank (the sums of
    :func:`mpikv.rows.rowsparse.sum_rows`: scipy's CSR product and numpy's reduceat)."""
    from mpikv.rows import rowsparse
    if sums == "scipy":
        pytest.importorskip("scipy.sparse")
        monkeypatch.setattr(rowsparse, "_SPARSE", [])
    else:
        monkeypatch.setattr(rowsparse, "_SPARSE", [None])
    rows = 1000
    kv = make_store()
    kv.init_rows("emb", (rows, *row_shape), dtype, init=0.5)
    pushed = []
    for r in range(comm.size):
        g = np.random.default_rng(50 + r)
        ids = (g.zipf(1.2, 3000) * 7919 + r) % rows
        pushed.append((ids, g.standard_normal((ids.size, *row_shape)).astype(dtype)))
    kv.push("emb", mpikv.RowSparse(*pushed[comm.rank], (rows, *row_shape)))
    want = np.full((rows, *row_shape), 0.5)
    touched = np.unique(np.concatenate([i for i, _ in pushed]))
    want[touched] = 0
    for i, d in pushed:
        np.add.at(want, i, d.astype(np.float64))
    got = kv.row_sparse_pull("emb", row_ids=np.arange(rows)[::-1])
    assert got.data.dtype == dtype and got.data.shape == (rows, *row_shape)
    tol = {"rtol": 1e-2, "atol": 2e-2} if dtype == np.float16 else {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(got.data.astype(np.float64), want, **tol)
    kv.close()


def test_a_dense_init_of_a_row_table_key_is_refused_everywhere(make_store, comm):
    kv = make_store()
    kv.init_rows("emb", (ROWS, DIM))
    raises_everywhere(comm, mpikv.DuplicateInitError,
                      lambda: kv.init("emb", np.zeros((ROWS, DIM), np.float32)))
    kv.close()


def test_row_sparse_checks_its_parts():
    with pytest.raises(mpikv.ShapeError, match=r"data has shape \(2, 3\); 1 rows"):
        mpikv.RowSparse([0], np.zeros((2, 3)), (5, 3))
    with pytest.raises(mpikv.ShapeError, match=r"indices must lie in \[0, 5\)"):
        mpikv.RowSparse([5], np.zeros((1, 3)), (5, 3))
    with pytest.raises(mpikv.ValueTypeError, match="1-D array of integers"):
        mpikv.RowSparse([0.5], np.zeros((1, 3)), (5, 3))
    with pytest.raises(mpikv.ValueTypeError, match="1-D array of integers"):
        mpikv.RowSparse([[0, 1], [2]], np.zeros((3, 3)), (5, 3))   # ragged
    with pytest.raises(mpikv.ShapeError, match=r"shape \('x', 3\) is not a tuple"):
        mpikv.RowSparse([0], np.zeros((1, 3)), ("x", 3))
    rows = mpikv.RowSparse([4, 1, 4], np.arange(9.0).reshape(3, 3), (5, 3)).summed()
    assert rows.indices.tolist() == [1, 4]
    np.testing.assert_array_equal(rows.data, [[3, 4, 5], [6, 8, 10]])
