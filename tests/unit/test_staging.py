"""GPU staging: the Stager's order and pool, the one Staging policy (direct, staged,
fallback), the reducers' use of it, and the worker-thread handover.

Device arrays are the CPU stand-in of cupy (tests/fakecupy.py): its event log
shows each synchronisation and host/device copy, in order, among the steps a
test marks (the MPI call).
"""

import logging
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpikv import _xp, config, reducers, tuning
from mpikv.transport import cuda
from mpikv.transport import staging as _staging
from mpikv.transport.staging import Stager, Staging
from mpikv.reducers.staged import StagedReducer

from .. import fakecupy


@pytest.fixture
def cp(monkeypatch):
    return fakecupy.install(monkeypatch)


@pytest.fixture
def fake(cp):
    """``(stager, device, allocated)``: a Stager counting its host buffers, and
    ``device(data)``, which puts numpy data on the stand-in GPU."""
    allocated = []

    def empty_pinned(size, dtype):
        allocated.append((size, np.dtype(dtype)))
        return np.empty(size, dtype)

    stager = Stager(empty_pinned=empty_pinned)
    return stager, cp.asarray, allocated


def _copied_back_on_the_current_stream(cp):
    """Each host-to-device copy ran on the stream the next wait is on."""
    return all(s is cp.cuda.get_current_stream() for s in fakecupy.event_streams("h2d"))


# -- the Stager -----------------------------------------------------------------------
def test_staged_order(cp, fake):
    stager, device, _ = fake
    dev = device(np.array([1.0, 2.0, 3.0], np.float32))

    def mpi(host):  # an in-place Allreduce over 2 ranks
        assert isinstance(host, np.ndarray) and host.tolist() == [1, 2, 3]
        fakecupy.mark("mpi")
        host *= 2
    with stager.staged(dev) as host:
        mpi(host)
    assert fakecupy.events() == ["sync", "d2h", "mpi", "h2d", "sync"]
    assert dev.tolist() == [2, 4, 6]
    assert _copied_back_on_the_current_stream(cp)


def test_staged_copy_flags(cp, fake):
    stager, device, _ = fake
    dev = device(np.zeros(2, np.int64))
    with stager.staged(dev, copy_in=False) as host:   # a Bcast receiver
        fakecupy.mark("mpi")
        host[:] = 7
    assert fakecupy.events() == ["mpi", "h2d", "sync"] and dev.tolist() == [7, 7]
    assert _copied_back_on_the_current_stream(cp)
    before = len(fakecupy.events())
    with stager.staged(dev, copy_back=False) as host:  # a Reduce sender
        fakecupy.mark("mpi")
        host[:] = 0
    assert fakecupy.events()[before:] == ["sync", "d2h", "mpi"] and dev.tolist() == [7, 7]


def test_staged_body_raises(fake):
    stager, device, _ = fake
    dev = device(np.ones(2))
    with pytest.raises(RuntimeError):
        with stager.staged(dev) as host:
            host[:] = 5
            raise RuntimeError("MPI failed")
    assert "h2d" not in fakecupy.events() and dev.tolist() == [1, 1]
    assert stager.pooled() == {"float64": [2]}  # the buffer came back


def test_stager_reuses_buffers(fake):
    stager, device, allocated = fake
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


def test_pool_takes_the_smallest_fit_among_several(fake):
    # Three buffers of one dtype in the pool; the fit is not the first one.
    stager, _, _ = fake
    held = [stager.acquire(np.float32, n) for n in (4, 8, 6)]
    for h in held:
        stager.release(h)
    got = stager.acquire(np.float32, 5)
    assert got.size == 5 and stager.pooled() == {"float32": [4, 8]}
    stager.release(got)
    big = stager.acquire(np.float32, 9)        # none fits: the largest goes, a new one comes
    assert big.size == 9 and stager.pooled() == {"float32": [4, 6]} and stager.allocations == 4


def test_nested_staging_gets_separate_buffers(fake):
    stager, device, allocated = fake
    a, b = device(np.ones(4)), device(np.full(4, 2.0))
    with stager.staged(a) as ha, stager.staged(b) as hb:
        assert not np.shares_memory(ha, hb)
        assert ha.tolist() == [1] * 4 and hb.tolist() == [2] * 4
    assert len(allocated) == 2 and stager.pooled() == {"float64": [4, 4]}


def test_to_host_and_to_device(cp, fake):
    stager, device, _ = fake
    dev = device(np.array([3, 4], np.int32))
    host = stager.to_host(dev)
    assert host.tolist() == [3, 4] and fakecupy.events() == ["sync", "d2h"]
    host += 1
    stager.to_device(host, dev)
    stager.release(host)
    assert dev.tolist() == [4, 5] and fakecupy.events()[2:] == ["h2d", "sync"]
    assert _copied_back_on_the_current_stream(cp)


def test_staging_needs_flat_buffers(fake):
    stager, device, _ = fake
    with pytest.raises(ValueError, match="flat"):
        with stager.staged(device(np.zeros((2, 2)))):
            pass


def test_default_host_allocator_without_cupy():
    if _xp.import_cupy() is not None:
        pytest.skip("cupy is installed: the default is cupyx.empty_pinned")
    stager = Stager()
    buf = stager.acquire(np.float32, 3)
    assert isinstance(buf, np.ndarray) and buf.size == 3 and stager.allocations == 1


# -- the policy -------------------------------------------------------------------------
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


def _policy(stager, aware, fallback=None):
    decision = aware if isinstance(aware, cuda.Decision) else cuda.Decision(aware, "test")
    return Staging(detect=lambda: decision, stager=stager, mpi_errors=(FakeMPIError,),
                   fallback=cuda.Fallback() if fallback is None else fallback)


def _allreduce(fail_on_device=0):
    """A fake in-place Allreduce over 2 ranks, as the transport runs it through
    :meth:`Staging.run`; raises on the first device buffers."""
    state = {"failures": fail_on_device}

    def fn(buf, _src):
        if not isinstance(buf, np.ndarray):
            if state["failures"]:
                state["failures"] -= 1
                fakecupy.mark("mpi-device-failed")
                raise FakeMPIError("MPI_ERR_BUFFER: invalid buffer pointer")
            fakecupy.mark("mpi-device")
            buf *= 2
            return "device"
        fakecupy.mark("mpi-host")
        buf *= 2
        return "host"
    return fn


def test_host_buffer_goes_straight_through(fake):
    stager, _, _ = fake
    host = np.ones(2)
    got = _policy(stager, True).run(_allreduce(), host)
    assert got == "host" and fakecupy.events() == ["mpi-host"] and host.tolist() == [2, 2]


def test_aware_synchronizes_then_passes_the_device_buffer(fake):
    stager, device, _ = fake
    dev = device(np.ones(2))
    got = _policy(stager, cuda.Decision(True, "test")).run(_allreduce(), dev)
    assert got == "device" and fakecupy.events() == ["sync", "mpi-device"]
    assert dev.tolist() == [2, 2]
    assert stager.allocations == 0


def test_not_aware_stages(cp, fake):
    stager, device, _ = fake
    dev = device(np.ones(2))
    got = _policy(stager, False).run(_allreduce(), dev)
    assert got == "host" and dev.tolist() == [2, 2]
    assert fakecupy.events() == ["sync", "d2h", "mpi-host", "h2d", "sync"]
    assert _copied_back_on_the_current_stream(cp)


def test_mpi_error_falls_back_once_for_good(cp, fake, records):
    stager, device, _ = fake
    fb = cuda.Fallback()
    staging = _policy(stager, True, fb)
    fn = _allreduce(fail_on_device=1)
    dev = device(np.ones(2))
    got = staging.run(fn, dev)
    assert got == "host" and dev.tolist() == [2, 2]
    assert fakecupy.events() == ["sync", "mpi-device-failed", "sync", "d2h", "mpi-host",
                                 "h2d", "sync"]
    assert _copied_back_on_the_current_stream(cp)
    assert fb.happened and "MPI_ERR_BUFFER" in fb.reason
    assert len(records) == 1 and records[0][0] == "WARNING"
    assert "staging device buffers through host memory" in records[0][1]
    assert "MPIKV_CUDA_AWARE=0" in records[0][1]
    # Later calls stage without trying the device buffer again, and log nothing.
    before = len(fakecupy.events())
    got = staging.run(fn, dev)
    assert got == "host" and "mpi-device" not in fakecupy.events()[before:] and len(records) == 1
    assert cuda.describe(cuda.Decision(True, "test"), fb)["device_path"] == "staged"
    assert staging.describe()["device_path"] == "staged" and not staging.direct


def test_other_errors_are_not_swallowed(fake):
    stager, device, _ = fake
    fb = cuda.Fallback()

    def fn(buf, _src):
        raise ValueError("a bug, not MPI")
    with pytest.raises(ValueError, match="a bug"):
        _policy(stager, True, fb).run(fn, device(np.ones(1)))
    assert not fb.happened


def test_failure_after_fallback_propagates(fake):
    stager, device, _ = fake
    fb = cuda.Fallback()

    def fn(buf, _src):
        raise FakeMPIError("MPI_ERR_OTHER")
    with pytest.raises(FakeMPIError):
        _policy(stager, True, fb).run(fn, device(np.ones(1)))
    assert fb.happened


def test_default_errors_come_from_loaded_mpi4py(monkeypatch):
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    assert _staging.mpi_errors() == ()
    mpi = pytest.importorskip("mpi4py.MPI")
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    assert _staging.mpi_errors() == (mpi.Exception,)


def test_default_fallback_is_the_process_record(monkeypatch):
    # Read at each call, so a store made before a test swaps FALLBACK still shares it.
    staging = Staging(detect=lambda: cuda.Decision(True, "test"))
    fb = cuda.Fallback()
    monkeypatch.setattr(cuda, "FALLBACK", fb)
    assert staging.fallback is fb
    fb.record("refused")
    assert not staging.direct


def test_decided_once_at_the_first_device_buffer(fake):
    stager, device, _ = fake
    asked = []

    def detect():
        asked.append(1)
        return cuda.Decision(False, "test")
    staging = Staging(detect=detect, stager=stager, fallback=cuda.Fallback())
    assert staging.describe() == "no device buffer yet"
    staging.run(_allreduce(), np.ones(2))
    assert asked == []                       # host buffers decide nothing
    for _ in range(3):
        staging.run(_allreduce(), device(np.ones(2)))
    assert asked == [1]
    assert staging.describe()["device_path"] == "staged"


# -- the reducers' side: the same Staging --------------------------------------------------
def _where(array):
    return "host" if isinstance(array, np.ndarray) else "device"


class _Inner:
    """A strategy that sums over 2 ranks (doubles), recording what it was given."""

    name = "fake"
    transport = SimpleNamespace(size=2)
    piece_bytes = 1 << 20

    def __init__(self, host_only=False, fail=0):
        self.host_only = host_only
        self.fail = fail
        self.got = []

    def allreduce(self, dst, src, what):
        self.got.append((_where(dst), None if src is None else _where(src)))
        if self.fail:
            self.fail -= 1
            raise FakeMPIError("MPI_ERR_BUFFER")
        fakecupy.mark("sum")
        if src is None:
            dst *= 2
        else:
            dst[...] = src * 2

    def reduce_to_owners(self, dst, src, blocks, what):
        self.allreduce(dst, src, what)


def test_staged_reducer_out_of_place_copies_only_the_input(cp, fake):
    stager, device, _ = fake
    inner = _Inner()
    red = StagedReducer(inner, _policy(stager, False))
    src, dst = device(np.arange(3.0)), device(np.full(3, -1.0))
    red.allreduce(dst, src, ("push", [1]))
    assert inner.got == [("host", "host")] and dst.tolist() == [0, 2, 4]
    assert src.tolist() == [0, 1, 2]
    # src comes down; dst is only written, so it goes up after the sum.
    assert fakecupy.events() == ["sync", "d2h", "sum", "h2d", "sync"]
    assert _copied_back_on_the_current_stream(cp)
    assert stager.pooled() == {"float64": [3, 3]}


def test_staged_reducer_in_place_and_to_owners(fake):
    stager, device, _ = fake
    red = StagedReducer(_Inner(), _policy(stager, False))
    dst = device(np.ones(4))
    red.reduce_to_owners(dst, None, None, ("push", [1]))
    assert dst.tolist() == [2] * 4
    assert fakecupy.events() == ["sync", "d2h", "sum", "h2d", "sync"]


def test_host_only_strategy_is_staged_even_when_aware(fake):
    stager, device, _ = fake
    inner = _Inner(host_only=True)
    red = StagedReducer(inner, _policy(stager, True))
    dst = device(np.ones(2))
    red.allreduce(dst, None, ("push", [1]))
    assert inner.got == [("host", None)] and dst.tolist() == [2, 2]


def test_staged_reducer_falls_back_and_warns_like_the_transport(fake, records):
    stager, device, _ = fake
    fb = cuda.Fallback()
    inner = _Inner(fail=1)
    red = StagedReducer(inner, _policy(stager, True, fb))
    dst = device(np.ones(2))
    red.allreduce(dst, None, ("push", [1]))
    assert inner.got == [("device", None), ("host", None)] and dst.tolist() == [2, 2]
    assert fb.happened and len(records) == 1 and "MPIKV_CUDA_AWARE=0" in records[0][1]


def _device_reducer(transport):
    table = tuning.forced("allreduce", "test")
    return reducers.Chooser(transport, table, 1 << 20).get(None, 64, True, device=True)


def test_chooser_stages_through_the_transports_staging():
    staging = Staging()
    transport = SimpleNamespace(staging=staging, size=1, rank=0)
    chooser = reducers.Chooser(transport, tuning.forced("allreduce", "test"), 1 << 20)
    assert chooser.get(None, 64, True, device=True).staging is staging
    assert chooser.get(None, 64, False, device=True).staging is staging  # copy+allreduce
    # A transport without one of its own (a local store's): the Chooser keeps one.
    alone = reducers.Chooser(SimpleNamespace(size=1, rank=0),
                             tuning.forced("allreduce", "test"), 1 << 20)
    first = alone.get(None, 64, True, device=True).staging
    assert isinstance(first, Staging)
    assert alone.get(None, 64, False, device=True).staging is first


def test_mpi_transport_and_its_chooser_share_one_staging():
    mpi = pytest.importorskip("mpi4py.MPI")
    from mpikv.transport.mpi import MPITransport
    transport = MPITransport(mpi.COMM_SELF, config.resolve(timeout=30))
    try:
        assert isinstance(transport.staging, Staging)
        assert _device_reducer(transport).staging is transport.staging
        assert transport.describe()["cuda"] == "no device buffer yet"
    finally:
        transport.close()


# -- handing GPU work to the worker thread (against the CPU stand-in of cupy) ---------
def test_handover_without_gpu_work(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert _staging.handover([np.ones(2)], on_gpu=True) is None  # no cupy: no GPU array
    fakecupy.install(monkeypatch)
    assert _staging.handover([np.ones(2)]) is None
    assert _staging.handover([np.ones(2)], on_gpu=True) is not None


def test_handover_orders_the_worker_after_the_caller_without_blocking(monkeypatch):
    cp = fakecupy.install(monkeypatch)
    with cp.cuda.Device(1):
        value = cp.ones(3)
        value += 1                     # still queued when the call is handed over
        caller = cp.cuda.get_current_stream()
        gpu = _staging.handover([value, np.zeros(3)])
    # The host did not wait (issue 26, item 7): the caller's kernels are still
    # queued; the worker's stream waits for them on the GPU, through an event.
    assert caller.synchronized == 0 and fakecupy.pending() > 0
    seen = {}

    def worker():
        with gpu:
            seen["device"] = cp.cuda.Device().id
            seen["stream"] = cp.cuda.get_current_stream()
            seen["sum"] = (value + 1).get(stream=cp.cuda.get_current_stream(),
                                          blocking=False)  # on GPU 1, where value lives
        seen["after"] = cp.cuda.Device().id

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["device"] == 1 and seen["after"] == 0 and seen["sum"].tolist() == [3, 3, 3]
    # The worker's own stream (not the default one, whose waits would include
    # the caller's later kernels), waited for before the handle is done.
    assert seen["stream"].non_blocking and seen["stream"] is not caller
    assert seen["stream"].synchronized == 1
    assert not fakecupy.unfinished(value) and fakecupy.races() == []
