"""A CPU stand-in for the part of cupy mpikv uses, so device code paths run without a GPU.

It is a test double, not an emulator: arrays live in host memory, kernels are
numpy calls, streams only count synchronisations. What it keeps from cupy is
what catches bugs on a machine without a GPU:

* device arrays are not numpy arrays: ``numpy.asarray(d)`` raises, numpy
  arrays cannot be mixed into device arithmetic, and data crosses only
  through ``get``/``set``/``asarray``/``asnumpy`` (always copies);
* ``flags`` has no ``writeable``; ``get(out=)`` and ``set`` want matching
  shape, dtype and contiguous memory;
* every array belongs to a device, an operation needs its operands on the
  current device, and ``copy()`` copies to the current device;
* bfloat16 arrays (ml_dtypes' dtype, as cupy 14 holds them) are raw 16-bit
  memory: they may be made, viewed, copied and moved, but no kernel computes
  on them (no arithmetic, no cast to or from them), so mpikv's own integer
  casts (:mod:`mpikv.halfbits`) are what the tests exercise;
* ``__cuda_array_interface__`` exposes the memory, so mpi4py passes it to
  MPI as a "device pointer" (host memory here, so any MPI moves it);
* streams are per thread and per device, and every kernel or copy stays
  *unfinished* until its stream (or its device) is synchronised.
  An array remembers the kernel that last wrote it. MPI taking its pointer
  before that kernel is finished, or a kernel or copy on another stream
  reading it before then, is recorded in :func:`races`: on a GPU that read
  could see old values.

:func:`events` lists the synchronisations and host/device copies in order
(a test may :func:`mark` its own steps among them), so a test can check
that staging waits before it copies and copies before MPI reads.

:func:`install` puts it into ``sys.modules`` as ``cupy`` and ``cupyx``;
``STAND_IN = True`` lets a benchmark refuse to report its figures.
"""

import collections
import sys
import threading
import types

import numpy as np

STAND_IN = True
_state = threading.local()
_counts = {"synchronize": 0}
# (what, stream): synchronisations and host <-> device copies, in order; bounded,
# as a benchmark under the stand-in (build() without install()) never clears it.
_events = collections.deque(maxlen=100_000)
_allocated = {}  # device id -> bytes of new device arrays
_device_count = [2]


def _current_id():
    return getattr(_state, "device", 0)


# -- cuda ----------------------------------------------------------------
class Stream:
    """Work is done at once, but stays "unfinished" until a synchronisation."""

    def __init__(self, non_blocking=False):
        self.non_blocking = non_blocking
        self.synchronized = 0
        self.issued = 0     # work items queued on this stream
        self.finished = 0   # ... of which a synchronisation has waited for
        self.device = _current_id()
        self.thread = threading.current_thread().name
        _all_streams.append(self)

    def synchronize(self):
        self.synchronized += 1
        self.finished = self.issued
        _counts["synchronize"] += 1
        _events.append(("sync", self))

    def __enter__(self):
        _streams().append(self)
        return self

    def __exit__(self, *exc):
        _streams().pop()


_all_streams = []
_races = []


def _streams():
    # cupy keeps a current stream per device and thread.
    if not hasattr(_state, "streams"):
        _state.streams = {}
    return _state.streams.setdefault(_current_id(), [])


_null_streams = {}


def get_current_stream():
    stack = _streams()
    if stack:
        return stack[-1]
    key = (threading.get_ident(), _current_id())
    stream = _null_streams.get(key)
    if stream is None:
        stream = _null_streams[key] = Stream()
    return stream


def _stream_on(device):
    """This thread's current stream on ``device`` (``get`` copies with ``array.device`` current)."""
    saved = _current_id()
    _state.device = device
    try:
        return get_current_stream()
    finally:
        _state.device = saved


def _root(a):
    return a if a.base is None else a.base


def _wrote(a, stream=None):
    """``a`` was written by a kernel or copy on ``stream`` (default: the current one)."""
    stream = get_current_stream() if stream is None else stream
    stream.issued += 1
    _root(a)._writer = (stream, stream.issued)


def _check_read(a, what):
    """Records a race if ``a``'s last writer is unfinished and not this thread's stream."""
    writer, seq = getattr(_root(a), "_writer", (None, 0))
    if writer is None or writer.finished >= seq:
        return
    if what != "MPI" and writer is _stream_on(_root(a)._dev):
        return  # the same stream orders this read after the write
    _races.append(f"{what} in thread {threading.current_thread().name} of a device "
                  f"{_root(a)._a.dtype} array of {_root(a)._a.size} elements on GPU "
                  f"{_root(a)._dev} while its writer stream (thread {writer.thread}, GPU "
                  f"{writer.device}) is unfinished")


class Device:
    def __init__(self, device=None):
        self.id = _current_id() if device is None else int(device)
        if not 0 <= self.id < _device_count[0]:
            raise RuntimeError(f"cudaErrorInvalidDevice: device {self.id}")
        self._saved = []

    def __enter__(self):
        self._saved.append(_current_id())
        _state.device = self.id
        return self

    def __exit__(self, *exc):
        _state.device = self._saved.pop()

    def use(self):
        _state.device = self.id

    def synchronize(self):
        _counts["synchronize"] += 1
        _events.append(("device sync", None))
        for stream in _all_streams:
            if stream.device == self.id:
                stream.finished = stream.issued

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def _get_device_count():
    return _device_count[0]


# -- arrays --------------------------------------------------------------
class _Flags:
    def __init__(self, a):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


def _check_device(arrays):
    here = _current_id()
    for a in arrays:
        if a._dev != here:
            raise ValueError(f"Array device must be same as the current device: "
                             f"array device = {a._dev} while current = {here}")


def _unwrap(obj, found):
    if isinstance(obj, ndarray):
        found.append(obj)
        return obj._a
    if isinstance(obj, np.ndarray):
        raise TypeError(f"Unsupported type {type(obj)}")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, found) for o in obj)
    return obj


def _wrap(result, device=None):
    if isinstance(result, np.ndarray):
        return ndarray._of(result, _current_id() if device is None else device)
    if isinstance(result, np.generic):
        return ndarray._of(np.asarray(result), _current_id() if device is None else device)
    if isinstance(result, tuple):
        return tuple(_wrap(r, device) for r in result)
    return result


def _is_bfloat16(dtype):
    return np.dtype(dtype).name == "bfloat16"


def _no_bfloat16_kernel(what, dtypes):
    """Raises unless ``what`` only moves bfloat16 bits (every dtype the same)."""
    dtypes = [np.dtype(d) for d in dtypes]
    if any(_is_bfloat16(d) for d in dtypes) and (what not in _MOVES or len(set(dtypes)) > 1):
        raise TypeError(f"the stand-in runs no bfloat16 kernel ({getattr(what, '__name__', what)} "
                        f"on {', '.join(map(str, dtypes))}): mpikv must cast bits itself")


def _call(fn, args, kwargs):
    found = []
    args = _unwrap(args, found)
    out = kwargs.get("out")
    kwargs = {k: _unwrap(v, found) for k, v in kwargs.items()}
    _no_bfloat16_kernel(fn, [a.dtype for a in found])
    _check_device(found)
    for a in found:
        if a is not out:
            _check_read(a, "kernel")
    result = fn(*args, **kwargs)
    if isinstance(out, ndarray):
        _wrote(out)
        return out
    for a in found:
        if result is a._a:  # an in-place operator: the same array
            _wrote(a)
            return a
    result = _wrap(result)
    if isinstance(result, ndarray):
        _wrote(result)
    return result


class ndarray:  # noqa: N801 - cupy's name
    """A device array: a numpy array it never hands out, plus the device it is on."""

    __array_priority__ = 100

    @classmethod
    def _of(cls, a, device, base=None):
        self = object.__new__(cls)
        self._a = a
        self._dev = device
        self.base = base  # the array this one views, as in cupy (None: owns its memory)
        if base is None:
            _allocated[device] = _allocated.get(device, 0) + a.nbytes
        return self

    def __init__(self, shape, dtype=float):
        self._a = np.empty(shape, dtype)
        self._dev = _current_id()
        self.base = None
        _allocated[self._dev] = _allocated.get(self._dev, 0) + self._a.nbytes

    def _view(self, a):
        return ndarray._of(a, self._dev, self if self.base is None else self.base)

    # what numpy may not do with it
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        try:
            return _call(getattr(ufunc, method), inputs, kwargs)
        except TypeError:
            return NotImplemented

    def __array_function__(self, func, types_, args, kwargs):
        return _call(func, args, kwargs)

    # attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    device = property(lambda self: Device(self._dev))
    data = property(lambda self: _Pointer(self._a.ctypes.data))
    T = property(lambda self: self._view(self._a.T))

    @property
    def __cuda_array_interface__(self):
        _check_read(self, "MPI")
        a = self._a
        strides = None if a.flags.c_contiguous else a.strides
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                "version": 3, "strides": strides, "stream": None}

    # host <-> device
    def get(self, stream=None, order="C", out=None):
        _check_read(self, "get")
        if out is None:
            _events.append(("d2h-new", stream or _stream_on(self._dev)))
            return self._a.copy()
        if not isinstance(out, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be obtained from cupy.ndarray, "
                            f"not {type(out)}")
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"Shape or dtype mismatch: {out.shape}/{out.dtype} vs "
                             f"{self.shape}/{self.dtype}")
        if not out.flags.c_contiguous or not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot get to or from a non-contiguous array")
        np.copyto(out, self._a)
        _events.append(("d2h", stream or _stream_on(self._dev)))
        return out

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, not {type(arr)}")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        np.copyto(self._a, arr)
        stream = stream or _stream_on(self._dev)
        _wrote(self, stream)   # cupy copies on the stream it is given
        _events.append(("h2d", stream))

    # views and copies (no device check: cupy copies across devices here)
    def copy(self, order="C"):
        _check_read(self, "copy")
        new = ndarray._of(self._a.copy(order), _current_id())
        _wrote(new)
        return new

    def __getitem__(self, index):
        found = []
        index = _unwrap(index, found)
        got = self._a[index]
        if isinstance(got, np.ndarray) and np.shares_memory(got, self._a):
            return self._view(got)
        return _wrap(got, self._dev)

    def __setitem__(self, index, value):
        found = [self]
        index = _unwrap(index, found)
        value = _unwrap(value, found)
        _check_device(found)
        _no_bfloat16_kernel("setitem", [self.dtype] + [a.dtype for a in found[1:]]
                            + ([] if found[1:] else [np.float64]))
        for a in found[1:]:
            _check_read(a, "kernel")
        self._a[index] = value
        _wrote(self)

    def reshape(self, *shape, order="C"):
        return self._view(self._a.reshape(*shape, order=order))

    def ravel(self, order="C"):
        return self._view(self._a.ravel(order))

    def view(self, dtype=None):
        return self._view(self._a.view(dtype))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        _check_device([self])
        _no_bfloat16_kernel("astype", [self.dtype, dtype])
        b = self._a.astype(dtype, copy=copy)
        if b is self._a:
            return self
        new = ndarray._of(b, self._dev)
        _wrote(new)
        return new

    def fill(self, value):
        _check_device([self])
        _no_bfloat16_kernel("fill", [self.dtype, np.float64])
        self._a.fill(value)
        _wrote(self)

    def item(self):
        return self._a.item()

    def tolist(self):
        return self._a.tolist()

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __bool__(self):
        return bool(self._a)

    def __repr__(self):
        return f"fakecupy.array({self._a!r}, device={self._dev})"

    def __getattr__(self, name):  # sum, max, min, mean, dot, ... as kernels
        if name.startswith("_"):  # no numpy protocols (__dlpack__, buffers) leak through
            raise AttributeError(name)
        method = getattr(self._a, name)
        if not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: _call(getattr(np.ndarray, name), (self,) + args, kwargs)


def _binary(name):
    def op(self, other):
        try:
            return _call(getattr(np.ndarray, name), (self, other), {})
        except TypeError:
            return NotImplemented
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lt", "le", "gt", "ge", "eq", "ne"):
    for _form in ("__%s__", "__r%s__", "__i%s__"):
        _dunder = _form % _name
        if hasattr(np.ndarray, _dunder):
            setattr(ndarray, _dunder, _binary(_dunder))
for _name in ("__neg__", "__pos__", "__abs__", "__invert__"):
    setattr(ndarray, _name, lambda self, _n=_name: _call(getattr(np.ndarray, _n), (self,), {}))
ndarray.__hash__ = None


# -- module functions ----------------------------------------------------
def asarray(obj, dtype=None, order=None):
    if isinstance(obj, ndarray):
        if obj._dev != _current_id():
            return obj.copy().astype(dtype or obj.dtype, copy=False)
        return obj if dtype is None or np.dtype(dtype) == obj.dtype else obj.astype(dtype)
    if hasattr(obj, "__cuda_array_interface__"):
        raise TypeError("the stand-in wraps only its own arrays")
    new = ndarray._of(np.array(obj, dtype=dtype, order=order or "K", copy=True), _current_id())
    _wrote(new)
    return new


def array(obj, dtype=None, copy=True, order="K"):
    if isinstance(obj, ndarray):
        return obj.astype(dtype or obj.dtype, copy=copy) if obj._dev == _current_id() \
            else asarray(obj, dtype)
    return asarray(obj, dtype)


def asnumpy(a, stream=None, out=None):
    return a.get(out=out) if isinstance(a, ndarray) else np.asarray(a)


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError(f"dst must be a cupy array, not {type(dst)}")
    _call(_copy_into, (src,), {"casting": casting, "out": dst,
                               **({} if where is None else {"where": where})})


def _copy_into(src, casting, out, where=True):
    np.copyto(out, src, casting=casting, where=where)


def from_dlpack(obj):
    raise TypeError("the stand-in takes no DLPack producers")


#: What may touch bfloat16 arrays: moves of bits, all of one dtype.
_MOVES = {_copy_into, np.concatenate, np.broadcast_to, np.empty_like, np.zeros_like}


def get_array_module(*args):
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in args) else np


def _creator(name):
    fn = getattr(np, name)

    def make(*args, **kwargs):
        new = _wrap(fn(*args, **kwargs))
        _wrote(new)
        return new
    make.__name__ = name
    return make


def _module_getattr(name):
    thing = getattr(np, name)
    if callable(thing) and not isinstance(thing, type):
        return lambda *args, **kwargs: _call(thing, args, kwargs)
    return thing


def build(device_count=2):
    """Fresh ``cupy`` and ``cupyx`` module objects backed by this file."""
    _device_count[0] = device_count
    cp = types.ModuleType("cupy")
    cp.STAND_IN = STAND_IN
    cp.__version__ = "0+stand-in"
    cp.ndarray = ndarray
    for name in ("asarray", "array", "asnumpy", "copyto", "from_dlpack", "get_array_module"):
        setattr(cp, name, globals()[name])
    for name in ("empty", "zeros", "ones", "full", "arange", "linspace"):
        setattr(cp, name, _creator(name))
    for name in ("empty_like", "zeros_like", "ones_like", "full_like"):
        setattr(cp, name, lambda a, *args, _n=name, **kw: _call(getattr(np, _n), (a,) + args, kw))
    cp.__getattr__ = _module_getattr
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = Device
    cuda.Stream = Stream
    cuda.get_current_stream = get_current_stream
    cuda.runtime = types.SimpleNamespace(getDeviceCount=_get_device_count)
    cp.cuda = cuda
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)
    return {"cupy": cp, "cupy.cuda": cuda, "cupyx": cupyx}


def install(monkeypatch, device_count=2):
    """Makes ``import cupy`` give the stand-in for the test using ``monkeypatch``."""
    modules = build(device_count)
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    _state.device = 0
    _counts["synchronize"] = 0
    _allocated.clear()
    _races.clear()
    _events.clear()
    _all_streams.clear()
    _null_streams.clear()
    if hasattr(_state, "streams"):
        _state.streams = {}
    return modules["cupy"]


def synchronizations():
    """Stream and device synchronisations since :func:`install`."""
    return _counts["synchronize"]


def allocated():
    """``{device id: bytes}`` of device arrays created since :func:`install`."""
    return dict(_allocated)


def events():
    """The synchronisations ("sync", "device sync") and copies ("d2h" into a given host
    array, "d2h-new", "h2d") since :func:`install`, with the test's :func:`mark` steps."""
    return [what for what, _ in _events]


def event_streams(what):
    """The streams the events named ``what`` ran on, in order (None for a test's marks)."""
    return [stream for name, stream in _events if name == what]


def mark(what):
    """Puts a step of the test's own (an MPI call, say) into :func:`events`."""
    _events.append((what, None))


def races():
    """What was read while its writer stream was unfinished, since :func:`install`."""
    return list(_races)


def unfinished(array):
    """Whether ``array``'s last writer is unfinished and not this thread's stream on its GPU."""
    writer, seq = getattr(_root(array), "_writer", (None, 0))
    return bool(writer is not None and writer.finished < seq
                and writer is not _stream_on(_root(array)._dev))
