"""The local store: every SPEC row for one process, with values checked."""

import numpy as np
import pytest

import mpikv
from mpikv import errors

SHAPE = (2, 3)


@pytest.fixture(params=["local", "device"])
def kv(request):
    return mpikv.create(request.param)


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

ERROR_CASES = [
    ("pull unknown key", lambda kv: kv.pull(42, out=np.zeros(SHAPE)),
     errors.UnknownKeyError, "key 42 has not been initialised"),
    ("push unknown key", lambda kv: kv.push(42, np.zeros(SHAPE)),
     errors.UnknownKeyError, "key 42"),
    ("duplicate init", lambda kv: kv.init(1, np.zeros(SHAPE)),
     errors.DuplicateInitError, "key 1 is already initialised"),
    ("duplicate broadcast", lambda kv: kv.broadcast(1, np.zeros(SHAPE), out=np.zeros(SHAPE)),
     errors.DuplicateInitError, "key 1"),
    ("wrong push shape", lambda kv: kv.push(1, np.zeros((3, 2))),
     errors.ShapeError, "shape (3, 2), the stored value has shape (2, 3)"),
    ("wrong out shape", lambda kv: kv.pull(1, out=np.zeros(6)),
     errors.ShapeError, "out for key 1"),
    ("wrong push dtype", lambda kv: kv.push(1, np.zeros(SHAPE, np.float32)),
     errors.DTypeError, "dtype float32, the stored value has dtype float64"),
    ("wrong out dtype", lambda kv: kv.pull(1, out=np.zeros(SHAPE, np.int64)),
     errors.DTypeError, "out for key 1"),
    ("unsupported dtype", lambda kv: kv.init(2, np.zeros(3, np.complex64)),
     errors.DTypeError, "complex64"),
    ("non-array value", lambda kv: kv.push(1, [[1, 2, 3], [4, 5, 6]]),
     errors.ValueTypeError, "not an array"),
    ("missing out", lambda kv: kv.pull(1),
     errors.ValueTypeError, "out for key 1 is missing"),
    ("read-only out", lambda kv: kv.pull(1, out=_readonly()),
     errors.ValueTypeError, "read-only"),
    ("device arrays differ", lambda kv: kv.push(1, [np.zeros(SHAPE), np.zeros(6)]),
     errors.ShapeError, "device arrays have different shapes"),
    ("mixed key types in store", lambda kv: kv.init("w", np.zeros(3)),
     errors.KeyTypeError, "mixed key types"),
    ("mixed key types in call", lambda kv: kv.pull([1, "w"], out=[np.zeros(SHAPE)] * 2),
     errors.KeyTypeError, "mixed int and str keys"),
    ("bad key type", lambda kv: kv.pull(1.5, out=np.zeros(SHAPE)),
     errors.KeyTypeError, "keys are int or str"),
    ("bool key", lambda kv: kv.pull(True, out=np.zeros(SHAPE)),
     errors.KeyTypeError, "keys are int or str"),
    ("duplicate key in call", lambda kv: kv.push([1, 1], [np.zeros(SHAPE)] * 2),
     errors.InputError, "appears more than once"),
    ("keys and values differ in length", lambda kv: kv.push([1], [np.zeros(SHAPE)] * 2),
     errors.InputError, "1 keys but 2 value entries"),
    ("empty device list", lambda kv: kv.push(1, []),
     errors.ValueTypeError, "empty list"),
]


def _readonly():
    a = np.zeros(SHAPE)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("name,bad,exc,text", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_leave_store_usable(kv, name, bad, exc, text):
    kv.init(1, np.ones(SHAPE))
    with pytest.raises(exc) as info:
        bad(kv)
    assert isinstance(info.value, mpikv.MPIKVError)
    assert text in str(info.value)
    assert "nothing was applied" in str(info.value)
    assert (_pulled(kv, 1) == 1).all()
    kv.push(1, np.full(SHAPE, 7.0))
    assert (_pulled(kv, 1) == 7).all()


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
