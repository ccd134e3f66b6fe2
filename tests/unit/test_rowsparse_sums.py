"""``mpikv.rows.rowsparse``'s sums of repeated rows (issue 23's speed work): the same rows as
``np.add.at`` (bit for bit in float32 and float64, where scipy adds them in the same
order), with and without scipy, in every row shape; the sort and dedup helpers."""
import numpy as np
import pytest

from mpikv import RowSparse
from mpikv.rows import rowsparse
from mpikv.rows.rowsparse import sort_ids, sum_rows, unique_ids


@pytest.fixture(params=["scipy", "numpy"])
def sums(request, monkeypatch):
    """Each test with scipy's CSR product (where scipy is installed) and numpy's reduceat."""
    if request.param == "scipy":
        pytest.importorskip("scipy.sparse")
        monkeypatch.setattr(rowsparse, "_SPARSE", [])
    else:
        monkeypatch.setattr(rowsparse, "_SPARSE", [None])
    return request.param


def _zipf(rng, k, rows):
    return (rng.zipf(1.3, k) * 7919) % rows


def _add_at(ids, data, rows):
    unique, inverse = np.unique(ids, return_inverse=True)
    out = np.zeros((unique.size, *data.shape[1:]), data.dtype)
    np.add.at(out, inverse.reshape(-1), data)
    return unique, out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_equal_add_at(sums, dtype):
    rng = np.random.default_rng(1)
    ids = _zipf(rng, 5000, 1000)
    data = rng.standard_normal((5000, 8)).astype(dtype)
    got_ids, got = sum_rows(ids, data, 1000)
    want_ids, want = _add_at(ids, data, 1000)
    np.testing.assert_array_equal(got_ids, want_ids)
    assert got.dtype == dtype
    if sums == "scipy":   # the same additions in the same order
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64])
def test_other_dtypes_kept(sums, dtype):
    rng = np.random.default_rng(2)
    ids = _zipf(rng, 2000, 300)
    data = (rng.standard_normal((2000, 3)) * 4).astype(dtype)
    got_ids, got = sum_rows(ids, data, 300)
    want_ids, _ = _add_at(ids, data, 300)
    exact = _add_at(ids, data.astype(np.float64), 300)[1]
    np.testing.assert_array_equal(got_ids, want_ids)
    assert got.dtype == dtype
    if dtype == np.float16:   # summed in float32 (scipy) or float16: within float16's steps
        np.testing.assert_allclose(got.astype(np.float64), exact, rtol=1e-2, atol=0.5)
    else:
        np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("row_shape", [(), (1,), (3, 2), (0,)])
def test_row_shapes(sums, row_shape):
    rng = np.random.default_rng(3)
    ids = np.array([4, 0, 4, 9, 0, 4])
    data = rng.standard_normal((6, *row_shape)).astype(np.float32)
    got_ids, got = sum_rows(ids, data, 10)
    np.testing.assert_array_equal(got_ids, [0, 4, 9])
    assert got.shape == (3, *row_shape)
    np.testing.assert_allclose(got, _add_at(ids, data, 10)[1], rtol=1e-6)


def test_no_repeats_and_empty(sums):
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    got_ids, got = sum_rows(np.array([5, 1, 7, 2]), data, 8)
    np.testing.assert_array_equal(got_ids, [1, 2, 5, 7])
    np.testing.assert_array_equal(got, data[[1, 3, 0, 2]])
    got_ids, got = sum_rows(np.zeros(0, np.int64), np.zeros((0, 2), np.float32), 8)
    assert got_ids.size == 0 and got.shape == (0, 2)


def test_non_contiguous_rows(sums):
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    data = base[:, ::2]
    got_ids, got = sum_rows(np.array([2, 2, 1, 2, 1]), data, 3)
    np.testing.assert_array_equal(got_ids, [1, 2])
    np.testing.assert_array_equal(got, [data[2] + data[4], data[0] + data[1] + data[3]])


def test_sort_ids_is_a_stable_argsort():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 50, 3000)
    s, order = sort_ids(ids, 50)
    np.testing.assert_array_equal(order, np.argsort(ids, kind="stable"))
    np.testing.assert_array_equal(s, np.sort(ids))
    # Ids too large for the packed keys: numpy's stable argsort.
    big = ids.astype(np.int64) << 50
    s, order = sort_ids(big, 1 << 56)
    np.testing.assert_array_equal(order, np.argsort(big, kind="stable"))
    np.testing.assert_array_equal(s, np.sort(big))
    s, order = sort_ids(np.zeros(0, np.int64), 5)
    assert s.size == 0 and order.size == 0
    s, order = sort_ids(np.array([3]), 5)
    assert list(s) == [3] and list(order) == [0]


def test_unique_ids():
    rng = np.random.default_rng(5)
    for ids in (rng.integers(0, 100, 1000), np.zeros(0, np.int64), np.array([7]),
                np.array([2, 2, 2])):
        np.testing.assert_array_equal(unique_ids(ids), np.unique(ids))


def test_summed_and_todense(sums):
    r = RowSparse([3, 1, 3, 0], np.arange(8, dtype=np.float32).reshape(4, 2), (5, 2))
    s = r.summed()
    np.testing.assert_array_equal(s.indices, [0, 1, 3])
    np.testing.assert_array_equal(s.data, [[6, 7], [2, 3], [4, 6]])
    np.testing.assert_array_equal(r.todense(), [[6, 7], [2, 3], [0, 0], [4, 6], [0, 0]])
    assert r.todense().dtype == np.float32
