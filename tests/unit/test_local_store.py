"""The local store: every SPEC row for one process, with values checked."""

import numpy as np
import pytest

import mpikv
from mpikv import errors
from tests import error_cases

SHAPE = (2, 3)


@pytest.fixture(params=["local", "device"])
def kv(request, make_store):
    return make_store(request.param)


def _pulled(kv, key, shape=SHAPE, dtype=np.float64):
    out = np.zeros(shape, dtype)
    kv.pull(key, out=out)
    return out


def test_create_and_properties():
    kv = mpikv.create("local")
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
    assert mpikv.create("LOCAL").type == "local"
    with pytest.raises(TypeError):
        mpikv.create(3)
    with pytest.raises(ValueError, match="dist_sync"):
        mpikv.create("dist_async")
    with pytest.raises(ValueError, match="communicator"):
        mpikv.create("local", comm=object())
    with pytest.raises(ValueError, match="timeout"):
        mpikv.create("local", timeout="soon")
    assert kv.describe() == {"transport": "LocalTransport", "rank": 0, "size": 1}


def test_seed_tutorial_values(kv, capsys):
    kv.init(3, np.ones(SHAPE) * 2)
    assert (_pulled(kv, 3) == 2).all()
    kv.push(3, np.ones(SHAPE) * 8)
    assert (_pulled(kv, 3) == 8).all()
    kv.push(3, [np.ones(SHAPE)] * 4)
    assert (_pulled(kv, 3) == 4).all()

    def update(key, value, stored):
        print(f"update on key: {key}")
        stored += value * 2

    kv._set_updater(update)
    assert (_pulled(kv, 3) == 4).all()
    kv.push(3, np.ones(SHAPE))
    assert capsys.readouterr().out == "update on key: 3\n"
    b = [np.zeros(SHAPE) for _ in range(4)]
    kv.pull(3, out=b)
    assert all((x == 6).all() for x in b)

    keys = [5, 7, 9]
    kv.init(keys, [np.ones(SHAPE)] * 3)
    kv.push(keys, [np.ones(SHAPE)] * 3)
    b = [[np.zeros(SHAPE) for _ in range(4)] for _ in keys]
    kv.pull(keys, out=b)
    assert all((x == 3).all() for row in b for x in row)
    kv.push(keys, [[np.ones(SHAPE)] * 4] * 3)
    kv.pull(keys, out=b)
    assert all((x == 11).all() for row in b for x in row)


def test_default_updater_assigns_not_accumulates(kv):
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.ones(4, np.float32))
    kv.push("w", np.full(4, 3, np.float32))
    assert (_pulled(kv, "w", (4,), np.float32) == 3).all()


def test_store_keeps_its_own_copy(kv):
    v = np.ones(SHAPE)
    kv.init(1, v)
    v[:] = 5
    assert (_pulled(kv, 1) == 1).all()
    g = np.full(SHAPE, 2.0)
    kv.push(1, g)
    g[:] = 9
    assert (_pulled(kv, 1) == 2).all()


def test_pushpull_and_broadcast(kv):
    kv.init(0, np.zeros(SHAPE))
    v = np.ones(SHAPE) * 5
    kv.pushpull(0, v)
    assert (v == 5).all()
    out = [np.zeros(SHAPE), np.zeros(SHAPE)]
    kv.pushpull(0, [np.ones(SHAPE), np.ones(SHAPE)], out=out)
    assert all((o == 2).all() for o in out)
    outs = [np.zeros(SHAPE) for _ in range(3)]
    kv.broadcast(11, np.ones(SHAPE) * 9, out=outs)
    assert all((o == 9).all() for o in outs)
    kv.broadcast([12, 13], [np.ones(2), np.ones(3)], out=[np.zeros(2), np.zeros(3)])
    assert (_pulled(kv, 13, (3,)) == 1).all()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_dtypes_kept(kv, dtype):
    kv.init("x", np.zeros(5, dtype))
    kv.push("x", [np.arange(5, dtype=dtype)] * 3)
    out = np.zeros(5, dtype)
    kv.pull("x", out=out)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, np.arange(5, dtype=dtype) * 3)


def test_float16_sums_in_float32(kv):
    kv.init(1, np.zeros(1, np.float16))
    kv.push(1, [np.full(1, 2048, np.float16), np.ones(1, np.float16), np.ones(1, np.float16)])
    out = np.zeros(1, np.float16)
    kv.pull(1, out=out)
    # Summed in float16 this would be 2048 (2048 + 1 rounds back down).
    assert out[0] == 2050


def test_values_as_array_interface(kv):
    class Wrapped:
        def __init__(self, a):
            self.__array_interface__ = a.__array_interface__
            self._a = a
    kv.init(1, Wrapped(np.full(3, 4.0)))
    dst = np.zeros(3)
    kv.pull(1, out=Wrapped(dst))
    assert (dst == 4).all()


def test_torch_cpu_tensors(kv):
    torch = pytest.importorskip("torch")
    kv.init(1, torch.ones(3))
    kv.push(1, [torch.ones(3), torch.ones(3)])
    out = torch.zeros(3)
    kv.pull(1, out=out)
    assert out.tolist() == [2.0, 2.0, 2.0]


# -- errors: each is an MPIKVError, and the store stays usable -----------------

@pytest.mark.parametrize("case", error_cases.CASES, ids=[c.name for c in error_cases.CASES])
def test_errors_leave_store_usable(kv, case):
    """Every case of tests/error_cases.py: the error, nothing applied, the store still works."""
    if case.min_ranks > 1:
        pytest.skip(f"needs {case.min_ranks} ranks: its bad input is a difference between ranks")
    held = case.setup(kv)
    with pytest.raises(case.error) as info:
        case.call(kv, True)
    error_cases.check_error(case, info.value)
    if case.after is not None:
        case.after(kv)
    error_cases.held_values(kv, held)
    error_cases.still_works(kv, held)


def test_failed_multi_key_call_applies_nothing(kv):
    kv.init([1, 2], [np.ones(3), np.ones(3)])
    with pytest.raises(errors.ShapeError):
        kv.push([1, 2], [np.full(3, 5.0), np.zeros(4)])
    out = [np.zeros(3), np.zeros(3)]
    kv.pull([1, 2], out=out)
    assert all((o == 1).all() for o in out)


def test_updater_must_be_callable(kv):
    with pytest.raises(TypeError):
        kv.set_updater(3)


def test_the_store_class_is_a_public_name(make_store):
    import mpikv
    kv = make_store()
    assert isinstance(kv, mpikv.KVStore) and "KVStore" in mpikv.__all__
    with pytest.raises(AttributeError, match="no attribute 'KVStor'"):
        mpikv.KVStor
