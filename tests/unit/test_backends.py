"""Array backends: zero-copy views, sums, copies, host staging and the fallback policy.

The cupy cases run only where cupy sees a GPU; the staging order and the
fallback are checked here with a stand-in device module.
"""

import importlib.util
import logging
import sys
import threading

import numpy as np
import pytest

from mpikv import backends, cuda
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


@pytest.mark.skipif(HAVE_GPU or backends._import_cupy() is not None,
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


@pytest.mark.skipif(backends._import_cupy() is not None, reason="needs a machine without cupy")
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


# -- a stand-in for the few cupy calls the Stager makes -------------------------------
class FakeStream:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("sync")


class FakeDevice:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeDeviceModule:
    """``cuda.get_current_stream()``, as cupy has it."""

    def __init__(self, log):
        stream = FakeStream(log)

        class _Cuda:
            @staticmethod
            def get_current_stream():
                return stream
        self.cuda = _Cuda
        self.stream = stream


class FakeDeviceArray:
    """Device memory the host cannot touch: only get(out=) and set() move data."""

    def __init__(self, data, log, module):
        self._data = np.array(data)
        self.log, self.module = log, module
        self.device = FakeDevice()

    dtype = property(lambda self: self._data.dtype)
    size = property(lambda self: self._data.size)
    shape = property(lambda self: self._data.shape)
    ndim = property(lambda self: self._data.ndim)

    def get(self, stream=None, order="C", out=None):
        assert out is not None and out.shape == self.shape and out.dtype == self.dtype
        self.log.append("d2h")
        out[...] = self._data
        return out

    def set(self, arr, stream=None):
        assert stream is self.module.stream, "the copy back must be on the current stream"
        self.log.append("h2d")
        self._data[...] = arr

    def values(self):
        return self._data.tolist()


@pytest.fixture
def fake():
    log = []
    module = FakeDeviceModule(log)
    allocated = []

    def empty_pinned(size, dtype):
        allocated.append((size, np.dtype(dtype)))
        return np.empty(size, dtype)

    stager = backends.Stager(device_module=module, empty_pinned=empty_pinned)

    def device(data):
        return FakeDeviceArray(data, log, module)
    return stager, device, log, allocated


def test_staged_order(fake):
    stager, device, log, _ = fake
    dev = device(np.array([1.0, 2.0, 3.0], np.float32))

    def mpi(host):  # an in-place Allreduce over 2 ranks
        assert isinstance(host, np.ndarray) and host.tolist() == [1, 2, 3]
        log.append("mpi")
        host *= 2
    with stager.staged(dev) as host:
        mpi(host)
    assert log == ["sync", "d2h", "mpi", "h2d", "sync"]
    assert dev.values() == [2, 4, 6]


def test_staged_copy_flags(fake):
    stager, device, log, _ = fake
    dev = device(np.zeros(2, np.int64))
    with stager.staged(dev, copy_in=False) as host:   # a Bcast receiver
        log.append("mpi")
        host[:] = 7
    assert log == ["mpi", "h2d", "sync"] and dev.values() == [7, 7]
    log.clear()
    with stager.staged(dev, copy_back=False) as host:  # a Reduce sender
        log.append("mpi")
        host[:] = 0
    assert log == ["sync", "d2h", "mpi"] and dev.values() == [7, 7]


def test_staged_body_raises(fake):
    stager, device, log, _ = fake
    dev = device(np.ones(2))
    with pytest.raises(RuntimeError):
        with stager.staged(dev) as host:
            host[:] = 5
            raise RuntimeError("MPI failed")
    assert "h2d" not in log and dev.values() == [1, 1]
    assert stager.pooled() == {"float64": [2]}  # the buffer came back


def test_stager_reuses_buffers(fake):
    stager, device, _, allocated = fake
    a = device(np.zeros(8, np.float32))
    for _ in range(3):
        with stager.staged(a):
            pass
    assert allocated == [(8, np.dtype(np.float32))]
    with stager.staged(device(np.zeros(5, np.float32))) as host:  # smaller: same buffer
        assert host.size == 5
    assert stager.allocations == 1
    with stager.staged(device(np.zeros(5, np.float64))):          # another dtype
        pass
    assert stager.allocations == 2
    with stager.staged(device(np.zeros(16, np.float32))):         # bigger: replaces
        pass
    assert stager.pooled() == {"float32": [16], "float64": [5]}


def test_nested_staging_gets_separate_buffers(fake):
    stager, device, _, allocated = fake
    a, b = device(np.ones(4)), device(np.full(4, 2.0))
    with stager.staged(a) as ha, stager.staged(b) as hb:
        assert not np.shares_memory(ha, hb)
        assert ha.tolist() == [1] * 4 and hb.tolist() == [2] * 4
    assert len(allocated) == 2 and stager.pooled() == {"float64": [4, 4]}


def test_to_host_and_to_device(fake):
    stager, device, log, _ = fake
    dev = device(np.array([3, 4], np.int32))
    host = stager.to_host(dev)
    assert host.tolist() == [3, 4] and log == ["sync", "d2h"]
    host += 1
    stager.to_device(host, dev)
    stager.release(host)
    assert dev.values() == [4, 5] and log[2:] == ["h2d", "sync"]


def test_staging_needs_flat_buffers(fake):
    stager, device, _, _ = fake
    with pytest.raises(ValueError, match="flat"):
        with stager.staged(device(np.zeros((2, 2)))):
            pass


def test_default_host_allocator_without_cupy():
    if backends._import_cupy() is not None:
        pytest.skip("cupy is installed: the default is cupyx.empty_pinned")
    stager = backends.Stager(device_module=object())
    buf = stager.acquire(np.float32, 3)
    assert isinstance(buf, np.ndarray) and buf.size == 3 and stager.allocations == 1


# -- the fallback policy --------------------------------------------------------------
class FakeMPIError(Exception):
    """Stands in for mpi4py.MPI.Exception."""


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


@pytest.fixture
def records():
    handler = _Records()
    logger = logging.getLogger("mpikv.gpu")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def _allreduce(log, fail_on_device=0):
    """A fake in-place Allreduce over 2 ranks; raises on the first device buffers."""
    state = {"failures": fail_on_device}

    def fn(buf):
        if not isinstance(buf, np.ndarray):
            if state["failures"]:
                state["failures"] -= 1
                log.append("mpi-device-failed")
                raise FakeMPIError("MPI_ERR_BUFFER: invalid buffer pointer")
            log.append("mpi-device")
            buf._data *= 2
            return "device"
        log.append("mpi-host")
        buf *= 2
        return "host"
    return fn


def test_host_buffer_goes_straight_through(fake):
    stager, _, log, _ = fake
    host = np.ones(2)
    got = backends.device_collective(_allreduce(log), host, True, stager,
                                     fallback=cuda.Fallback(), mpi_errors=(FakeMPIError,))
    assert got == "host" and log == ["mpi-host"] and host.tolist() == [2, 2]


def test_aware_synchronizes_then_passes_the_device_buffer(fake):
    stager, device, log, _ = fake
    dev = device(np.ones(2))
    got = backends.device_collective(_allreduce(log), dev, cuda.Decision(True, "test"), stager,
                                     fallback=cuda.Fallback(), mpi_errors=(FakeMPIError,))
    assert got == "device" and log == ["sync", "mpi-device"] and dev.values() == [2, 2]
    assert stager.allocations == 0


def test_not_aware_stages(fake):
    stager, device, log, _ = fake
    dev = device(np.ones(2))
    got = backends.device_collective(_allreduce(log), dev, False, stager,
                                     fallback=cuda.Fallback(), mpi_errors=(FakeMPIError,))
    assert got == "host" and dev.values() == [2, 2]
    assert log == ["sync", "d2h", "mpi-host", "h2d", "sync"]


def test_mpi_error_falls_back_once_for_good(fake, records):
    stager, device, log, _ = fake
    fb = cuda.Fallback()
    fn = _allreduce(log, fail_on_device=1)
    dev = device(np.ones(2))
    got = backends.device_collective(fn, dev, True, stager, fallback=fb,
                                     mpi_errors=(FakeMPIError,))
    assert got == "host" and dev.values() == [2, 2]
    assert log == ["sync", "mpi-device-failed", "sync", "d2h", "mpi-host", "h2d", "sync"]
    assert fb.happened and "MPI_ERR_BUFFER" in fb.reason
    assert len(records) == 1 and records[0][0] == "WARNING"
    assert "staging device buffers through host memory" in records[0][1]
    assert "MPIKV_CUDA_AWARE=0" in records[0][1]
    # Later calls stage without trying the device buffer again, and log nothing.
    log.clear()
    got = backends.device_collective(fn, dev, True, stager, fallback=fb,
                                     mpi_errors=(FakeMPIError,))
    assert got == "host" and "mpi-device" not in log and len(records) == 1
    assert cuda.describe(cuda.Decision(True, "test"), fb)["device_path"] == "staged"


def test_other_errors_are_not_swallowed(fake):
    stager, device, _, _ = fake
    fb = cuda.Fallback()

    def fn(buf):
        raise ValueError("a bug, not MPI")
    with pytest.raises(ValueError, match="a bug"):
        backends.device_collective(fn, device(np.ones(1)), True, stager, fallback=fb,
                                   mpi_errors=(FakeMPIError,))
    assert not fb.happened


def test_failure_after_fallback_propagates(fake):
    stager, device, _, _ = fake
    fb = cuda.Fallback()

    def fn(buf):
        raise FakeMPIError("MPI_ERR_OTHER")
    with pytest.raises(FakeMPIError):
        backends.device_collective(fn, device(np.ones(1)), True, stager, fallback=fb,
                                   mpi_errors=(FakeMPIError,))
    assert fb.happened


def test_default_errors_come_from_loaded_mpi4py(monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    assert backends._mpi_errors() == ()
    mpi = pytest.importorskip("mpi4py.MPI")
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    assert backends._mpi_errors() == (mpi.Exception,)


# -- handing GPU work to the worker thread (against the CPU stand-in of cupy) ---------
def test_handover_without_gpu_work(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert backends.handover([np.ones(2)], on_gpu=True) is None  # no cupy: no GPU array
    fakecupy.install(monkeypatch)
    assert backends.handover([np.ones(2)]) is None
    assert backends.handover([np.ones(2)], on_gpu=True) is not None


def test_handover_waits_for_the_caller_then_the_worker(monkeypatch):
    cp = fakecupy.install(monkeypatch)
    with cp.cuda.Device(1):
        value = cp.ones(3)
        caller = cp.cuda.get_current_stream()
        gpu = backends.handover([value, np.zeros(3)])
    assert caller.synchronized == 1  # the caller's writers are done before queueing
    seen = {}

    def worker():
        with gpu:
            seen["device"] = cp.cuda.Device().id
            seen["stream"] = cp.cuda.get_current_stream()
            seen["sum"] = (value + 1).get().tolist()  # runs on GPU 1, where value lives
        seen["after"] = cp.cuda.Device().id

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["device"] == 1 and seen["after"] == 0 and seen["sum"] == [2, 2, 2]
    # The worker's own stream (not the default one, whose waits would include
    # the caller's later kernels), waited for before the handle is done.
    assert seen["stream"].non_blocking and seen["stream"] is not caller
    assert seen["stream"].synchronized == 1
    assert not fakecupy.unfinished(value) and fakecupy.races() == []
