"""Tests of mpikv.dtypes: the one list of dtypes, and what reads it."""

import numpy as np
import pytest

from mpikv.state import checkpoint
from mpikv import dtypes, statefile
from mpikv.arrays.values import check_dtype
from mpikv.errors import DTypeError, StateFileError

VALUES = ["float16", "float32", "float64", "int32", "int64"]
# bfloat16 where ml_dtypes (the bf16 extra) is installed; numpy has no name for it.
BF16 = ["bfloat16"] if dtypes.BFLOAT16 is not None else []


def _dtype(name):
    return dtypes.BFLOAT16 if name == "bfloat16" else np.dtype(name)


def test_value_and_file_dtypes():
    assert list(dtypes.VALUE_DTYPES) == VALUES + BF16
    assert list(dtypes.FILE_DTYPES) == VALUES + BF16 + ["uint8", "int8", "bool"]
    for name, dtype in dtypes.FILE_DTYPES.items():
        assert dtype == _dtype(name) and dtype.isnative


def test_floating_and_half_dtypes():
    assert dtypes.is_floating(np.float16) and not dtypes.is_floating(np.int32)
    assert dtypes.HALF_DTYPES == tuple(_dtype(n) for n in ["float16"] + BF16)
    if BF16:
        assert dtypes.is_floating(dtypes.BFLOAT16)


def test_by_name():
    assert dtypes.by_name("float32") == np.dtype(np.float32)
    assert dtypes.by_name("int64") == np.dtype(np.int64)
    # File-only dtypes are not values; names that are not str are nothing.
    for name in ("uint8", "bool", "complex64", "float", ["float32"], None, 4):
        assert dtypes.by_name(name) is None


def test_state_files_hold_the_file_dtypes_little_endian():
    assert list(statefile.DTYPES) == list(dtypes.FILE_DTYPES)
    for name, dtype in statefile.DTYPES.items():
        assert dtype.name == name and dtype.str[0] in "<|"


def test_store_refuses_what_is_not_a_value_dtype():
    for name in VALUES + BF16:
        check_dtype(_dtype(name))
    names = ", ".join(VALUES + BF16)
    for bad in ("uint8", "bool", "complex64", np.dtype(">f4" if np.little_endian else "<f4")):
        with pytest.raises(DTypeError, match=rf"which the store cannot hold \(use one of "
                           rf"{names}\)"):
            check_dtype(bad, "x")


def test_checkpoint_keys_take_value_dtypes_only():
    saved = checkpoint._saved_keys({"keys": [[1, [2, 3], "float16"], [2, [], "int64"]]}, "f")
    assert saved == {1: ((2, 3), np.dtype(np.float16)), 2: ((), np.dtype(np.int64))}
    for bad in ("uint8", "complex64", ["float32"], None):
        with pytest.raises(StateFileError, match=r"'f' is not a valid mpikv save: key entry"):
            checkpoint._saved_keys({"keys": [[1, [2], bad]]}, "f")
