"""GPU buffers and MPI: the one place that decides how a device buffer reaches MPI.

* MPI must not read a device buffer before the kernels that write it have
  finished; mpi4py knows no streams, so the buffer's stream is synchronised
  before every MPI call on it.
* An MPI library that is not CUDA-aware gets host copies: a :class:`Stager`
  keeps pinned host buffers and copies in before, back after the call.
* One :class:`Staging` per store (the transport owns it; the reducers'
  :class:`~mpikv.reducers.staged.StagedReducer` uses the same one) decides
  between the two with :func:`mpikv.transport.cuda.detect`, and falls back to staging,
  for the rest of the process (:data:`mpikv.transport.cuda.FALLBACK`, one warning),
  when MPI raises on a device buffer.
* Only blocking collectives may take device buffers: Open MPI's nonblocking
  reductions on GPU memory crash (open-mpi/ompi#9845).
* :func:`handover` prepares a call's GPU work for the store's worker thread.

Anchor: ChainerMN's ``_memory_utility.py`` (host and device buffers, pack and
unpack, in one helper beneath the communicators). It lives with the
transport, which owns the store's one :class:`Staging`: whether MPI takes a
device buffer is a question about the MPI library.
"""

import contextlib
import sys
import threading

import numpy as np

from . import cuda
from .pipeline import DEFAULT_STAGING_PIECE, piece_ranges, pipelined, wants_pieces
from ..logs import get_logger
from ..arrays.xp import module_of, on
from ..arrays.backends import is_device, synchronize

#: Device buffers may only go to blocking MPI calls (open-mpi/ompi#9845).
NONBLOCKING_ON_DEVICE = False

_log = get_logger("mpikv.gpu")


def mpi_errors():
    """The exception classes that mean "MPI refused": ``mpi4py.MPI.Exception`` if loaded."""
    mpi = sys.modules.get("mpi4py.MPI")  # MPI calls imply it is loaded; never import it here
    return (mpi.Exception,) if mpi is not None else ()


# -- the policy ------------------------------------------------------------
class Staging:
    """How one store's device buffers reach MPI: directly, or through host staging.

    Whether MPI is CUDA-aware is decided at the first device buffer (the
    probes may start ``ompi_info``), the same way on every rank. With a
    CUDA-aware MPI the buffers' streams are synchronised and the buffers go
    to MPI as they are; if MPI raises on one, a warning is logged once and
    the process stages from then on (:data:`mpikv.transport.cuda.FALLBACK`). The retry
    is right when the error came before any data moved, as when MPI refuses
    the buffer while checking its arguments (every rank checks alike); if
    ranks fail differently, the collective timeout ends the job instead of
    a hang.

    Args:
        detect: ``() -> mpikv.transport.cuda.Decision`` (default :func:`mpikv.transport.cuda.detect`).
        fallback: a :class:`mpikv.transport.cuda.Fallback` (default: :data:`mpikv.transport.cuda.FALLBACK`
            at each call, so the process shares one record).
        stager: the :class:`Stager` (default: a new one).
        mpi_errors: exception classes that mean "MPI refused" (default
            :func:`mpi_errors` at each call).
        piece_bytes: staged buffers of more bytes go in pieces of this many,
            when the call asks for pieces (:mod:`mpikv.transport.pipeline`); 0:
            whole buffers always.
    """

    def __init__(self, detect=None, fallback=None, stager=None, mpi_errors=None,
                 piece_bytes=DEFAULT_STAGING_PIECE):
        #: Pieces of a staged buffer asked for in pieces (:meth:`run`), in bytes;
        #: 0: whole buffers. Must be the same on every rank (the store agrees on it).
        self.piece_bytes = piece_bytes
        self._detect = cuda.detect if detect is None else detect
        self._fallback = fallback
        self.stager = Stager() if stager is None else stager
        self._errors = None if mpi_errors is None else tuple(mpi_errors)
        self._decision = None
        self._lock = threading.Lock()

    @property
    def fallback(self):
        """The :class:`mpikv.transport.cuda.Fallback` this staging records into."""
        return cuda.FALLBACK if self._fallback is None else self._fallback

    @property
    def decision(self):
        """The :class:`mpikv.transport.cuda.Decision`, made at the first use."""
        decision = self._decision
        if decision is None:
            with self._lock:  # the caller's and the worker's thread may both ask first
                if self._decision is None:
                    self._decision = self._detect()
                decision = self._decision
        return decision

    @property
    def direct(self):
        """Whether device buffers go to MPI as they are (CUDA-aware, no fallback yet)."""
        return bool(self.decision.aware) and not self.fallback.happened

    def run(self, fn, dst, src=None, copy_in=True, copy_back=True, host_only=False,
            pieces=False):
        """Runs the blocking MPI work ``fn(dst, src)``, on device buffers or on host copies.

        Host buffers go straight through. Staged, a device ``src`` is copied
        to a host buffer, and ``dst`` is lent as a host copy (copied in when
        there is no ``src`` and ``copy_in``; copied back after ``fn`` when
        ``copy_back`` and ``fn`` did not raise). Either way, on return a
        device ``dst`` is written for every stream.

        With ``pieces``, a staged buffer of more than :attr:`piece_bytes` goes
        in pieces, ``fn`` once per piece, the copies of other pieces
        overlapping it (:func:`mpikv.transport.pipeline.pipelined`). Only for
        work that is elementwise over the buffer. Host and direct buffers of
        that size go in the same pieces: a rank whose buffer is on the host
        makes as many MPI calls as a rank whose buffer is staged.

        Args:
            fn: the MPI work on flat contiguous buffers; only blocking calls.
            dst: a flat device (or host) array: the result.
            src: a flat array ``fn`` only reads, or None (in place).
            copy_in, copy_back: see :meth:`Stager.staged`; False where MPI
                only writes (a non-root ``Bcast``) or only reads (a non-root
                ``Reduce``) ``dst``.
            host_only: ``fn`` must get host buffers whatever MPI takes.
            pieces: ``fn`` is elementwise (``Allreduce``, ``Reduce``, ``Bcast``
                of one layout): a large staged buffer may go in pieces.

        Returns:
            what ``fn`` returns; in pieces, the list of what it returned for each.
        """
        dev_dst, dev_src = is_device(dst), src is not None and is_device(src)
        cut = pieces and wants_pieces(dst.nbytes, self.piece_bytes)
        if not (dev_dst or dev_src):
            return self._in_pieces(fn, dst, src) if cut else fn(dst, src)
        if not host_only and self.direct:
            for buf, dev in ((dst, dev_dst), (src, dev_src)):
                if dev:
                    synchronize(buf)
            try:
                return self._in_pieces(fn, dst, src) if cut else fn(dst, src)
            except (mpi_errors() if self._errors is None else self._errors) as exc:
                self._refused(exc)
        if cut:
            return pipelined(self.stager, fn, dst, src, dev_dst, dev_src,
                             copy_in and src is None, copy_back, self.piece_bytes)
        return self._staged(fn, dst, src, dev_dst, dev_src, copy_in, copy_back)

    def _in_pieces(self, fn, dst, src):
        """``fn`` over the pieces that staging would cut (the same MPI calls)."""
        return [fn(dst[a:b], None if src is None else src[a:b])
                for a, b in piece_ranges(dst.size, dst.itemsize, self.piece_bytes)]

    def _refused(self, exc):
        reason = f"{type(exc).__name__}: {exc}"
        if self.fallback.record(reason):
            _log.warning("MPI failed on a device buffer (%s); staging device buffers "
                         "through host memory for the rest of this process. Set "
                         "%s=0 to stage from the start.", reason, cuda.ENV)

    def _staged(self, fn, dst, src, dev_dst, dev_src, copy_in, copy_back):
        st = self.stager
        host_src = st.to_host(src) if dev_src else src
        try:
            if not dev_dst:
                return fn(dst, host_src)
            with st.staged(dst, copy_in=copy_in and src is None,
                           copy_back=copy_back) as host_dst:
                return fn(host_dst, host_src)
        finally:
            if dev_src:
                st.release(host_src)

    def describe(self):
        """:func:`mpikv.transport.cuda.describe` once decided, else ``"no device buffer yet"``."""
        decision = self._decision
        if decision is None:
            return "no device buffer yet"
        return cuda.describe(decision, self.fallback)


# -- host buffers ------------------------------------------------------------
class Stager:
    """Pinned host buffers that carry device buffers through a host-only MPI.

    Buffers are pooled per dtype and reused: a call takes a free buffer with
    enough elements (replacing a too-small one), so the pool holds as many
    buffers per dtype as calls were ever staged at once.

    ``with stager.staged(dev) as host: mpi_call(host)`` synchronises the
    device, copies ``dev`` into ``host``, runs the body, copies ``host``
    back into ``dev`` and waits for that copy.

    Args:
        empty_pinned: ``(size, dtype) -> numpy array`` for new host buffers
            (default: ``cupyx.empty_pinned`` if importable, else
            ``numpy.empty``: pinned memory makes the copies DMA transfers).
    """

    def __init__(self, empty_pinned=None):
        self._empty_pinned = empty_pinned
        self._lock = threading.Lock()
        self._free = {}    # dtype -> [1-D host buffer]
        self._busy = {}    # id(view handed out) -> (dtype, buffer, view)
        self.allocations = 0

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
            # By position, not list.remove: that compares arrays with ==, elementwise.
            fits = [i for i, b in enumerate(pool) if b.size >= size]
            if fits:
                base = pool.pop(min(fits, key=lambda i: pool[i].size))
            else:
                if pool:  # too small for this call: let it go rather than hoard it
                    pool.pop(max(range(len(pool)), key=lambda i: pool[i].size))
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
        synchronize(dev_flat)
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
            stream = module_of(dev_flat).cuda.get_current_stream()
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


# -- handing GPU work to another thread ------------------------------------
class _WorkerGPU:
    """The worker's side of :func:`handover`: the caller's GPU, streams of its own
    that wait for the caller's events, a final wait.

    The worker issues its kernels and copies on a non-blocking stream of its
    own on each GPU the call touches, so its waits (before each MPI call, and at
    the end) do not wait for unrelated kernels the caller queues meanwhile, as
    cupy's default (legacy) stream would make them. Each stream first waits
    (on the GPU, not the host) for the event the caller recorded there.
    """

    __slots__ = ("_cp", "_device", "_devices", "_events", "_entered")
    _streams = {}  # (stream class, thread id, GPU id) -> the worker's stream there

    def __init__(self, cp, device_id, devices, events):
        self._cp = cp
        self._device = cp.cuda.Device(device_id)
        self._devices = sorted(set(devices) | {device_id})
        self._events = events
        self._entered = []

    def __enter__(self):
        self._device.__enter__()
        cp = self._cp
        for device in self._devices:
            # (the class: a test process may use cupy and a stand-in of it in turn)
            key = (cp.cuda.Stream, threading.get_ident(), device)
            with cp.cuda.Device(device):
                stream = self._streams.get(key)
                if stream is None:
                    stream = self._streams[key] = cp.cuda.Stream(non_blocking=True)
                event = self._events.get(device)
                if event is not None:
                    stream.wait_event(event)   # after the caller's writers, on the GPU
                stream.__enter__()
            self._entered.append((device, stream))
        return self

    def __exit__(self, *exc):
        cp = self._cp
        try:
            # The caller may touch the outputs and the store's memory, on any
            # stream, once the handle is done: wait on every GPU the call touched.
            for device, stream in self._entered:
                with cp.cuda.Device(device):
                    stream.synchronize()
        finally:
            for device, stream in reversed(self._entered):
                with cp.cuda.Device(device):
                    stream.__exit__(*exc)
            self._entered = []
            self._device.__exit__(*exc)


def handover(arrays, on_gpu=False, gpus=()):
    """Prepares GPU work made in this thread to run in a worker thread, without
    blocking this thread.

    cupy's current device and stream are per thread, and MPI knows no
    streams. So, in the calling thread, this records an event on the current
    stream of every GPU the call touches (the call's arrays' GPUs and
    ``gpus``, where the store keeps values): the point after their writers,
    the caller's earlier calls among them. It returns a context for the worker
    that makes the caller's current GPU current there, issues the worker's
    work on streams of its own that wait for those events (a wait on the GPU:
    the host goes on), and, on exit, waits for the worker's streams on each of
    those GPUs, so the work is done when the handle is.

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
    events = {}
    for device in sorted(devices):
        with cp.cuda.Device(device):
            events[device] = cp.cuda.get_current_stream().record()
    return _WorkerGPU(cp, cp.cuda.Device().id, devices, events)


__all__ = ["Staging", "Stager", "handover", "mpi_errors", "NONBLOCKING_ON_DEVICE"]
