"""Array backends: numpy on the host, cupy on CUDA GPUs, and views without copies.

A value a user passes (numpy array, CPU or CUDA torch tensor, cupy array,
anything with ``__array_interface__``, ``__cuda_array_interface__`` or
DLPack) is turned into a *native* array that shares its memory: a numpy
array on the host, a cupy array on a GPU. The store works on native arrays
only; :func:`xp` gives the module that operates on them, and the functions
here (allocation, sums, concatenation, copies across host and device) run
in either.

How device buffers reach MPI (synchronisation, host staging for a library
that is not CUDA-aware, the fallback) is :mod:`mpikv.transport.staging`'s; see
``docs/gpu.md``.

Nothing here imports cupy or torch unless the value in hand needs it.
"""

import contextlib
import sys

import numpy as np

from . import halfbits
from .xp import (CUPY, INSTALL_HINT, KINDS, NATIVE, NUMPY, contiguous, import_cupy, module_of, on, xp)
from ..dtypes import HALF_DTYPES
from ..errors import DTypeError, ValueTypeError

# DLPack device types (dlpack.h DLDeviceType).
DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_CUDA_HOST = 3      # pinned host memory: numpy can read it
DLPACK_CUDA_MANAGED = 13  # unified memory: cupy can wrap it
_DLPACK_KIND = {DLPACK_CPU: "numpy", DLPACK_CUDA_HOST: "numpy",
                DLPACK_CUDA: "cupy", DLPACK_CUDA_MANAGED: "cupy"}


# -- modules -------------------------------------------------------------
def cupy_available():
    """Whether cupy imports and sees at least one GPU."""
    cp = import_cupy()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


# -- what a value is -----------------------------------------------------
def _has(value, name):
    # hasattr() lets anything but AttributeError through, and torch raises
    # RuntimeError for __cuda_array_interface__ on a tensor that requires grad.
    try:
        getattr(value, name)
    except Exception:
        return False
    return True


def _torch_tensor(value):
    torch = sys.modules.get("torch")  # a tensor exists only if torch is loaded
    return torch is not None and isinstance(value, torch.Tensor)


def array_module(value):
    """Which backend ``value`` belongs to, without copying or importing anything.

    Args:
        value: any object.

    Returns:
        "numpy", "cupy", "torch-cpu", "torch-cuda", or None when it is not an
        array mpikv can use. Non-cupy CUDA arrays (``__cuda_array_interface__``
        or a CUDA DLPack device) are "cupy": cupy wraps them. Other CPU
        arrays (``__array_interface__`` or a CPU DLPack device) are "numpy".
    """
    if isinstance(value, np.ndarray):
        return NUMPY
    if _torch_tensor(value):
        return {"cpu": "torch-cpu", "cuda": "torch-cuda"}.get(value.device.type)
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(value, cp.ndarray):
        return CUPY
    if _has(value, "__cuda_array_interface__"):
        return CUPY
    if _has(value, "__dlpack__") and _has(value, "__dlpack_device__"):
        try:
            device_type = int(value.__dlpack_device__()[0])
        except Exception:
            return None
        return _DLPACK_KIND.get(device_type)
    if _has(value, "__array_interface__"):
        return NUMPY
    return None


def native_kind(array):
    """"numpy" or "cupy" for a native array (or any value :func:`array_module` knows), else None."""
    return NATIVE.get(array_module(array))


def is_device(array):
    """Whether ``array`` lives in GPU memory."""
    return native_kind(array) == CUPY


def as_native(value, writable=False, what="a value"):
    """Returns ``(kind, array)``: a numpy or cupy array sharing ``value``'s memory.

    Args:
        value: a numpy or cupy array, a CPU or CUDA torch tensor, or an object
            with ``__array_interface__``, ``__cuda_array_interface__`` or
            ``__dlpack__``/``__dlpack_device__``.
        writable: whether the store will write into the result.
        what: how messages name the value ("value for key 3").

    Returns:
        ``("numpy", numpy.ndarray)`` or ``("cupy", cupy.ndarray)``; writes
        through the array show in ``value``.

    Raises:
        ValueTypeError: not an array, on a device mpikv cannot use, needing
            cupy when it is missing, not viewable without a copy, or
            read-only when ``writable``.
    """
    kind = array_module(value)
    if kind is None:
        if _torch_tensor(value):
            raise ValueTypeError(f"{what} is a torch tensor on device {str(value.device)!r}; "
                                 f"mpikv takes CPU and CUDA tensors")
        if _has(value, "__dlpack_device__"):
            raise ValueTypeError(f"{what} is a {type(value).__name__} on DLPack device "
                                 f"{_safe_device(value)}; mpikv takes CPU and CUDA arrays")
        raise ValueTypeError(f"{what} is a {type(value).__name__}, not an array")
    if NATIVE[kind] == NUMPY:
        array = _host_view(value, kind, what)
        if writable and not array.flags.writeable:
            raise ValueTypeError(f"{what} is read-only")
        return NUMPY, array
    # cupy arrays have no read-only flag, so `writable` needs no check here.
    return CUPY, _device_view(value, kind, what)


def _safe_device(value):
    try:
        return tuple(value.__dlpack_device__())
    except Exception as exc:
        return f"(unknown: {exc})"


def _host_view(value, kind, what):
    if kind == "torch-cpu" and str(value.dtype) == "torch.bfloat16":
        return _bfloat16_view(value.detach(), what)
    try:
        if isinstance(value, np.ndarray):
            return value
        if kind == "torch-cpu":
            # detach() shares storage (a parameter requires grad; numpy() refuses those).
            return value.detach().numpy()
        if _has(value, "__array_interface__"):
            return np.asarray(value)
        return np.from_dlpack(value)
    except (BufferError, TypeError, RuntimeError, ValueError) as exc:
        if "bfloat16" in str(getattr(value, "dtype", "")).lower():
            raise DTypeError(f"{what} is bfloat16 in a form numpy cannot view "
                             f"(a torch tensor or an ml_dtypes array can be)") from None
        raise ValueTypeError(f"{what} cannot be viewed on the host without a copy: {exc}") from None


def _bfloat16_view(tensor, what):
    """A numpy bfloat16 (ml_dtypes) view of a CPU torch bfloat16 tensor: the same memory."""
    from ..dtypes import BFLOAT16
    if BFLOAT16 is None:
        raise DTypeError(f"{what} is bfloat16, which needs the ml_dtypes package "
                         f"(pip install mpikv[bf16])")
    import torch
    # numpy has no bfloat16: the bits go through as int16, then get their dtype back.
    return tensor.view(torch.int16).numpy().view(BFLOAT16)


def _device_view(value, kind, what):
    cp = import_cupy()
    if cp is None:
        raise ValueTypeError(f"{what} is a CUDA array ({type(value).__name__}) but cupy is not "
                             f"installed or cannot load: {INSTALL_HINT}")
    if isinstance(value, cp.ndarray):
        return value
    if kind == "torch-cuda" and str(value.dtype) == "torch.bfloat16":
        return _device_bfloat16_view(cp, value.detach(), what)
    try:
        if kind == "torch-cuda":
            source = value.detach()
            # DLPack lets torch order its stream before cupy's; the interface
            # is the fallback for cupy releases without from_dlpack.
            if hasattr(cp, "from_dlpack"):
                return cp.from_dlpack(source)
            return cp.asarray(source)
        if _has(value, "__cuda_array_interface__"):
            return cp.asarray(value)
        return cp.from_dlpack(value)
    except (BufferError, TypeError, RuntimeError, ValueError) as exc:
        if "bfloat16" in str(getattr(value, "dtype", "")).lower():
            raise DTypeError(f"{what} is a bfloat16 GPU array that cupy cannot view "
                             f"({exc}); pass a CUDA torch tensor or a cupy array") from None
        raise ValueTypeError(f"{what} cannot be viewed by cupy without a copy: {exc}") from None


def cupy_has_bfloat16(cp):
    """Whether ``cp`` can hold arrays of ml_dtypes' bfloat16 (cupy 14 and later, with
    ml_dtypes installed). mpikv runs no bfloat16 kernel: see :mod:`mpikv.arrays.halfbits`."""
    from ..dtypes import BFLOAT16
    if BFLOAT16 is None:
        return False
    try:
        cp.empty(0, BFLOAT16)
    except Exception:  # cupy before 14 refuses the dtype
        return False
    return True


def _device_bfloat16_view(cp, tensor, what):
    """A cupy bfloat16 view of a CUDA torch bfloat16 tensor: the same memory."""
    if not cupy_has_bfloat16(cp):
        raise DTypeError(f"{what} is a bfloat16 GPU tensor, which needs cupy 14 or later "
                         f"and the ml_dtypes package (pip install mpikv[bf16] cupy-cuda12x>=14)")
    import torch
    from ..dtypes import BFLOAT16
    # The bits go through DLPack as int16 (older cupy cannot import bfloat16 DLPack);
    # DLPack still orders torch's stream before cupy's.
    return cp.from_dlpack(tensor.view(torch.int16)).view(BFLOAT16)


# -- arrays --------------------------------------------------------------
def _device_context(cp, device):
    if device is None:
        return contextlib.nullcontext()
    if isinstance(device, int):
        return cp.cuda.Device(device)
    return device  # a cupy.cuda.Device is its own context manager


def empty(kind, size, dtype, device=None):
    """A new flat array of ``size`` elements, uninitialised.

    Args:
        kind: "numpy" or "cupy" (or a kind of :data:`KINDS`).
        size: number of elements.
        dtype: its dtype.
        device: for cupy, a GPU id or ``cupy.cuda.Device`` (default: the
            current one); must be None for numpy.
    """
    return _make("empty", kind, size, dtype, device)


def zeros(kind, size, dtype, device=None):
    """As :func:`empty`, filled with zeros (a memset: no kernel of ``dtype`` runs)."""
    return _make("zeros", kind, size, dtype, device)


def _make(how, kind, size, dtype, device):
    mod = xp(kind)
    if mod is np:
        if device not in (None, "cpu"):
            raise ValueError(f"numpy arrays live on the host, not on device {device!r}")
        return getattr(np, how)(size, dtype)
    with _device_context(mod, device):
        return getattr(mod, how)(size, dtype)


def _same_gpu(a, b):
    return a.device.id == b.device.id


def sum_into(out, arrays):
    """Writes the sum of same-shaped arrays into the flat array ``out``, in ``out``'s backend.

    The sum runs where ``out`` lives: on its GPU for a cupy ``out`` (host or
    other-GPU inputs are copied there first), on the host for numpy (device
    inputs are copied down). A float16 or bfloat16 ``out`` is summed in
    float32 and rounded once, as :mod:`mpikv.arrays.values` does.

    Args:
        out: a flat numpy or cupy array.
        arrays: arrays with ``out.size`` elements each.
    """
    mod = np if isinstance(out, np.ndarray) else xp(CUPY)
    if out.dtype in HALF_DTYPES and len(arrays) > 1:
        wide = mod.empty(out.size, np.float32) if mod is np else _empty_like_on(mod, out, np.float32)
        sum_into(wide, arrays)
        copyto(out, wide, casting="unsafe")
        return
    if mod is np:
        host = [_to_host_array(a) for a in arrays]
        np.copyto(out, host[0].reshape(-1), casting="unsafe")
        for other in host[1:]:
            np.add(out, other.reshape(-1), out=out, casting="unsafe")
        return
    with out.device:
        uploaded = False
        inputs = []
        for a in arrays:
            if isinstance(a, mod.ndarray):
                # cupy kernels need every operand on the current GPU.
                inputs.append(a if _same_gpu(a, out) else peer_copy(a))
            else:
                inputs.append(mod.asarray(a))
                uploaded = True
        _copy_on_gpu(mod, out, inputs[0].reshape(-1), "unsafe")
        for other in inputs[1:]:
            other = other.reshape(-1)
            if halfbits.is_bfloat16(other.dtype):  # no bfloat16 kernel runs: widen it first
                other = halfbits.astype(other, out.dtype)
            mod.add(out, other, out=out, casting="unsafe")
        if uploaded:
            # Host-to-device copies may still read the caller's arrays, which
            # the caller may change as soon as we return.
            mod.cuda.get_current_stream().synchronize()


def concatenate_into(out, arrays):
    """Writes the flattened ``arrays`` one after another into ``out`` in one call.

    One C call (numpy) or one kernel (cupy) for a whole bucket instead of a
    copy per key. Done only when every array is where ``out`` is (the host,
    or ``out``'s GPU) and has its dtype.

    Returns:
        Whether it was done; if not, nothing was written.
    """
    if type(out) is np.ndarray:
        if not all(type(a) is np.ndarray and a.dtype == out.dtype for a in arrays):
            return False
        np.concatenate(arrays, axis=None, out=out)
        return True
    cp = sys.modules.get("cupy")
    device = out.device.id
    if cp is None or not all(isinstance(a, cp.ndarray) and a.dtype == out.dtype
                             and a.device.id == device for a in arrays):
        return False
    with out.device:
        if halfbits.is_bfloat16(out.dtype):  # bits, not values: no bfloat16 kernel runs
            out, arrays = out.view(np.uint16), [a.view(np.uint16) for a in arrays]
        cp.concatenate(arrays, axis=None, out=out)
    return True


def _empty_like_on(mod, like, dtype):
    with like.device:
        return mod.empty(like.size, dtype)


def _to_host_array(a):
    if isinstance(a, np.ndarray):
        return a
    if native_kind(a) == CUPY:
        return a.get()  # synchronous copy to a new host array
    return np.asarray(a)


def copyto(dst, src, casting="same_kind"):
    """Copies ``src`` into ``dst``, across host and device as needed.

    Returns when the copy is complete, so either array may be reused at once.

    Args:
        dst: a numpy or cupy array.
        src: a numpy or cupy array of a shape that broadcasts to ``dst``'s.
        casting: as for ``numpy.copyto``.
    """
    dst_dev, src_dev = is_device(dst), is_device(src)
    if not dst_dev and not src_dev:
        np.copyto(dst, src, casting=casting)
        return
    cp = xp(CUPY)
    plain = (dst.shape == src.shape and dst.dtype == src.dtype and contiguous(dst)
             and contiguous(src))
    if dst_dev and src_dev:
        with dst.device:
            _copy_on_gpu(cp, dst, src if _same_gpu(dst, src) else peer_copy(src), casting)
        return
    if src_dev:  # device -> host
        with src.device:
            cp.cuda.get_current_stream().synchronize()  # src's writers have finished
            if plain:
                src.get(out=dst)
            else:
                np.copyto(dst, src.get(), casting=casting)
        return
    if src.dtype != dst.dtype and (halfbits.is_bfloat16(src.dtype)
                                   or halfbits.is_bfloat16(dst.dtype)):
        # ml_dtypes casts on the host; the device gets the result's bits.
        src = np.asarray(src).astype(dst.dtype)
        plain = dst.shape == src.shape and contiguous(dst)
    with dst.device:  # host -> device
        stream = cp.cuda.get_current_stream()
        if plain:
            dst.set(src, stream=stream)
        else:
            _copy_on_gpu(cp, dst, cp.asarray(src), casting)
        # The copy may still be reading src; the caller may change it next.
        stream.synchronize()


def peer_copy(src):
    """A copy of the device array ``src`` on the current GPU (``src`` is on another).

    cupy queues a copy between GPUs on the destination's current stream, which
    waits for nothing on the source GPU: the copy is ordered after ``src``'s
    writers by an event recorded on the source GPU's current stream and waited
    for by the destination's.
    """
    cp = xp(CUPY)
    with src.device:
        written = cp.cuda.Event(disable_timing=True)
        written.record()
    cp.cuda.get_current_stream().wait_event(written)
    return src.copy()


def _copy_on_gpu(cp, dst, src, casting):
    """``cupy.copyto`` on ``dst``'s GPU; casts to or from bfloat16 by :mod:`mpikv.arrays.halfbits`."""
    if halfbits.is_bfloat16(src.dtype) or halfbits.is_bfloat16(dst.dtype):
        halfbits.cast_into(dst, cp.broadcast_to(src, dst.shape))
    else:
        cp.copyto(dst, src, casting=casting)


def synchronize(array):
    """Waits for the current stream of ``array``'s GPU; a no-op for host arrays.

    Call it before any MPI call on a device buffer: mpi4py passes the
    pointer straight to MPI, which would read memory kernels still write.
    """
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(array, cp.ndarray):
        with array.device:
            cp.cuda.get_current_stream().synchronize()


def synchronize_gpus(arrays):
    """Waits for the current stream of every GPU among ``arrays``' (once per GPU):
    their queued writes are then complete for every stream and the host."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return
    for device in sorted({a.device.id for a in arrays if isinstance(a, cp.ndarray)}):
        with cp.cuda.Device(device):
            cp.cuda.get_current_stream().synchronize()


__all__ = ["KINDS", "array_module", "native_kind", "is_device", "as_native", "xp",
           "cupy_available", "module_of", "on", "contiguous", "empty", "zeros", "sum_into",
           "concatenate_into", "copyto", "peer_copy", "synchronize", "synchronize_gpus", "INSTALL_HINT"]


# -- where arrays are, and whether they share memory -----------------------------
def kind_of(array):
    """``"numpy"`` for a host array, ``"cupy"`` for a device one."""
    return "numpy" if type(array) is np.ndarray else "cupy"


def device_of(array):
    """The GPU id of a device array, None for a host one."""
    return None if type(array) is np.ndarray else array.device.id


def same_place(a, b):
    """Whether two arrays live on the host, or on the same GPU."""
    if type(a) is np.ndarray or type(b) is np.ndarray:
        return type(a) is type(b)
    return type(a) is type(b) and a.device.id == b.device.id


def zeros_on(home, size, dtype):
    """``size`` zeros where ``home`` lives: the host, or ``home``'s GPU."""
    return zeros(kind_of(home), size, dtype, device_of(home))


def same_memory(a, b):
    """Whether two arrays are the same memory seen the same way (address, shape,
    strides, dtype): ``a`` may be another object viewing ``b``."""
    if a is b:
        return True
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if type(a) is np.ndarray:
        address = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    else:
        address = a.data.ptr == b.data.ptr
    return address and a.strides == b.strides


def may_overlap(a, b):
    """Whether two arrays may share memory: host arrays by numpy's bounds, device
    arrays on the same GPU by the byte ranges their pointers, shapes and strides
    span (as numpy's bounds check: views that interleave count as overlapping)."""
    if a is b:
        return True
    if type(a) is np.ndarray or type(b) is np.ndarray:
        return type(a) is np.ndarray and type(b) is np.ndarray and np.may_share_memory(a, b)
    if type(a) is not type(b) or a.device.id != b.device.id:
        return False
    lo_a, hi_a = _byte_range(a)
    lo_b, hi_b = _byte_range(b)
    return lo_a < hi_b and lo_b < hi_a


def _byte_range(array):
    """``[lo, hi)``: the bytes a device array's elements lie in (empty for no elements)."""
    start = array.data.ptr
    if array.size == 0:
        return start, start
    lo = hi = start
    for n, stride in zip(array.shape, array.strides):
        reach = (n - 1) * stride
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + array.itemsize
