"""Why ranks may not proceed: the messages every rank raises, built without MPI."""

import numpy as np

from mpikv import errors
from mpikv.agreement import describe, explain, format_ranks
from mpikv.calls import CallReader


def _record(op, keys, shape=(2, 3), dtype="float32", settings=None, lookup=None):
    reader = CallReader(lookup or (lambda k: None), lambda: None)
    values = [np.zeros(shape, dtype) for _ in keys]
    call = reader.read(op, list(keys), values, new_keys=True, need_values=True,
                       settings=settings)
    return describe(call)


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_equal_calls_have_equal_digests_whatever_the_key_order():
    a, ra = _record("init", [1, 2, 3])
    b, rb = _record("init", [3, 1, 2])
    assert a == b
    assert explain([ra, rb]) is None


def test_different_shapes_name_key_and_ranks():
    _, r0 = _record("init", [1, 2])
    _, r1 = _record("init", [1, 2], shape=(3, 2))
    cls, msg = explain([r0, r0, r1])
    assert cls is errors.MismatchError
    assert msg == "init: key 1 has different shapes: (2, 3) on ranks 0-1; (3, 2) on rank 2"


def test_different_dtypes():
    _, r0 = _record("init", ["w"])
    _, r1 = _record("init", ["w"], dtype="float64")
    cls, msg = explain([r0, r1])
    assert cls is errors.MismatchError
    assert msg == "init: key 'w' has different dtypes: float32 on rank 0; float64 on rank 1"


def test_missing_key():
    _, r0 = _record("init", [1, 2])
    _, r1 = _record("init", [1])
    cls, msg = explain([r0, r1, r0])
    assert cls is errors.MismatchError
    assert msg == "init: key 2 was given on ranks 0, 2 but not on rank 1"


def test_different_operations():
    _, r0 = _record("init", [1])
    _, r1 = _record("broadcast", [1])
    cls, msg = explain([r0, r1])
    assert msg == "ranks called different operations: init on rank 0; broadcast on rank 1"


def test_settings_differ():
    d0, r0 = _record("init", [1], settings={"updater": None})
    d1, r1 = _record("init", [1], settings={"updater": "function"})
    assert d0 != d1
    cls, msg = explain([r0, r1])
    assert cls is errors.MismatchError
    assert msg == 'init: ranks differ in updater: null on rank 0; "function" on rank 1'


def test_input_error_on_one_rank_wins_and_keeps_its_class():
    _, ok = _record("init", [1])
    _, bad = _record("init", [1], lookup=lambda k: ((2, 3), np.dtype("float32")))
    cls, msg = explain([ok, bad, bad])
    assert cls is errors.DuplicateInitError
    assert msg.startswith("init: ranks 1-2: key 1 is already initialised")


def test_digest_ignores_error_text():
    reader = CallReader(lambda k: None, lambda: None)
    call = reader.read("push", [1], [None], need_values=True)
    digest, record = describe(call)
    assert record["errors"] and record["errors"][0][0] == "UnknownKeyError"


def test_joined_ranks_take_no_part_in_the_comparison():
    _, r0 = _record("init", [1, 2])
    _, r1 = _record("init", [1])
    _, r2 = _record("init", [1, 2], shape=(3, 2))
    assert explain([None, r0, None, r0]) is None
    assert explain([r0, None]) is None
    assert explain([r0, None, r1]) == (
        errors.MismatchError, "init: key 2 was given on rank 0 but not on rank 2")
    assert explain([None, r0, r2]) == (
        errors.MismatchError,
        "init: key 1 has different shapes: (2, 3) on rank 1; (3, 2) on rank 2")
