"""The dtypes mpikv takes, by name: a store's values, and what a state file may hold.

The one list of them: a new dtype is one entry in :data:`VALUE_DTYPES`,
which the store, :mod:`mpikv.statefile` and :mod:`mpikv.state.checkpoint` all
read.
"""

import numpy as np


def _bfloat16():
    """ml_dtypes' bfloat16 (numpy has none), or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: numpy's dtype of bfloat16 values (ml_dtypes, the optional ``bf16`` extra), or None
BFLOAT16 = _bfloat16()

#: name -> native numpy dtype of the values a store holds, in the order
#: error messages list them.
VALUE_DTYPES = {
    "float16": np.dtype("float16"), "float32": np.dtype("float32"),
    "float64": np.dtype("float64"), "int32": np.dtype("int32"),
    "int64": np.dtype("int64"),
    **({"bfloat16": BFLOAT16} if BFLOAT16 is not None else {}),
}

#: the 16-bit floats: summed in float32 and rounded once, moved as raw 16 bits
HALF_DTYPES = tuple(VALUE_DTYPES[n] for n in ("float16", "bfloat16") if n in VALUE_DTYPES)


def is_floating(dtype):
    """Whether ``dtype`` is a floating-point dtype (numpy's kind "f", or bfloat16)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (BFLOAT16 is not None and dtype == BFLOAT16)

#: name -> native numpy dtype a state file may hold: the value dtypes, and
#: raw bytes and flags for states that are not values.
FILE_DTYPES = {
    **VALUE_DTYPES,
    "uint8": np.dtype("uint8"), "int8": np.dtype("int8"),
    "bool": np.dtype("bool"),
}


def by_name(name):
    """Returns the value dtype called ``name``, or None if the store does not hold it.

    Args:
        name: A dtype name such as ``"float32"``; anything else (a JSON
            list from a crafted file, say) gives None.
    """
    return VALUE_DTYPES.get(name) if isinstance(name, str) else None
