"""The dtypes mpikv takes, by name: a store's values, and what a state file may hold.

The one list of them: a new dtype is one entry in :data:`VALUE_DTYPES`,
which the store, :mod:`mpikv.statefile` and :mod:`mpikv.checkpoint` all
read.
"""

import numpy as np

#: name -> native numpy dtype of the values a store holds, in the order
#: error messages list them.
VALUE_DTYPES = {
    "float16": np.dtype("float16"), "float32": np.dtype("float32"),
    "float64": np.dtype("float64"), "int32": np.dtype("int32"),
    "int64": np.dtype("int64"),
}

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
