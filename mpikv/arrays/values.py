"""Host arrays: which values the store takes, which dtypes it holds, float16 summing.

Host (numpy) arrays here; GPU values go through :mod:`mpikv.arrays.backends`.
"""

import numpy as np

from ..dtypes import HALF_DTYPES, VALUE_DTYPES
from ..errors import DTypeError, ValueTypeError

_ACCUMULATE = {dtype: np.dtype("float32") for dtype in HALF_DTYPES}


def accumulate_dtype(dtype):
    """The dtype sums of ``dtype`` are computed and sent in.

    MPI has no half-precision types (Open MPI has no bfloat16 at all), and
    summing in 16 bits loses precision at every step, so float16 and bfloat16
    sums run in float32 and round once at the end.
    """
    return _ACCUMULATE.get(np.dtype(dtype), np.dtype(dtype))


def is_half(dtype):
    """Whether ``dtype`` is a 16-bit float (float16 or bfloat16)."""
    return np.dtype(dtype) in _ACCUMULATE


def wire_view(array):
    """A view MPI can move bit for bit (16-bit floats travel as uint16)."""
    if array.dtype in _ACCUMULATE:
        return array.view(np.uint16)
    return array


def check_dtype(dtype, what="a value"):
    """Raises DTypeError unless the store can hold ``dtype``."""
    # By dtype, not name: a byte-swapped float32 is not a value the store holds.
    if np.dtype(dtype) not in VALUE_DTYPES.values():
        names = ", ".join(VALUE_DTYPES)
        if np.dtype(dtype).name == "bfloat16" or str(dtype) == "bfloat16":
            names += "; bfloat16 needs the ml_dtypes package: pip install mpikv[bf16]"
        raise DTypeError(f"{what} has dtype {np.dtype(dtype)}, which the store cannot hold "
                         f"(use one of {names})")


def as_host_array(value, what, writable=False):
    """Returns a numpy (or, for GPU values, cupy) view of ``value`` without copying.

    Args:
        value: a numpy array, an object with ``__array_interface__``, or a
            torch tensor, cupy array or DLPack producer (see
            :func:`mpikv.arrays.backends.as_native`).
        what: how the error message names the value ("value for key 3").
        writable: whether the store will write into the result.

    Raises:
        ValueTypeError: ``value`` is not an array, or is read-only when
            ``writable``.
    """
    if isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "__array_interface__"):
        array = np.asarray(value)
    else:
        # torch tensors (CPU or CUDA), cupy arrays, DLPack producers: without copies.
        from .backends import as_native
        return as_native(value, writable, what)[1]
    if writable and not array.flags.writeable:
        raise ValueTypeError(f"{what} is read-only")
    return array
