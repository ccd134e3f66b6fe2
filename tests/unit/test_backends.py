"""Array backends: zero-copy views, sums and copies, across host and device.

The cupy cases run on real cupy where it sees a GPU, and always on the CPU
stand-in (tests/fakecupy.py). Staging and the fallback policy are
tests/unit/test_staging.py's.
"""

import importlib.util

import numpy as np
import pytest

from mpikv.arrays import xp as _xp, backends
from mpikv.errors import DTypeError, ValueTypeError

from .. import fakecupy

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_GPU = backends.cupy_available()
NO_GPU = "cupy not installed / no GPU"
NO_TORCH = "torch not installed"


def _torch_cuda():
    if not (HAVE_TORCH and HAVE_GPU):
        return False
    import torch
    return torch.cuda.is_available()


class Backend:
    """Makes arrays of one backend from numpy data and reads them back."""

    def __init__(self, name):
        self.name = name
        self.kind = {"numpy": "numpy", "torch": "torch-cpu", "cupy": "cupy",
                     "stand-in": "cupy", "torch-cuda": "torch-cuda"}[name]
        self.native = "cupy" if name in ("cupy", "stand-in", "torch-cuda") else "numpy"

    def make(self, data):
        data = np.array(data)
        if self.name == "numpy":
            return data
        if self.name == "torch":
            import torch
            return torch.from_numpy(data)
        if self.name == "torch-cuda":
            import torch
            return torch.from_numpy(data).cuda()
        import cupy
        return cupy.asarray(data)

    def read(self, value):
        if self.name == "numpy":
            return np.array(value)
        if self.name in ("torch", "torch-cuda"):
            return value.detach().cpu().numpy().copy()
        return value.get()


@pytest.fixture(params=["numpy", "torch", "cupy", "stand-in", "torch-cuda"])
def backend(request, monkeypatch):
    """"stand-in" is tests/fakecupy.py: cupy's rules on the CPU, no CUDA."""
    name = request.param
    if name == "torch" and not HAVE_TORCH:
        pytest.skip(NO_TORCH)
    if name == "cupy" and not HAVE_GPU:
        pytest.skip(NO_GPU)
    if name == "stand-in":
        fakecupy.install(monkeypatch)
    if name == "torch-cuda" and not _torch_cuda():
        pytest.skip("torch with CUDA and cupy with a GPU needed")
    return Backend(name)


# -- detection and views -----------------------------------------------------
def test_array_module(backend):
    assert backends.array_module(backend.make([1.0, 2.0])) == backend.kind
    assert backends.native_kind(backend.make([1.0])) == backend.native


@pytest.mark.parametrize("value", [None, 3, 2.5, "abc", [1, 2], (1.0,), object()])
def test_array_module_of_non_arrays(value):
    assert backends.array_module(value) is None
    with pytest.raises(ValueTypeError, match=r"value for key 3 is a \w+, not an array"):
        backends.as_native(value, what="value for key 3")


def test_zero_copy_writes_through(backend):
    original = backend.make(np.arange(6, dtype=np.float32).reshape(2, 3))
    kind, array = backends.as_native(original, writable=True)
    assert kind == backend.native
    assert array.shape == (2, 3) and array.dtype == np.float32
    array[1, 2] = 42.0
    array[0] += 1
    assert backend.read(original).tolist() == [[1, 2, 3], [3, 4, 42]]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_dtypes_kept(backend, dtype):
    original = backend.make(np.arange(5).astype(dtype))
    _, array = backends.as_native(original)
    assert array.dtype == np.dtype(dtype)
    assert backends.xp(backend.native).asarray(array).tolist() == list(range(5))


def test_numpy_view_is_the_array():
    a = np.zeros(3)
    assert backends.as_native(a, writable=True) == ("numpy", a)


def test_read_only_numpy():
    a = np.zeros(3)
    a.flags.writeable = False
    assert backends.as_native(a)[1] is a
    with pytest.raises(ValueTypeError, match="out for key 'w' is read-only"):
        backends.as_native(a, writable=True, what="out for key 'w'")


class _ArrayInterfaceOnly:
    def __init__(self, array):
        self.__array_interface__ = array.__array_interface__
        self._keep = array


class _DLPackOnly:
    """A CPU producer with only the DLPack protocol."""

    def __init__(self, array, device=(backends.DLPACK_CPU, 0)):
        self._array, self._device = array, device

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


def test_array_interface_object_zero_copy():
    base = np.zeros(4, np.int64)
    kind, view = backends.as_native(_ArrayInterfaceOnly(base), writable=True)
    assert backends.array_module(_ArrayInterfaceOnly(base)) == "numpy"
    view[2] = 9
    assert kind == "numpy" and base.tolist() == [0, 0, 9, 0]


def test_dlpack_cpu_object_zero_copy():
    base = np.zeros(4, np.float64)
    value = _DLPackOnly(base)
    assert backends.array_module(value) == "numpy"
    kind, view = backends.as_native(value)
    assert kind == "numpy" and np.shares_memory(view, base)


@pytest.mark.parametrize("device_type,want", [(1, "numpy"), (3, "numpy"), (2, "cupy"),
                                              (13, "cupy"), (10, None), (4, None)])
def test_dlpack_device_types(device_type, want):
    assert backends.array_module(_DLPackOnly(np.zeros(1), (device_type, 0))) == want


def test_unknown_dlpack_device_message():
    with pytest.raises(ValueTypeError, match=r"on DLPack device \(10, 0\)"):
        backends.as_native(_DLPackOnly(np.zeros(1), (10, 0)))


class _FakeCudaArray:
    """Looks like a CUDA array from some other library (numba, for one)."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


@pytest.mark.skipif(HAVE_GPU or _xp.import_cupy() is not None,
                    reason="needs a machine without cupy")
@pytest.mark.parametrize("value", [_FakeCudaArray(), _DLPackOnly(np.zeros(1), (2, 0))])
def test_cuda_array_without_cupy(value):
    assert backends.array_module(value) == "cupy"
    with pytest.raises(ValueTypeError, match=r"cupy is not installed.*install mpikv\[cuda12\]"):
        backends.as_native(value, what="value for key 0")


@pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)
def test_torch_parameter_requiring_grad_is_viewed():
    import torch
    p = torch.nn.Parameter(torch.zeros(3))
    assert backends.array_module(p) == "torch-cpu"
    _, view = backends.as_native(p, writable=True)
    view[:] = 5
    assert p.detach().tolist() == [5, 5, 5]


@pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)
def test_torch_non_contiguous_is_a_view():
    import torch
    t = torch.zeros(3, 4)
    col = t[:, 1]
    _, view = backends.as_native(col, writable=True)
    view[:] = 7
    assert t[:, 1].tolist() == [7, 7, 7] and t.sum().item() == 21


@pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)
def test_torch_bfloat16_is_viewed_as_ml_dtypes_bfloat16_without_a_copy():
    import torch
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    _, view = backends.as_native(t, writable=True)
    assert view.dtype == np.dtype(ml_dtypes.bfloat16)
    assert view.astype(np.float32).tolist() == [1.5, -2.0, 3.25]
    view[1] = 7
    assert t.tolist() == [1.5, 7.0, 3.25]   # the same memory


@pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)
def test_torch_bfloat16_without_ml_dtypes_names_the_package(monkeypatch):
    import torch
    from mpikv import dtypes
    monkeypatch.setattr(dtypes, "BFLOAT16", None)
    with pytest.raises(DTypeError, match=r"bfloat16, which needs the ml_dtypes package "
                                         r"\(pip install mpikv\[bf16\]\)"):
        backends.as_native(torch.zeros(2, dtype=torch.bfloat16))


@pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)
def test_torch_meta_device_refused():
    import torch
    t = torch.empty(2, device="meta")
    assert backends.array_module(t) is None
    with pytest.raises(ValueTypeError, match="torch tensor on device 'meta'"):
        backends.as_native(t)


def test_torch_is_not_imported_for_detection(monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert backends.array_module(np.zeros(1)) == "numpy"
    assert "torch" not in sys.modules


# -- modules and allocation ------------------------------------------------------
def test_xp():
    assert backends.xp("numpy") is np and backends.xp("torch-cpu") is np
    with pytest.raises(ValueError, match="unknown array kind 'jax'"):
        backends.xp("jax")


@pytest.mark.skipif(_xp.import_cupy() is not None, reason="needs a machine without cupy")
def test_xp_cupy_missing():
    with pytest.raises(ImportError, match=r"mpikv\[cuda12\]"):
        backends.xp("cupy")
    assert backends.cupy_available() is False


def test_empty_and_zeros(backend):
    a = backends.empty(backend.native, 5, np.float32)
    z = backends.zeros(backend.native, 5, np.int64)
    assert a.shape == (5,) and a.dtype == np.float32
    assert backends.native_kind(a) == backend.native
    assert backends.xp(backend.native).asarray(z).tolist() == [0] * 5


def test_numpy_has_no_device():
    with pytest.raises(ValueError, match="host"):
        backends.empty("numpy", 2, np.float32, device=0)


# -- sums and copies ----------------------------------------------------------------
def _native(backend, data, dtype):
    return backends.as_native(backend.make(np.asarray(data, dtype)))[1]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_sum_into(backend, dtype):
    arrays = [_native(backend, np.full((2, 2), i + 1), dtype) for i in range(3)]
    out = backends.empty(backend.native, 4, dtype)
    backends.sum_into(out, arrays)
    assert backends.xp(backend.native).asarray(out).tolist() == [6] * 4


def test_sum_float16_in_float32(backend):
    # float16 steps by 2 at 2048: summed in float16, 2048 + 1 + 1 stays 2048.
    arrays = [_native(backend, [2048.0], "float16"), _native(backend, [1.0], "float16"),
              _native(backend, [1.0], "float16")]
    wide = backends.empty(backend.native, 1, np.float32)
    backends.sum_into(wide, arrays)
    assert float(wide[0]) == 2050.0
    narrow = backends.empty(backend.native, 1, np.float16)
    backends.sum_into(narrow, arrays)
    assert narrow.dtype == np.float16 and float(narrow[0]) == 2050.0


def test_sum_into_single_value_casts(backend):
    out = backends.empty(backend.native, 3, np.float32)
    backends.sum_into(out, [_native(backend, [1, 2, 3], "float16")])
    assert backends.xp(backend.native).asarray(out).tolist() == [1, 2, 3]


def test_copyto_host():
    dst = np.zeros(3, np.float32)
    backends.copyto(dst, np.array([1, 2, 3], np.float64), casting="unsafe")
    assert dst.tolist() == [1, 2, 3]
    with pytest.raises(TypeError):
        backends.copyto(np.zeros(3, np.int32), np.ones(3, np.float64))


@pytest.fixture(params=["cupy", "stand-in"])
def cp(request, monkeypatch):
    """Real cupy on a GPU, or the CPU stand-in (tests/fakecupy.py)."""
    if request.param == "stand-in":
        return fakecupy.install(monkeypatch)
    if not HAVE_GPU:
        pytest.skip(NO_GPU)
    import cupy
    return cupy


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_copyto_across(cp, direction, contiguous):
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    dst = np.zeros((2, 3), np.float32) if contiguous else np.zeros((2, 6), np.float32)[:, ::2]
    if direction in ("h2d", "d2d"):
        dst = cp.asarray(dst) if contiguous else cp.zeros((2, 6), cp.float32)[:, ::2]
    if direction in ("d2h", "d2d"):
        src = cp.asarray(src)
    backends.copyto(dst, src)
    got = dst.get() if isinstance(dst, cp.ndarray) else dst
    assert got.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_sum_into_mixed_host_and_device(cp):
    out = cp.empty(2, cp.float32)
    backends.sum_into(out, [np.ones(2, np.float32), cp.full(2, 2, cp.float32)])
    assert out.get().tolist() == [3, 3]
    host = np.empty(2, np.float32)
    backends.sum_into(host, [np.ones(2, np.float32), cp.full(2, 2, cp.float32)])
    assert host.tolist() == [3, 3]


def test_synchronize_host_is_noop():
    assert backends.synchronize(np.zeros(2)) is None


def test_synchronize_device(cp):
    a = cp.arange(10) * 2
    backends.synchronize(a)
    assert int(a.sum()) == 90


# -- issue 26: copies between GPUs, overlaps of device views ---------------------------
def _two_gpus(cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")


def _written_late_on_gpu1(cp, value, n=4):
    """An array on GPU 1 whose writing kernel is still queued on GPU 1's stream."""
    with cp.cuda.Device(1):
        a = cp.zeros(n, cp.float32)
        a += value   # a kernel nobody has waited for
    return a


@pytest.mark.parametrize("how", ["sum_into", "copyto", "peer_copy"])
def test_copies_from_another_gpu_come_after_its_writers(cp, how):
    # cupy queues a peer copy on the destination's stream only: without an event
    # recorded on the source GPU's stream it may read the value before its writer ran.
    _two_gpus(cp)
    src = _written_late_on_gpu1(cp, 3)
    with cp.cuda.Device(0):
        out = cp.zeros(4, cp.float32)
        if how == "sum_into":
            backends.sum_into(out, [cp.ones(4, cp.float32), src])
            want = 4
        elif how == "copyto":
            backends.copyto(out, src)
            want = 3
        else:
            out = backends.peer_copy(src)
            want = 3
        assert out.device.id == 0
        assert out.get().tolist() == [want] * 4
    if getattr(cp, "STAND_IN", False):
        assert fakecupy.races() == []


def test_device_views_overlap_by_memory_range(cp):
    a = cp.zeros(10, cp.float32)
    assert backends.may_overlap(a[:4], a[2:6]) and backends.may_overlap(a, a[3:4])
    assert not backends.may_overlap(a[:4], a[4:8])
    assert backends.may_overlap(a[::2], a[1::2])   # interleaved: bounds overlap, as numpy says
    assert backends.may_overlap(a.reshape(2, 5)[:, 1], a[5:7])
    assert not backends.may_overlap(a[:0], a)
    assert not backends.may_overlap(a, np.zeros(10, np.float32))
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            b = cp.zeros(10, cp.float32)
        assert not backends.may_overlap(a, b) or a.data.ptr == b.data.ptr
