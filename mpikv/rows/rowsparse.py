"""``RowSparse``: some rows of an array, as MXNet's ``RowSparseNDArray`` holds them."""

import numbers

import numpy as np

from .. import errors


def _is_int(d):
    return isinstance(d, numbers.Integral) and not isinstance(d, (bool, np.bool_))


def read_shape(shape, what="shape"):
    """``shape`` as a tuple of ints, each at least 0 (an int is one axis).

    Raises:
        ShapeError: anything else (``('x', 4)``, ``(2.5,)``, a negative length).
    """
    dims = (shape,) if _is_int(shape) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        dims = None
    if dims is None or not all(_is_int(d) and d >= 0 for d in dims):
        raise errors.ShapeError(f"{what} {shape!r} is not a tuple of non-negative ints")
    return tuple(int(d) for d in dims)


def read_parts(indices, data, shape):
    """``(indices, data, shape)`` of a :class:`RowSparse`, checked: int64 indices (a
    view where they are int64 already), the data as an array, the shape a tuple.

    Raises:
        ShapeError: the parts do not fit together, or an index is out of range.
        ValueTypeError: the indices are not 1-D integers, or the data not an array.
    """
    shape = read_shape(shape, "a RowSparse array's shape")
    try:
        indices = np.asarray(indices)
    except Exception as exc:  # noqa: BLE001 - ragged lists: numpy's ValueError
        raise errors.ValueTypeError(f"RowSparse indices must be a 1-D array of integers "
                                    f"({type(exc).__name__}: {exc})") from None
    try:
        data = np.asarray(data)
    except Exception as exc:  # noqa: BLE001
        raise errors.ValueTypeError(f"RowSparse data is not an array "
                                    f"({type(exc).__name__}: {exc})") from None
    if len(shape) < 1:
        raise errors.ShapeError("a RowSparse array has rows: its shape has at least one axis")
    if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
        raise errors.ValueTypeError("RowSparse indices must be a 1-D array of integers")
    if data.shape != (indices.size, *shape[1:]):
        raise errors.ShapeError(f"RowSparse data has shape {data.shape}; {indices.size} rows "
                                f"of {shape[1:]} make {(indices.size, *shape[1:])}")
    if indices.size and (indices.min() < 0 or indices.max() >= shape[0]):
        raise errors.ShapeError(f"RowSparse indices must lie in [0, {shape[0]}); got "
                                f"{int(indices.min())}..{int(indices.max())}")
    return indices.astype(np.int64, copy=False), data, shape


class RowSparse:
    """Rows ``indices`` of an array of ``shape``; ``data[i]`` is row ``indices[i]``.

    Indices may repeat (their rows add up) and come in any order.

    Args:
        indices: 1-D integers, each in ``[0, shape[0])``.
        data: an array of ``(len(indices), *shape[1:])``.
        shape: the whole array's shape.

    Raises:
        ShapeError: the parts do not fit together, or an index is out of range.
        ValueTypeError: the indices are not 1-D integers.

    The store checks the parts again at each call (:func:`read_parts`): indices the
    caller changed since are refused there, never dropped.
    """

    __slots__ = ("indices", "data", "shape")

    def __init__(self, indices, data, shape):
        self.indices, self.data, self.shape = read_parts(indices, data, shape)

    @property
    def dtype(self):
        return self.data.dtype

    def summed(self):
        """The same rows with each index once, in increasing order (repeats added, in
        the order they come)."""
        unique, data = sum_rows(self.indices, self.data, self.shape[0])
        return RowSparse(unique, data, self.shape)

    def todense(self):
        """The whole array: these rows (repeats added), zeros elsewhere."""
        out = np.zeros(self.shape, self.data.dtype)
        unique, data = sum_rows(self.indices, self.data, self.shape[0])
        out[unique] = data
        return out

    @classmethod
    def from_torch(cls, tensor):
        """A torch sparse COO tensor's rows (``nn.Embedding(sparse=True)``'s gradient)."""
        t = tensor.coalesce()
        return cls(t.indices()[0].cpu().numpy(), t.values().cpu().numpy(), tuple(t.shape))

    def __repr__(self):
        return f"RowSparse({self.indices.size} rows of {self.shape}, {self.data.dtype})"


# -- sums of repeated rows -------------------------------------------------------------
# ``np.add.at`` adds 65536 rows of 64 float32 into 18000 in about 45 ms, and sort +
# ``np.add.reduceat`` takes about as long (its per-segment overhead); a scipy CSR product
# (row k: ones at unique id k's repeats) sums the same rows in 3-5 ms, sort included.
# scipy is not a dependency: without it the sums are numpy's ``reduceat``.
_SPARSE = []   # [scipy.sparse or None], filled on first use


def _scipy_sparse():
    if not _SPARSE:
        try:
            import scipy.sparse as sparse
        except ImportError:   # pragma: no cover - scipy is optional
            sparse = None
        _SPARSE.append(sparse)
    return _SPARSE[0]


#: dtypes scipy's CSR product sums (float16 rows are summed in float32, rounded once)
_SCIPY_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def sort_ids(ids, bound):
    """``(sorted ids, order)``: ``ids[order]`` in increasing order, repeats in the order
    they come (a stable argsort). Ids lie in ``[0, bound)``.

    One ``np.sort`` of ``id << bits | position`` keys where they fit in 63 bits (about
    5x faster than numpy's stable argsort of int64 ids)."""
    n = ids.size
    shift = max(int(n - 1).bit_length(), 1)
    if n and int(bound - 1).bit_length() + shift <= 63:
        keys = np.left_shift(ids, shift, dtype=np.int64)
        keys |= np.arange(n, dtype=np.int64)
        keys.sort()
        order = keys & ((1 << shift) - 1)
        keys >>= shift
        return keys, order
    order = np.argsort(ids, kind="stable")
    return ids[order], order


def unique_ids(ids):
    """Each id once, in increasing order: ``np.sort`` and a compare (numpy 2's
    ``np.unique`` of 65536 int64 ids takes about 10x as long, through a hash table)."""
    s = np.sort(ids)
    if s.size < 2:
        return s
    keep = np.empty(s.size, bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def sum_rows(ids, data, bound):
    """``(unique ids, summed rows)``: each id of ``ids`` once, in increasing order, with
    the sum of its rows of ``data`` (``data[i]`` is row ``ids[i]``), repeats added in the
    order they come. Ids lie in ``[0, bound)``. The rows keep ``data``'s dtype.
    """
    ids = np.asarray(ids, np.int64)
    n = ids.size
    if n == 0:
        return ids, data
    s, order = sort_ids(ids, bound)
    first = np.empty(n, bool)
    first[0] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    if starts.size == n:   # no repeats: the rows in order
        return s, data[order]
    unique = s[starts]
    flat = data.reshape(n, -1)
    sparse = _scipy_sparse()
    work = np.dtype(np.float32) if data.dtype == np.float16 else data.dtype
    if sparse is not None and work in _SCIPY_DTYPES and flat.shape[1]:
        # Row k of the sum matrix: ones at the positions of unique[k]'s repeats, in
        # their order (scipy adds each row's terms in order, from zero: as np.add.at).
        indptr = np.empty(starts.size + 1, np.int64)
        indptr[:-1] = starts
        indptr[-1] = n
        m = sparse.csr_matrix((np.ones(n, work), order, indptr), shape=(starts.size, n))
        out = np.asarray(m @ flat.astype(work, copy=False))
        return unique, out.astype(data.dtype, copy=False).reshape(starts.size, *data.shape[1:])
    out = np.add.reduceat(flat[order], starts, axis=0, dtype=data.dtype)
    return unique, out.reshape(starts.size, *data.shape[1:])


__all__ = ["RowSparse", "read_parts", "read_shape", "sum_rows", "unique_ids", "sort_ids"]
