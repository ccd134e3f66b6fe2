"""MXNet NDArrays as numpy arrays over the same memory, and a call's arguments converted.

The store takes numpy arrays. A CPU ``mx.nd.NDArray`` is handed to it as a
numpy view of its own memory (no copy), made with MXNet's C API:

* ``MXNDArrayWaitToRead`` / ``MXNDArrayWaitToWrite`` first, because MXNet's
  engine is asynchronous: a gradient may still be being written by backward,
  and a weight may still be read by a queued operator when the store is
  about to overwrite it;
* then ``MXNDArrayGetData``, which also turns an array MKL-DNN keeps in its
  own blocked layout back into the default row-major layout (MXNet 1.9.1's
  ``to_dlpack_for_read`` refuses such arrays, and numpy 1.23 imports DLPack
  read-only, so DLPack serves neither weights after an inference pass nor
  outputs).

The view keeps the NDArray alive. Sparse NDArrays have no dense memory: as
values they are densified (a copy); as outputs they are filled after the
call from a dense scratch array.
"""

import ctypes

import numpy as np

from .. import errors

#: MXNet device types whose memory the host can read (``Context.devtype2str``)
HOST_DEVICES = ("cpu", "cpu_pinned", "cpu_shared")


class _Memory:
    """The ``__array_interface__`` of an NDArray's memory; holds the NDArray."""

    __slots__ = ("ndarray", "__array_interface__")

    def __init__(self, ndarray, pointer, shape, dtype, writable):
        self.ndarray = ndarray
        self.__array_interface__ = {"data": (pointer, not writable), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


def _lib():
    from mxnet.base import _LIB, check_call
    return _LIB, check_call


def view(nd, writable):
    """A numpy array over ``nd``'s memory, once MXNet's pending work on it is done.

    Args:
        nd: a dense NDArray on the host.
        writable: the caller will write into it (waits for pending reads
            too, and the view is writeable); else a read-only view.

    Returns:
        ``numpy.ndarray`` with ``nd``'s shape and dtype; writes through it
        show in ``nd``.
    """
    lib, check_call = _lib()
    handle = nd.handle
    check_call((lib.MXNDArrayWaitToWrite if writable else lib.MXNDArrayWaitToRead)(handle))
    pointer = ctypes.c_void_p()
    # Also reorders MKL-DNN layouts to the default one, in place.
    check_call(lib.MXNDArrayGetData(handle, ctypes.byref(pointer)))
    dtype = np.dtype(nd.dtype)
    return np.asarray(_Memory(nd, pointer.value, nd.shape, dtype, writable))


def problem(nd):
    """Why ``nd`` cannot be viewed on the host, or None."""
    device = nd.context.device_type
    if device not in HOST_DEVICES:
        return (f"an NDArray on {nd.context}: mpikv.mxnet takes CPU NDArrays (GPU "
                f"NDArrays are not supported yet; copy with .as_in_context(mx.cpu()))")
    return None


def is_sparse(nd):
    """Whether ``nd`` is a row_sparse or csr NDArray."""
    return nd.stype != "default"


class Converted:
    """A call's values and outputs as the store takes them, and what follows the call.

    Attributes:
        values: the values, NDArrays replaced by numpy views.
        outs: the outputs, likewise (sparse ones by dense scratch arrays).
        failure: ``(error class, message)`` of the first NDArray that could not
            be used, or None (the store then fails the call on every rank).
        after: functions to run once the call has succeeded (fill sparse outputs).
    """

    def __init__(self):
        self.failure = None
        self.after = []
        self.values = None
        self.outs = None

    def finish(self):
        """Runs what follows a successful call."""
        for fn in self.after:
            fn()


def keys_and_entries(key, entries):
    """``[(key, entry)]`` pairs; one key or a list of keys (with a list of entries)."""
    if isinstance(key, (list, tuple)):
        if isinstance(entries, (list, tuple)) and len(entries) == len(key):
            return list(zip(key, entries)), True
        return None, True
    return [(key, entries)], False


def convert(key, values=None, outs=None, *, write_values=False, ignore_sparse=False,
            row_ids=None):
    """Converts a call's NDArrays for the store.

    Anything that is not an NDArray passes through unchanged, for the store's
    own checks; so does a structure that does not pair with the keys.

    Args:
        key: a key or a list of keys.
        values: per key, an NDArray or a list of them (one per device).
        outs: the same structure, written by the call.
        write_values: the call writes its result into ``values`` (``pushpull``
            with no ``out``).
        ignore_sparse: sparse outputs are left as they are (MXNet's ``pull``
            default); else they receive the whole value.
        row_ids: for ``row_sparse_pull``: per output, the rows it keeps.

    Returns:
        :class:`Converted`.
    """
    done = Converted()
    done.values = _convert_all(key, values, write_values, False, done, None, None)
    done.outs = _convert_all(key, outs, True, True, done, ignore_sparse, row_ids)
    return done


def _convert_all(key, entries, writable, is_out, done, ignore_sparse, row_ids):
    if entries is None:
        return None
    pairs, many = keys_and_entries(key, entries)
    if pairs is None:
        return entries
    # row_ids as MXNet takes them: one per key (for a key list), then one per device.
    if many and isinstance(row_ids, (list, tuple)) and len(row_ids) == len(pairs):
        rows_of = list(row_ids)
    else:
        rows_of = [row_ids] * len(pairs)
    converted = [_convert_entry(k, entry, writable, is_out, done, ignore_sparse, rows)
                 for (k, entry), rows in zip(pairs, rows_of)]
    return converted if many else converted[0]


def _convert_entry(key, entry, writable, is_out, done, ignore_sparse, rows):
    from mxnet.ndarray import NDArray
    if isinstance(entry, NDArray):
        return _convert_one(key, entry, writable, is_out, done, ignore_sparse, rows)
    if isinstance(entry, (list, tuple)):
        per_device = rows if isinstance(rows, (list, tuple)) and len(rows) == len(entry) \
            else [rows] * len(entry)
        return [_convert_one(key, e, writable, is_out, done, ignore_sparse, r)
                if isinstance(e, NDArray) else e for e, r in zip(entry, per_device)]
    return entry


def _convert_one(key, nd, writable, is_out, done, ignore_sparse, rows):
    what = f"{'out' if is_out else 'value'} for key {key!r}"
    try:
        reason = problem(nd)
        if reason is None and is_sparse(nd):
            return _sparse(nd, writable, is_out, done, ignore_sparse, rows)
        if reason is None:
            return view(nd, writable)
    except Exception as exc:  # noqa: BLE001 - it must reach every rank, as the call's error
        reason = f"an NDArray that cannot be viewed ({type(exc).__name__}: {exc})"
    if done.failure is None:
        done.failure = (errors.ValueTypeError, f"{what} is {reason}")
    # A stand-in of the right shape and dtype, so the store's own checks add
    # nothing of their own to the error every rank raises.
    return np.zeros(_shape(nd), _dtype(nd))


def _shape(nd):
    try:
        return tuple(nd.shape)
    except Exception:  # noqa: BLE001
        return (0,)


def _dtype(nd):
    try:
        return np.dtype(nd.dtype)
    except Exception:  # noqa: BLE001
        return np.dtype(np.float32)


def _sparse(nd, writable, is_out, done, ignore_sparse, rows):
    """A sparse NDArray: densified as a value; as an output, a scratch array
    copied into it after the call (all rows, or ``rows`` for row_sparse_pull)."""
    if not is_out:
        dense = nd.tostype("default")
        if writable:  # pushpull into a sparse value: the result goes back into it
            scratch = view(dense, True)
            done.after.append(lambda: _fill_sparse(nd, dense, None))
            return scratch
        return view(dense, False)
    scratch = np.zeros(nd.shape, np.dtype(nd.dtype))
    if not ignore_sparse or rows is not None:
        done.after.append(lambda: _fill_sparse(nd, scratch, rows))
    return scratch


def _fill_sparse(out, dense, rows):
    """Writes a dense value into a sparse NDArray: every row, or only ``rows``."""
    import mxnet as mx
    source = dense if isinstance(dense, mx.nd.NDArray) else mx.nd.array(
        dense, ctx=out.context, dtype=dense.dtype)
    if out.stype == "row_sparse":
        sparse = source.tostype("row_sparse")
        if rows is not None:
            sparse = mx.nd.sparse.retain(sparse, rows.as_in_context(out.context)
                                         if isinstance(rows, mx.nd.NDArray) else
                                         mx.nd.array(rows, ctx=out.context, dtype="int64"))
    else:
        sparse = source.tostype(out.stype)
    sparse.copyto(out)
