"""Array backends: numpy on the host, cupy on CUDA GPUs, and views without copies.

A value a user passes (numpy array, CPU or CUDA torch tensor, cupy array,
anything with ``__array_interface__``, ``__cuda_array_interface__`` or
DLPack) is turned into a *native* array that shares its memory: a numpy
array on the host, a cupy array on a GPU. The store works on native arrays
only; :func:`xp` gives the module that operates on them.

Device buffers and MPI (see ``docs/gpu.md``):

* MPI must not read a device buffer before the kernels that write it have
  finished; mpi4py cannot know about streams, so :func:`synchronize` runs
  before every MPI call on a device buffer.
* An MPI library that is not CUDA-aware gets host copies: :class:`Stager`
  keeps pinned host buffers and copies in before, back after the call.
* :func:`device_collective` picks between the two and falls back to staging,
  for the rest of the process, when MPI raises on a device buffer.
* Only blocking collectives may take device buffers: Open MPI's nonblocking
  reductions on GPU memory crash (open-mpi/ompi#9845).

Nothing here imports cupy or torch unless the value in hand needs it.
"""

import contextlib
import sys
import threading

import numpy as np

from . import cuda, halfbits
from ._logging import get_logger
from .dtypes import HALF_DTYPES
from .errors import DTypeError, ValueTypeError

NUMPY = "numpy"
CUPY = "cupy"
#: What :func:`array_module` can answer (besides None).
KINDS = ("numpy", "cupy", "torch-cpu", "torch-cuda")
# The native backend of each kind: where the store keeps such values.
_NATIVE = {"numpy": NUMPY, "torch-cpu": NUMPY, "cupy": CUPY, "torch-cuda": CUPY}

# DLPack device types (dlpack.h DLDeviceType).
DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_CUDA_HOST = 3      # pinned host memory: numpy can read it
DLPACK_CUDA_MANAGED = 13  # unified memory: cupy can wrap it
_DLPACK_KIND = {DLPACK_CPU: "numpy", DLPACK_CUDA_HOST: "numpy",
                DLPACK_CUDA: "cupy", DLPACK_CUDA_MANAGED: "cupy"}

INSTALL_HINT = "install mpikv[cuda12] (or mpikv[cuda13] for CUDA 13)"

#: Device buffers may only go to blocking MPI calls (open-mpi/ompi#9845).
NONBLOCKING_ON_DEVICE = False

_log = get_logger("mpikv.gpu")


# -- modules -------------------------------------------------------------
def _import_cupy():
    """cupy, or None when it is missing or broken (no CUDA runtime, for one)."""
    mod = sys.modules.get("cupy")
    if mod is not None:
        return mod
    try:
        import cupy
    except Exception:  # a cupy without its CUDA libraries raises more than ImportError
        return None
    return cupy


def cupy_available():
    """Whether cupy imports and sees at least one GPU."""
    cp = _import_cupy()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def xp(kind):
    """The module that operates on arrays of ``kind``: numpy or cupy.

    Args:
        kind: a native kind ("numpy", "cupy") or any of :data:`KINDS`.

    Raises:
        ValueError: an unknown kind.
        ImportError: ``kind`` needs cupy and it is not installed.
    """
    native = _NATIVE.get(kind)
    if native is None:
        raise ValueError(f"unknown array kind {kind!r} (use one of {', '.join(KINDS)})")
    if native == NUMPY:
        return np
    cp = _import_cupy()
    if cp is None:
        raise ImportError(f"cupy is not installed or cannot load: {INSTALL_HINT}")
    return cp


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
    return _NATIVE.get(array_module(array))


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
    if _NATIVE[kind] == NUMPY:
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
    from .dtypes import BFLOAT16
    if BFLOAT16 is None:
        raise DTypeError(f"{what} is bfloat16, which needs the ml_dtypes package "
                         f"(pip install mpikv[bf16])")
    import torch
    # numpy has no bfloat16: the bits go through as int16, then get their dtype back.
    return tensor.view(torch.int16).numpy().view(BFLOAT16)


def _device_view(value, kind, what):
    cp = _import_cupy()
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
    ml_dtypes installed). mpikv runs no bfloat16 kernel: see :mod:`mpikv.halfbits`."""
    from .dtypes import BFLOAT16
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
    from .dtypes import BFLOAT16
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


def on(array):
    """The context that makes ``array``'s GPU current (a no-op for host arrays).

    cupy runs kernels and allocates on the current GPU, which is per thread.
    """
    device = getattr(array, "device", None)
    if device is not None and hasattr(device, "__enter__"):
        return device
    return contextlib.nullcontext()


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


def module_of(array):
    """numpy for a host array, cupy for a device one (as ``cupy.get_array_module``)."""
    if isinstance(array, np.ndarray):
        return np
    return xp(native_kind(array) or NUMPY)


def _same_gpu(a, b):
    return a.device.id == b.device.id


def sum_into(out, arrays):
    """Writes the sum of same-shaped arrays into the flat array ``out``, in ``out``'s backend.

    The sum runs where ``out`` lives: on its GPU for a cupy ``out`` (host or
    other-GPU inputs are copied there first), on the host for numpy (device
    inputs are copied down). A float16 or bfloat16 ``out`` is summed in
    float32 and rounded once, as :mod:`mpikv._arrays` does.

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
                inputs.append(a if _same_gpu(a, out) else a.copy())
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
            _copy_on_gpu(cp, dst, src if _same_gpu(dst, src) else src.copy(), casting)
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


def _copy_on_gpu(cp, dst, src, casting):
    """``cupy.copyto`` on ``dst``'s GPU; casts to or from bfloat16 by :mod:`mpikv.halfbits`."""
    if halfbits.is_bfloat16(src.dtype) or halfbits.is_bfloat16(dst.dtype):
        halfbits.cast_into(dst, cp.broadcast_to(src, dst.shape))
    else:
        cp.copyto(dst, src, casting=casting)


def contiguous(array):
    """Whether ``array`` (numpy or cupy) is C-contiguous."""
    flags = array.flags
    return bool(flags.c_contiguous if hasattr(flags, "c_contiguous") else flags["C_CONTIGUOUS"])


def synchronize(array):
    """Waits for the current stream of ``array``'s GPU; a no-op for host arrays.

    Call it before any MPI call on a device buffer: mpi4py passes the
    pointer straight to MPI, which would read memory kernels still write.
    """
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(array, cp.ndarray):
        with array.device:
            cp.cuda.get_current_stream().synchronize()


# -- handing GPU work to another thread ------------------------------------
class _WorkerGPU:
    """The worker's side of :func:`handover`: the caller's GPU, its own stream, a final wait.

    The worker issues its kernels and copies on a non-blocking stream of its
    own, so its waits (before each MPI call, and at the end) do not wait for
    unrelated kernels the caller queues meanwhile, as cupy's default (legacy)
    stream would make them.
    """

    __slots__ = ("_cp", "_device", "_devices", "_stream")
    _streams = {}  # (thread id, GPU id) -> the worker's stream there

    def __init__(self, cp, device_id, devices):
        self._cp = cp
        self._device = cp.cuda.Device(device_id)
        self._devices = sorted(set(devices) | {device_id})
        self._stream = None

    def __enter__(self):
        self._device.__enter__()
        key = (threading.get_ident(), self._device.id)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = self._cp.cuda.Stream(non_blocking=True)
        self._stream = stream
        stream.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            # The caller may touch the outputs and the store's memory, on any
            # stream, once the handle is done: wait on every GPU the call touched.
            for device in self._devices:
                with self._cp.cuda.Device(device):
                    self._cp.cuda.get_current_stream().synchronize()
        finally:
            self._stream.__exit__(*exc)
            self._device.__exit__(*exc)


def handover(arrays, on_gpu=False, gpus=()):
    """Prepares GPU work made in this thread to run in a worker thread.

    cupy's current device and stream are per thread, and MPI knows no
    streams. So, in the calling thread, this waits for the current stream of
    every GPU the call touches (the call's arrays' GPUs and ``gpus``, where
    the store keeps values): their writers, the caller's earlier calls among
    them, have finished. It returns a context for the worker that makes the
    caller's current GPU current there and, on exit, waits for the worker's
    stream on each of those GPUs, so the work is done when the handle is.

    Args:
        arrays: the call's native arrays (values and outputs).
        on_gpu: whether the store keeps values on a GPU (work happens there
            even when every array is on the host).
        gpus: ids of the GPUs holding the store's values.

    Returns:
        The worker's context, or None when there is no GPU work.
    """
    cp = sys.modules.get("cupy")
    if cp is None:  # no cupy loaded: no GPU array can exist
        return None
    devices = {a.device.id for a in arrays if isinstance(a, cp.ndarray)}
    devices.update(gpus)
    if not devices and not on_gpu:
        return None
    for device in sorted(devices):
        with cp.cuda.Device(device):
            cp.cuda.get_current_stream().synchronize()
    return _WorkerGPU(cp, cp.cuda.Device().id, devices)


# -- staging -------------------------------------------------------------
class Stager:
    """Pinned host buffers that carry device buffers through a host-only MPI.

    Buffers are pooled per dtype and reused: a call takes a free buffer with
    enough elements (replacing a too-small one), so the pool holds as many
    buffers per dtype as calls were ever staged at once.

    ``with stager.staged(dev) as host: mpi_call(host)`` synchronises the
    device, copies ``dev`` into ``host``, runs the body, copies ``host``
    back into ``dev`` and waits for that copy.

    Args:
        device_module: the module with cupy's ``cuda.get_current_stream()``
            (default: cupy, imported on first use). Tests pass a stand-in.
        empty_pinned: ``(size, dtype) -> numpy array`` for new host buffers
            (default: ``cupyx.empty_pinned`` if importable, else
            ``numpy.empty``: pinned memory makes the copies DMA transfers).
    """

    def __init__(self, device_module=None, empty_pinned=None):
        self._dev = device_module
        self._empty_pinned = empty_pinned
        self._lock = threading.Lock()
        self._free = {}    # dtype -> [1-D host buffer]
        self._busy = {}    # id(view handed out) -> (dtype, buffer)
        self.allocations = 0

    @property
    def device_module(self):
        if self._dev is None:
            self._dev = xp(CUPY)
        return self._dev

    def _allocate(self, dtype, size):
        make = self._empty_pinned
        if make is None:
            try:
                import cupyx
                make = self._empty_pinned = cupyx.empty_pinned
            except Exception:  # no cupy: plain host memory still works
                make = self._empty_pinned = np.empty
        self.allocations += 1
        return make(size, dtype)

    def acquire(self, dtype, size):
        """A host buffer of ``size`` elements; give it back with :meth:`release`."""
        dtype = np.dtype(dtype)
        with self._lock:
            pool = self._free.setdefault(dtype, [])
            fits = [b for b in pool if b.size >= size]
            if fits:
                base = min(fits, key=lambda b: b.size)
                pool.remove(base)
            else:
                if pool:  # too small for this call: let it go rather than hoard it
                    pool.remove(max(pool, key=lambda b: b.size))
                base = None
        if base is None:
            base = self._allocate(dtype, size)
        view = base[:size]
        with self._lock:
            self._busy[id(view)] = (dtype, base, view)
        return view

    def release(self, host):
        """Returns a buffer from :meth:`acquire` or :meth:`to_host` to the pool."""
        with self._lock:
            dtype, base, _ = self._busy.pop(id(host))
            self._free.setdefault(dtype, []).append(base)

    def pooled(self):
        """``{dtype: [sizes]}`` of the free buffers (tests, diagnostics)."""
        with self._lock:
            return {str(d): sorted(b.size for b in pool) for d, pool in self._free.items() if pool}

    def _synchronize(self, dev_flat):
        with on(dev_flat):
            self.device_module.cuda.get_current_stream().synchronize()

    def to_host(self, dev_flat, host=None):
        """Copies a flat device buffer to host memory once the GPU has written it.

        Args:
            dev_flat: a flat, contiguous device array.
            host: a flat host array of its size and dtype (default: one from
                the pool, to be handed back with :meth:`release`).

        Returns:
            the host array holding ``dev_flat``'s values.
        """
        _check_flat(dev_flat)
        if host is None:
            host = self.acquire(dev_flat.dtype, dev_flat.size)
        # The kernels that wrote dev_flat may still be running.
        self._synchronize(dev_flat)
        with on(dev_flat):
            dev_flat.get(out=host)
        return host

    def to_device(self, host, dev_flat):
        """Copies ``host`` into the flat device buffer and waits until it is there.

        Waiting lets the host buffer be reused at once and makes the values
        visible to kernels on any stream.
        """
        _check_flat(dev_flat)
        with on(dev_flat):
            stream = self.device_module.cuda.get_current_stream()
            dev_flat.set(host, stream=stream)
            stream.synchronize()

    @contextlib.contextmanager
    def staged(self, dev_buf, copy_in=True, copy_back=True):
        """Lends a host copy of ``dev_buf`` for an MPI call.

        Args:
            dev_buf: a flat, contiguous device array.
            copy_in: copy the device values in first (False where MPI only
                writes the buffer: a non-root ``Bcast``).
            copy_back: copy the result back after the body (False where MPI
                only reads it: a non-root ``Reduce``). Skipped if the body raises.

        Yields:
            a flat host array of ``dev_buf``'s size and dtype.
        """
        _check_flat(dev_buf)
        host = self.acquire(dev_buf.dtype, dev_buf.size)
        try:
            if copy_in:
                self.to_host(dev_buf, host)
            yield host
            if copy_back:
                self.to_device(host, dev_buf)
        finally:
            self.release(host)


def _check_flat(array):
    if array.ndim != 1:
        raise ValueError(f"staging takes flat buffers, not shape {tuple(array.shape)}")


# -- policy --------------------------------------------------------------
def _mpi_errors():
    mpi = sys.modules.get("mpi4py.MPI")  # MPI calls imply it is loaded; never import it here
    return (mpi.Exception,) if mpi is not None else ()


def device_collective(fn, dev_buf, aware, stager, copy_in=True, copy_back=True,
                      fallback=None, mpi_errors=None):
    """Runs the blocking MPI call ``fn`` on ``dev_buf``: directly, or through host staging.

    With ``aware`` (and no earlier fallback) the device's stream is
    synchronised and ``fn(dev_buf)`` runs. If that raises an MPI error, a
    warning is logged once, the fallback is recorded in
    :data:`mpikv.cuda.FALLBACK` (so every later call of this process
    stages), and the call is retried staged. The retry is right when the
    error came before any data moved, as when MPI refuses the buffer while
    checking its arguments (every rank checks alike); if ranks fail
    differently, the collective timeout ends the job instead of a hang.
    A host ``dev_buf`` is passed as is.

    Only blocking collectives may be passed: Open MPI's nonblocking
    reductions on GPU memory crash instead of raising (open-mpi/ompi#9845).

    Args:
        fn: ``fn(buffer)``, the MPI call on a flat contiguous buffer.
        dev_buf: a flat device (or host) array.
        aware: bool or :class:`mpikv.cuda.Decision`.
        stager: a :class:`Stager`.
        copy_in, copy_back: see :meth:`Stager.staged`.
        fallback: a :class:`mpikv.cuda.Fallback` (default ``cuda.FALLBACK``).
        mpi_errors: exception classes that mean "MPI refused" (default
            ``mpi4py.MPI.Exception`` if mpi4py is loaded).

    Returns:
        what ``fn`` returns.
    """
    if isinstance(dev_buf, np.ndarray):
        return fn(dev_buf)
    fallback = cuda.FALLBACK if fallback is None else fallback
    if isinstance(aware, cuda.Decision):
        aware = aware.aware
    if aware and not fallback.happened:
        errors = _mpi_errors() if mpi_errors is None else tuple(mpi_errors)
        _synchronize_any(dev_buf, stager)
        try:
            return fn(dev_buf)
        except errors as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if fallback.record(reason):
                _log.warning("MPI failed on a device buffer (%s); staging device buffers "
                             "through host memory for the rest of this process. Set "
                             "%s=0 to stage from the start.", reason, cuda.ENV)
    with stager.staged(dev_buf, copy_in=copy_in, copy_back=copy_back) as host:
        return fn(host)


def _synchronize_any(dev_buf, stager):
    """Synchronises through the stager's device module (a stand-in in tests)."""
    stager._synchronize(dev_buf)


__all__ = ["KINDS", "array_module", "native_kind", "is_device", "as_native", "xp",
           "cupy_available", "module_of", "on", "empty", "zeros", "sum_into",
           "concatenate_into", "copyto", "synchronize", "handover", "Stager",
           "device_collective", "INSTALL_HINT", "NONBLOCKING_ON_DEVICE"]
