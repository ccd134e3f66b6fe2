"""A CPU stand-in for the part of cupy mpikv uses, so device code paths run without a GPU.

It is a test double, not an emulator: arrays live in host memory and kernels
are numpy calls. What it keeps from cupy and CUDA is what catches bugs on a
machine without a GPU, and it keeps it *honestly*: a missing synchronisation
or a device buffer handed to the wrong MPI shows as a wrong value, not only in
bookkeeping.

* device arrays are not numpy arrays: ``numpy.asarray(d)`` raises, numpy
  arrays cannot be mixed into device arithmetic, and data crosses only
  through ``get``/``set``/``asarray``/``asnumpy`` (always copies);
* ``flags`` has no ``writeable``; ``get(out=)`` and ``set`` want matching
  shape, dtype and contiguous memory;
* every array belongs to a device, an operation needs its operands on the
  current device, and ``copy()`` copies to the current device;
* bfloat16 arrays (ml_dtypes' dtype, as cupy 14 holds them) are raw 16-bit
  memory: they may be made, viewed, copied and moved, but no kernel computes
  on them, so mpikv's own integer casts (:mod:`mpikv.arrays.halfbits`) are what the
  tests exercise;
* **device memory the host cannot read**: the pointer that
  ``__cuda_array_interface__`` and ``__dlpack__`` give (to mpi4py, say) is a
  poison buffer (all bits set: NaN, -1), refilled at each hand-out and whose
  writes are lost, unless the job declares a CUDA-aware MPI
  (``MPIKV_CUDA_AWARE=1`` or ``=pull``); then it is the array's memory
  itself. A device buffer that reaches a host-only MPI unstaged gives a
  wrong sum;
* **kernels complete late**: every kernel or copy is queued on a stream (the
  current one) and runs only when something waits for it: ``synchronize`` of
  its stream or device, an event wait, a synchronous copy to the host
  (``get()`` without a stream, ``item()``, ``float()``) on its stream. A new
  array holds poison until its kernel runs. MPI (given the real memory) reads
  whatever has run by then;
* **streams as CUDA has them**: one legacy default stream per device, shared
  by all threads (it waits for, and is waited for by, other blocking streams
  of its device), non-blocking side streams (``Stream(non_blocking=True)``)
  that order with nothing implicitly, events (``Event``, ``Stream.record``,
  ``Stream.wait_event``); the current stream is per thread and per device;
* **peer copies** (``copy()``/``asarray`` of another GPU's array) are queued on
  the destination's current stream only: nothing orders them after the
  source GPU's writers unless the code does (an event);
* DLPack both ways, with device type CUDA (2), which numpy and a CPU-only
  torch refuse: ``ndarray.__dlpack__``/``__dlpack_device__`` give real
  capsules, and ``from_dlpack`` takes any producer whose capsule is on CUDA
  (memory the stand-in knows, or a producer's own host memory labelled CUDA,
  as a test double for CUDA torch tensors may give).

Bookkeeping on top: an array remembers the kernel that last wrote it; a read
(MPI taking its pointer, a host copy, a kernel on a stream not ordered after
that kernel) while the writer has not run is recorded in :func:`races`.
:func:`events` lists the synchronisations and host/device copies in order
(a test may :func:`mark` its own steps among them). Asynchronous copies to and
from host memory (``get(stream=, out=)``, ``set(stream=)``) are noted too: one
that refills host memory another unfinished copy still reads (or writes), not
ordered after it, is a race, and :func:`host_busy` tells a test's MPI stand-in
whether a host buffer is still being copied.

:func:`install` puts it into ``sys.modules`` as ``cupy`` and ``cupyx``;
``STAND_IN = True`` lets a benchmark refuse to report its figures.
"""

import collections
import ctypes
import itertools
import os
import sys
import threading
import weakref

import numpy as np

STAND_IN = True
#: The variable that declares a CUDA-aware MPI (mpikv.transport.cuda.ENV).
AWARE_ENV = "MPIKV_CUDA_AWARE"
POISON = 0xFF
_state = threading.local()
_lock = threading.RLock()   # every queue, clock and kernel run is under it
_counts = {"synchronize": 0}
# (what, stream): synchronisations and host <-> device copies, in order; bounded,
# as a benchmark under the stand-in (build() without install()) never clears it.
_events = collections.deque(maxlen=100_000)
_allocated = {}  # device id -> bytes of new device arrays
_device_count = [2]
_roots = weakref.WeakValueDictionary()   # id -> root array, for from_dlpack's addresses
_streams_by_ptr = weakref.WeakValueDictionary()
_ptrs = itertools.count(0x1000)


try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds   # numpy 2
except ImportError:  # numpy 1
    _byte_bounds = np.byte_bounds


def _current_id():
    return getattr(_state, "device", 0)


def _aware():
    """Whether the job declares a CUDA-aware MPI (``1``, or ``pull``: the library takes
    device memory, and mpikv stages only its reductions)."""
    return os.environ.get(AWARE_ENV, "").strip() not in ("", "0")


# -- cuda: streams, the queue of late kernels, events ------------------------
class _Op:
    """One queued kernel or copy: runs after ``deps`` and its stream's earlier ops."""

    __slots__ = ("fn", "stream", "seq", "deps", "done", "clock")

    def __init__(self, fn, stream, seq, deps, clock):
        self.fn, self.stream, self.seq, self.deps, self.clock = fn, stream, seq, deps, clock
        self.done = False


class Stream:
    """A CUDA stream: a queue of work that runs when something waits for it.

    ``issued`` counts the work queued, ``finished`` the work run,
    ``synchronized`` the calls of :meth:`synchronize`.
    """

    def __init__(self, null=False, non_blocking=False, ptr=0, *, _legacy=False):
        self.non_blocking = bool(non_blocking)
        self.legacy = _legacy
        self.synchronized = 0
        self.issued = 0
        self.finished = 0
        self.device = _current_id()
        self.thread = "all" if _legacy else threading.current_thread().name
        self.ptr = 1 if _legacy else next(_ptrs)  # DLPack's 1: the legacy default stream
        self._queue = collections.deque()
        self._last = None
        self.clock = {}   # stream -> last seq of it that this stream's next work comes after
        _all_streams.append(self)
        if not _legacy:
            _streams_by_ptr[self.ptr] = self

    # the queue
    def _enqueue(self, fn, deps=()):
        with _lock:
            deps = [d for d in deps if d is not None and not d.done]
            for other in self._implicit():
                last = other._last
                if last is not None and not last.done:
                    deps.append(last)
                    _merge(self.clock, last.clock)
            for d in deps:
                _merge(self.clock, d.clock)
            self.issued += 1
            self.clock[self] = self.issued
            op = _Op(fn, self, self.issued, deps, dict(self.clock))
            self._queue.append(op)
            self._last = op
            return op

    def _implicit(self):
        """The streams the legacy default stream's semantics order this one after."""
        if self.non_blocking:
            return ()
        if self.legacy:
            return [s for s in _all_streams if s.device == self.device and not s.legacy
                    and not s.non_blocking]
        return [_legacy_stream(self.device)]

    def _drain(self):
        with _lock:
            if self._last is not None:
                _run_to(self._last)

    def synchronize(self):
        self._drain()
        self.synchronized += 1
        _counts["synchronize"] += 1
        _events.append(("sync", self))

    @property
    def done(self):
        return self._last is None or self._last.done

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        """Work queued here from now on runs after the work ``event`` recorded."""
        if event._op is not None and not event._op.done:
            self._enqueue(None, [event._op])
        else:
            with _lock:
                _merge(self.clock, event._clock)

    def use(self):
        stack = _streams()
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def __enter__(self):
        _streams().append(self)
        return self

    def __exit__(self, *exc):
        _streams().pop()

    def __repr__(self):
        kind = "legacy" if self.legacy else "non-blocking" if self.non_blocking else "blocking"
        return f"<stand-in {kind} Stream {self.ptr:#x} on GPU {self.device}>"


def _merge(clock, other):
    for stream, seq in other.items():
        if clock.get(stream, 0) < seq:
            clock[stream] = seq


def _run_to(op):
    """Runs ``op``'s stream up to ``op``, each op after its dependencies."""
    stream = op.stream
    while not op.done:
        head = stream._queue[0]
        for dep in head.deps:
            if not dep.done:
                _run_to(dep)
        stream._queue.popleft()
        if head.fn is not None:
            with np.errstate(all="ignore"):  # poison may be read by a wrong program
                head.fn()
        head.done = True
        head.fn, head.deps = None, ()   # let go of the arrays it used
        stream.finished = head.seq


class Event:
    """A CUDA event: the point of a stream's queue where it was recorded."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._op = None
        self._clock = {}

    def record(self, stream=None):
        stream = get_current_stream() if stream is None else stream
        with _lock:
            self._op = stream._last
            self._clock = dict(stream.clock)

    def synchronize(self):
        with _lock:
            if self._op is not None:
                _run_to(self._op)

    @property
    def done(self):
        return self._op is None or self._op.done


_all_streams = []
_races = []
_host_ops = []   # (lo, hi, op, writes): queued copies to or from host memory
_legacy = {}  # device id -> its legacy default stream (all threads share it)


def _legacy_stream(device):
    with _lock:
        stream = _legacy.get(device)
        if stream is None:
            saved = _current_id()
            _state.device = device
            try:
                stream = _legacy[device] = Stream(_legacy=True)
            finally:
                _state.device = saved
        return stream


def _streams():
    # cupy keeps a current stream per device and thread.
    if not hasattr(_state, "streams"):
        _state.streams = {}
    return _state.streams.setdefault(_current_id(), [])


def get_current_stream(device_id=None):
    if device_id is not None:
        return _stream_on(int(device_id))
    stack = _streams()
    if stack:
        return stack[-1]
    return _legacy_stream(_current_id())


def stream_from_ptr(ptr, device=None):
    """The stream a DLPack ``stream=`` integer names (1: the legacy stream of ``device``)."""
    if ptr in (None, 1, 2):
        return _legacy_stream(_current_id() if device is None else device)
    return _streams_by_ptr[int(ptr)]


def _stream_on(device):
    """This thread's current stream on ``device``."""
    saved = _current_id()
    _state.device = device
    try:
        return get_current_stream()
    finally:
        _state.device = saved


def _root(a):
    return a if a.base is None else a.base


def _ordered(op, clock):
    """Whether work with vector clock ``clock`` (a stream's, or a queued op's) runs
    after ``op``."""
    return op is None or op.done or clock.get(op.stream, 0) >= op.seq


def _check_read(a, what, clock=None):
    """Records a race if ``a``'s last writer is not ordered before this read:
    for MPI (``clock=None``) it must have run, for queued work (its ``clock``) it
    must have run or be ordered before it."""
    op = getattr(_root(a), "_writer", None)
    if op is None or op.done or (clock is not None and _ordered(op, clock)):
        return
    if a.size == 0:   # no byte is read: no race (MPI passes empty blocks' pointers)
        return
    _races.append(f"{what} in thread {threading.current_thread().name} of a device "
                  f"{_root(a)._a.dtype} array of {_root(a)._a.size} elements on GPU "
                  f"{_root(a)._dev} while its writer (stream {op.stream!r}, thread "
                  f"{op.stream.thread}) has not run")


def _kernel(fn, reads=(), writes=(), stream=None):
    """Queues ``fn`` on ``stream`` (default: the current one); it reads and writes
    device arrays, whose writer it becomes."""
    stream = get_current_stream() if stream is None else stream
    with _lock:
        op = stream._enqueue(fn)
        for a in list(reads) + list(writes):  # a write after another stream's write races too
            _check_read(a, "kernel", op.clock)
        for a in writes:
            _root(a)._writer = op
    return op


def _track_host(host, op, writes):
    """Notes that queued copy ``op`` writes (or reads) the memory of numpy array
    ``host`` when it runs; records a race if an unfinished copy still reads or
    writes that memory, one of them writes, and ``op`` is not ordered after it
    (a pinned buffer refilled before its last copy ran)."""
    lo, hi = _byte_bounds(host)
    with _lock:
        _host_ops[:] = [t for t in _host_ops if not t[2].done]
        for olo, ohi, other, owrites in _host_ops:
            if lo < ohi and olo < hi and (writes or owrites) and not _ordered(other, op.clock):
                _races.append(
                    f"asynchronous copy {'into' if writes else 'from'} host memory in thread "
                    f"{threading.current_thread().name} that an unfinished copy (stream "
                    f"{other.stream!r}) still {'writes' if owrites else 'reads'}")
        _host_ops.append((lo, hi, op, writes))


def _settle_for_host(a, stream=None):
    """A synchronous copy to the host: runs ``stream`` (default: the current one of
    ``a``'s GPU), then checks that ``a``'s writer has run."""
    stream = _stream_on(_root(a)._dev) if stream is None else stream
    stream._drain()
    _check_read(a, "host read")


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
        with _lock:
            for stream in list(_all_streams):
                if stream.device == self.id:
                    stream._drain()
        _counts["synchronize"] += 1
        _events.append(("device sync", None))

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


def _poisoned(shape, dtype):
    """New device memory: whatever was there before (all bits set, here)."""
    a = np.empty(shape, dtype)
    a.reshape(-1).view(np.uint8).fill(POISON) if a.flags.c_contiguous else None
    return a


def _is_bfloat16(dtype):
    return np.dtype(dtype).name == "bfloat16"


def _no_bfloat16_kernel(what, dtypes):
    """Raises unless ``what`` only moves bfloat16 bits (every dtype the same)."""
    dtypes = [np.dtype(d) for d in dtypes]
    if any(_is_bfloat16(d) for d in dtypes) and (what not in _MOVES or len(set(dtypes)) > 1):
        raise TypeError(f"the stand-in runs no bfloat16 kernel ({getattr(what, '__name__', what)} "
                        f"on {', '.join(map(str, dtypes))}): mpikv must cast bits itself")


def _shares(result, found):
    for a in found:
        if isinstance(result, np.ndarray) and np.may_share_memory(result, a._a):
            return a
    return None


def _result(result, found, recompute, device=None):
    """The device array for a kernel's ``result`` (computed now only for its shape):
    a view of an input if it is one, else a new array that the queued kernel fills."""
    if isinstance(result, tuple):
        return tuple(_result(r, found, (lambda i=i: recompute()[i]), device)
                     for i, r in enumerate(result))
    if isinstance(result, np.generic):
        result = np.asarray(result)
    if not isinstance(result, np.ndarray):
        return result
    owner = _shares(result, found)
    if owner is not None:
        return owner._view(result)
    new = ndarray._of(_poisoned(result.shape, result.dtype),
                      _current_id() if device is None else device)

    def run():
        np.copyto(new._a, recompute(), casting="unsafe")
    _kernel(run, found, [new])
    return new


def _call(fn, args, kwargs):
    found = []
    args = _unwrap(args, found)
    out = kwargs.get("out")
    kwargs = {k: _unwrap(v, found) for k, v in kwargs.items()}
    _no_bfloat16_kernel(fn, [a.dtype for a in found])
    _check_device(found)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, ndarray)]
    name = getattr(fn, "__name__", "")
    in_place = name.startswith("__i") or fn in _WRITES_FIRST
    if outs or in_place:
        writes = outs or found[:1]
        _kernel(lambda: fn(*args, **kwargs), [a for a in found if all(a is not w for w in writes)],
                writes)
        if outs:
            return out
        return found[0] if name.startswith("__i") else None
    with _lock, np.errstate(all="ignore"):
        result = fn(*args, **kwargs)   # for its shape and dtype; the kernel runs later
    if not isinstance(result, (np.ndarray, np.generic, tuple)):
        # A host value (a bool, a shape): a synchronous read, as cupy's.
        for a in found:
            _settle_for_host(a)
        with _lock:
            return fn(*args, **kwargs)
    return _result(result, found, lambda: fn(*args, **kwargs))


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
            _roots[id(self)] = self
        return self

    def __init__(self, shape, dtype=float):
        self._a = _poisoned(shape, dtype)
        self._dev = _current_id()
        self.base = None
        _allocated[self._dev] = _allocated.get(self._dev, 0) + self._a.nbytes
        _roots[id(self)] = self

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

    # what MPI (or another library) sees: the device pointer
    def _device_pointer(self):
        """The address handed out: the memory itself under a CUDA-aware MPI, else a
        poison buffer standing for memory the host cannot read."""
        if _aware():
            return self._a.ctypes.data
        root = _root(self)
        lo, hi = _byte_bounds(root._a)
        shadow = getattr(root, "_shadow", None)
        if shadow is None:
            shadow = root._shadow = np.empty(hi - lo, np.uint8)
        shadow.fill(POISON)   # what a host-only MPI wrote there is lost
        return shadow.ctypes.data + (self._a.ctypes.data - lo)

    @property
    def __cuda_array_interface__(self):
        _check_read(self, "MPI")
        a = self._a
        strides = None if a.flags.c_contiguous else a.strides
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (self._device_pointer(), False),
                "version": 3, "strides": strides, "stream": None}

    def __dlpack_device__(self):
        return (DLPACK_CUDA, self._dev)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule on CUDA; the consumer's ``stream`` waits for this array's
        GPU's current stream (the producer's order)."""
        if stream is not None and stream != -1:
            consumer = stream_from_ptr(stream, self._dev)
            producer = _stream_on(self._dev)
            if consumer is not producer:
                consumer.wait_event(producer.record())
            _check_read(self, "DLPack", consumer.clock)
        else:  # -1 (mpi4py): the consumer reads the memory now
            _check_read(self, "DLPack (MPI)")
        return _capsule(self._a, self._device_pointer(), self._dev, DLPACK_CUDA,
                        _wants_versioned(max_version))

    # host <-> device
    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"Only numpy.ndarray can be obtained from cupy.ndarray, "
                                f"not {type(out)}")
            if out.shape != self.shape or out.dtype != self.dtype:
                raise ValueError(f"Shape or dtype mismatch: {out.shape}/{out.dtype} vs "
                                 f"{self.shape}/{self.dtype}")
            if not out.flags.c_contiguous or not self._a.flags.c_contiguous:
                raise RuntimeError("Cannot get to or from a non-contiguous array")
        if stream is not None and not blocking or stream is not None and out is not None:
            # asynchronous: the host array is written when ``stream`` runs the copy
            host = out if out is not None else _poisoned(self.shape, self.dtype)
            op = _kernel(lambda: np.copyto(host, self._a), [self], (), stream)
            _track_host(host, op, writes=True)
            _events.append(("d2h" if out is not None else "d2h-new", stream))
            return host
        used = stream or _stream_on(self._dev)
        with _lock:
            _settle_for_host(self, used)
            if out is None:
                _events.append(("d2h-new", used))
                return self._a.copy()
            np.copyto(out, self._a)
        _events.append(("d2h", used))
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
        given = stream
        stream = stream or _stream_on(self._dev)
        # With a stream the copy reads ``arr`` when it runs (asynchronous, from
        # pinned memory); without one it is synchronous.
        op = _kernel(lambda: np.copyto(self._a, arr), (), [self], stream)
        _track_host(arr, op, writes=False)
        _events.append(("h2d", stream))
        if given is None:
            stream._drain()

    # views and copies
    def copy(self, order="C"):
        """A copy on the current device, queued on its current stream (a peer copy
        when ``self`` is on another GPU: ordered on the destination only)."""
        new = ndarray._of(_poisoned(self.shape, self.dtype), _current_id())
        src = self._a
        _kernel(lambda: np.copyto(new._a, src), [self], [new])
        return new

    def __getitem__(self, index):
        found = []
        index = _unwrap(index, found)
        got = self._a[index]
        if isinstance(got, np.generic):  # a 0-d view, as cupy gives
            more = index + (Ellipsis,) if isinstance(index, tuple) else (index, Ellipsis)
            try:
                got = self._a[more]
            except IndexError:
                pass
        if isinstance(got, np.ndarray) and np.may_share_memory(got, self._a):
            return self._view(got)
        with _device_of(self):
            return _result(got, [self] + found, lambda: self._a[index], self._dev)

    def __setitem__(self, index, value):
        found = [self]
        index = _unwrap(index, found)
        value = _unwrap(value, found)
        _check_device(found)
        _no_bfloat16_kernel("setitem", [self.dtype] + [a.dtype for a in found[1:]]
                            + ([] if found[1:] else [np.float64]))
        a = self._a

        def run():
            a[index] = value
        _kernel(run, found[1:], [self])

    def reshape(self, *shape, order="C"):
        got = self._a.reshape(*shape, order=order)
        if np.may_share_memory(got, self._a):
            return self._view(got)
        return _result(got, [self], lambda: self._a.reshape(*shape, order=order))

    def ravel(self, order="C"):
        got = self._a.ravel(order)
        if np.may_share_memory(got, self._a):
            return self._view(got)
        return _result(got, [self], lambda: self._a.ravel(order))

    def view(self, dtype=None):
        return self._view(self._a.view(dtype))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        _check_device([self])
        _no_bfloat16_kernel("astype", [self.dtype, dtype])
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        new = ndarray._of(_poisoned(self.shape, dtype), self._dev)
        src = self._a
        _kernel(lambda: np.copyto(new._a, src, casting="unsafe"), [self], [new])
        return new

    def fill(self, value):
        _check_device([self])
        _no_bfloat16_kernel("fill", [self.dtype, np.float64])
        a = self._a
        _kernel(lambda: a.fill(value), (), [self])

    # synchronous reads (cupy copies to the host on the current stream and waits)
    def _host(self):
        _settle_for_host(self)
        return self._a

    def item(self):
        return self._host().item()

    def tolist(self):
        return self._host().tolist()

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __float__(self):
        return float(self._host())

    def __int__(self):
        return int(self._host())

    def __bool__(self):
        return bool(self._host())

    def __repr__(self):
        return f"fakecupy.array({self._a!r}, device={self._dev})"

    def __getattr__(self, name):  # sum, max, min, mean, dot, ... as kernels
        if name.startswith("_"):  # no numpy protocols (buffers, interfaces) leak through
            raise AttributeError(name)
        method = getattr(self._a, name)
        if not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: _call(getattr(np.ndarray, name), (self,) + args, kwargs)


def _device_of(a):
    return Device(a._dev)


def _binary(name):
    def op(self, other):
        try:
            return _call(getattr(np.ndarray, name), (self, other), {})
        except TypeError:
            return NotImplemented
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lt", "le", "gt", "ge", "eq", "ne", "lshift", "rshift"):
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
    # cupy copies the host data now (through a pinned buffer); the device has it
    # once the current stream runs the copy.
    host = np.array(obj, dtype=dtype, order=order or "K", copy=True)
    new = ndarray._of(_poisoned(host.shape, host.dtype), _current_id())
    _kernel(lambda: np.copyto(new._a, host), (), [new])
    return new


def array(obj, dtype=None, copy=True, order="K"):
    if isinstance(obj, ndarray):
        return obj.astype(dtype or obj.dtype, copy=copy) if obj._dev == _current_id() \
            else asarray(obj, dtype)
    return asarray(obj, dtype)


def asnumpy(a, stream=None, out=None, blocking=True):
    return a.get(stream=stream, out=out, blocking=blocking) if isinstance(a, ndarray) \
        else np.asarray(a)


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError(f"dst must be a cupy array, not {type(dst)}")
    _call(_copy_into, (src,), {"casting": casting, "out": dst,
                               **({} if where is None else {"where": where})})


def _copy_into(src, casting, out, where=True):
    np.copyto(out, src, casting=casting, where=where)


# -- DLPack ----------------------------------------------------------------
DLPACK_CPU, DLPACK_CUDA, DLPACK_CUDA_MANAGED = 1, 2, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):   # DLPack 1.0
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                                  ctypes.c_void_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                        ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype, _capsule_rename.argtypes = ctypes.c_int, [ctypes.py_object,
                                                                   ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype, _capsule_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
# The structures of the capsules handed out live on (a test double's leak, bounded).
_kept = collections.deque(maxlen=100_000)


def _capsule(a, pointer, device, device_type=DLPACK_CUDA, versioned=False):
    """A DLPack capsule ("dltensor", or "dltensor_versioned" for DLPack 1.0) for numpy
    array ``a``'s layout at ``pointer``."""
    dtype = a.dtype
    code = 4 if _is_bfloat16(dtype) else _DL_CODES[dtype.kind]
    shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
    strides = (ctypes.c_int64 * max(a.ndim, 1))(*(s // a.itemsize for s in a.strides))
    managed = _DLManagedTensorVersioned(1, 0) if versioned else _DLManagedTensor()
    managed.dl_tensor = _DLTensor(pointer, _DLDevice(device_type, device), a.ndim,
                                  _DLDataType(code, dtype.itemsize * 8, 1),
                                  ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                                  ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)
    _kept.append((managed, shape, strides, a))
    name = b"dltensor_versioned" if versioned else b"dltensor"
    return _capsule_new(ctypes.addressof(managed), name, None)


def _wants_versioned(max_version):
    return max_version is not None and tuple(max_version) >= (1, 0)


def dlpack_capsule(a, device=0, device_type=DLPACK_CUDA, max_version=None):
    """A capsule over a numpy array's own memory, labelled as on GPU ``device``: for
    test doubles of other libraries' CUDA arrays (their ``__dlpack__``)."""
    return _capsule(a, a.ctypes.data, device, device_type, _wants_versioned(max_version))


def _dtype_of(code, bits):
    if code == 4:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if code == 6:
        return np.dtype(bool)
    kind = {0: "i", 1: "u", 2: "f", 5: "c"}[code]
    return np.dtype(f"{kind}{bits // 8}")


def _known_memory(pointer):
    """``(root, byte offset)`` of a device address the stand-in handed out, else None."""
    for root in list(_roots.values()):
        lo, hi = _byte_bounds(root._a)
        if lo <= pointer < hi or lo == pointer == hi:
            return root, pointer - lo
        shadow = getattr(root, "_shadow", None)
        if shadow is not None and shadow.ctypes.data <= pointer < shadow.ctypes.data + shadow.size:
            return root, pointer - shadow.ctypes.data
    return None


def from_dlpack(obj):
    """A device array viewing a CUDA DLPack producer's memory (no copy).

    Stand-in arrays give views of themselves; other producers must be on CUDA
    (device type 2 or 13): their capsule's address is the stand-in's own memory
    (handed out before) or the producer's host memory standing for a GPU's.
    Anything else (CPU arrays, numpy) is refused, as a GPU library would.
    """
    if isinstance(obj, ndarray):
        return obj._view(obj._a)
    try:
        device_type, device = obj.__dlpack_device__()
    except AttributeError:
        raise TypeError(f"{type(obj).__name__} is not a DLPack producer") from None
    if int(device_type) not in (DLPACK_CUDA, DLPACK_CUDA_MANAGED):
        raise TypeError(f"the stand-in takes DLPack producers on CUDA, not device type "
                        f"{int(device_type)}")
    try:
        capsule = obj.__dlpack__(stream=get_current_stream().ptr, max_version=(1, 0))
    except TypeError:  # a producer of DLPack before 1.0
        capsule = obj.__dlpack__(stream=get_current_stream().ptr)
    if _capsule_valid(capsule, b"dltensor_versioned"):
        t = _DLManagedTensorVersioned.from_address(
            _capsule_pointer(capsule, b"dltensor_versioned")).dl_tensor
        _capsule_rename(capsule, b"used_dltensor_versioned")
    else:
        t = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor
        _capsule_rename(capsule, b"used_dltensor")
    dtype = _dtype_of(t.dtype.code, t.dtype.bits)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim)) if t.strides
               else None)
    pointer = t.data + t.byte_offset
    known = _known_memory(pointer)
    if known is not None:
        root, offset = known
        raw = root._a.reshape(-1).view(np.uint8) if root._a.flags.c_contiguous else None
        if raw is None:
            raise BufferError("the stand-in views only contiguous memory")
        return root._view(np.ndarray(shape, dtype, buffer=raw, offset=offset, strides=strides))
    extent = max(1, dtype.itemsize * (int(np.prod(shape)) if strides is None else
                                      1 + sum((n - 1) * s for n, s in zip(shape, strides))
                                      // dtype.itemsize))
    raw = (ctypes.c_char * extent).from_address(pointer)
    a = np.ndarray(shape, dtype, buffer=raw, strides=strides)
    new = ndarray._of(a, int(device))
    new._producer = (obj, capsule)  # keeps the producer's memory alive
    return new


#: What may touch bfloat16 arrays: moves of bits, all of one dtype.
_MOVES = {_copy_into, np.concatenate, np.broadcast_to, np.empty_like, np.zeros_like}
#: Functions that write their first argument (no ``out=``).
_WRITES_FIRST = {np.copyto, np.put, np.place, np.putmask, np.fill_diagonal}


def get_array_module(*args):
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in args) else np


def _creator(name):
    fn = getattr(np, name)

    def make(*args, **kwargs):
        host = fn(*args, **kwargs)
        new = ndarray._of(_poisoned(host.shape, host.dtype), _current_id())
        if name != "empty":  # a fill kernel; empty memory stays what it was
            _kernel(lambda: np.copyto(new._a, host), (), [new])
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
    import types
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
    cuda.Event = Event
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
    _host_ops.clear()
    _events.clear()
    _all_streams.clear()
    _legacy.clear()
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
    array, "d2h-new", "h2d") since :func:`install`, with the
    test's :func:`mark` steps."""
    return [what for what, _ in _events]


def event_streams(what):
    """The streams the events named ``what`` ran on, in order (None for a test's marks)."""
    return [stream for name, stream in _events if name == what]


def mark(what):
    """Puts a step of the test's own (an MPI call, say) into :func:`events`."""
    _events.append((what, None))


def races():
    """What was read while its writer had not run and was not ordered before the
    read, since :func:`install`."""
    return list(_races)


def unfinished(array):
    """Whether ``array``'s last writer has not run and is not ordered before work
    on this thread's current stream of its GPU."""
    op = getattr(_root(array), "_writer", None)
    return bool(op is not None and not op.done
                and not _ordered(op, _stream_on(_root(array)._dev).clock))


def host_busy(host):
    """Whether a queued asynchronous copy that has not run still writes or reads the
    memory of numpy array ``host`` (MPI must not touch it then)."""
    lo, hi = _byte_bounds(host)
    with _lock:
        return any(lo < ohi and olo < hi and not op.done for olo, ohi, op, _ in _host_ops)


def pending():
    """How many queued kernels and copies have not run (on every stream)."""
    with _lock:
        return sum(len(s._queue) for s in _all_streams)


def settle():
    """Runs everything queued, as a device-wide synchronisation of every GPU would."""
    with _lock:
        for stream in list(_all_streams):
            stream._drain()
