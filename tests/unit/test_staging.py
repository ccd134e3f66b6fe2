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

from mpikv.arrays import xp as _xp
from mpikv.store import config
from mpikv import reducers
from mpikv.tuning import table as tuning
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


# -- staging in pieces (mpikv/transport/pipeline.py) ----------------------------------
from mpikv.transport import pipeline as _pipeline  # noqa: E402


def _piecewise(log, mode="inplace"):
    """A fake elementwise MPI call over 2 ranks for :meth:`Staging.run` in pieces.

    It checks, as MPI would need, that no queued copy still writes or reads
    the host buffers it gets, and logs ``(values it read, sizes)``. ``mode``:
    "inplace" (an Allreduce: x -> 3x + 1), "recv" (a Bcast receiver: writes
    the running element index), "send" (a Reduce sender: only reads), "src"
    (out of place: dst = 2 src).
    """
    def fn(d, s):
        for host in (d, s):
            if isinstance(host, np.ndarray):
                assert not fakecupy.host_busy(host), "MPI got a host buffer still being copied"
        fakecupy.mark("mpi")
        offset = sum(len(got) for got, _ in log)
        if mode == "inplace":
            log.append((d.copy(), d.size))
            d *= 3
            d += 1
        elif mode == "recv":
            log.append((np.arange(offset, offset + d.size).astype(d.dtype), d.size))
            d[...] = log[-1][0]
        elif mode == "send":
            log.append((d.copy(), d.size))
        else:
            log.append((s.copy(), s.size))
            d[...] = s * 2
        return d.size
    return fn


def _staged_in_pieces(stager, piece_bytes):
    staging = _policy(stager, False)
    staging.piece_bytes = piece_bytes
    return staging


@pytest.mark.parametrize("size,itemsize,piece", [
    (10, 4, 16), (12, 4, 16), (1, 8, 16), (3, 2, 1), (1000, 2, 64), (5, 4, 4096), (0, 4, 16)])
def test_pieces_cover_the_buffer_exactly(size, itemsize, piece):
    ranges = _pipeline.piece_ranges(size, itemsize, piece)
    step = max(1, piece // itemsize)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a == b for (_, a), (b, _) in zip(ranges, ranges[1:]))   # no gap, no overlap
    last = ranges[-1][1] - ranges[-1][0]
    assert all(b - a == step for a, b in ranges[:-1]) and (0 < last <= step or size == 0)
    assert len(ranges) == max(1, -(-size // step))


def test_only_buffers_above_the_piece_go_in_pieces():
    assert _pipeline.wants_pieces(17, 16) and not _pipeline.wants_pieces(16, 16)
    assert not _pipeline.wants_pieces(1 << 30, 0)   # 0: whole buffers always


DTYPES = [np.float16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 7, 8, 9, 61])   # pieces of 8 bytes: 1 to 31 pieces
def test_in_pieces_equals_the_whole_buffer_bit_for_bit(cp, fake, dtype, size):
    stager, device, _ = fake
    piece = 8
    data = (np.random.default_rng(size).standard_normal(size) * 100).astype(dtype)
    whole, split = device(data), device(data)
    whole_log, split_log = [], []
    _staged_in_pieces(stager, 0).run(_piecewise(whole_log), whole, pieces=True)
    got = _staged_in_pieces(stager, piece).run(_piecewise(split_log), split, pieces=True)
    step = piece // np.dtype(dtype).itemsize
    ranges = _pipeline.piece_ranges(size, np.dtype(dtype).itemsize, piece)
    if len(ranges) == 1:   # one piece: the whole-buffer path, one call
        assert got == size and [n for _, n in split_log] == [size]
    else:
        assert got == [b - a for a, b in ranges] and all(n <= step for _, n in split_log)
    # MPI read each piece's values after the copy down, and the result is bitwise the same.
    assert np.concatenate([v for v, _ in split_log]).tobytes() == data.tobytes()
    assert split.get().tobytes() == whole.get().tobytes()
    assert fakecupy.races() == [] and fakecupy.pending() == 0
    assert not fakecupy.unfinished(split)


def _copies_and_calls():
    return [e for e in fakecupy.events() if e in ("d2h", "h2d", "mpi")]


def test_in_pieces_order_overlaps_the_next_copy_with_mpi(cp, fake):
    stager, device, _ = fake
    dev = device(np.arange(12, dtype=np.float32))      # three pieces of 16 bytes
    log = []
    _staged_in_pieces(stager, 16).run(_piecewise(log), dev, pieces=True)
    # The copy down of piece k+1 is queued before MPI works on piece k; piece k's copy
    # up right after it; the host waits only at the end.
    assert _copies_and_calls() == ["d2h", "d2h", "mpi", "h2d", "d2h", "mpi", "h2d", "mpi", "h2d"]
    assert dev.tolist() == [3 * x + 1 for x in range(12)] and fakecupy.races() == []
    # On two side streams of their own, not the caller's.
    down, up = set(fakecupy.event_streams("d2h")), set(fakecupy.event_streams("h2d"))
    assert len(down) == 1 and len(up) == 1 and down != up
    assert all(s.non_blocking and s is not cp.cuda.get_current_stream() for s in down | up)
    assert stager.pooled() == {"float32": [4, 4]}     # two slots of one piece each, returned


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_pieces_bcast_receiver_waits_for_each_slot_to_be_copied_up(cp, fake, dtype):
    stager, device, _ = fake
    dev = device(np.full(21, -5, dtype))
    log = []
    _staged_in_pieces(stager, 16).run(_piecewise(log, "recv"), dev, copy_in=False, pieces=True)
    assert "d2h" not in fakecupy.events()
    # Without a wait, MPI's write of piece k+2 would overwrite the slot before piece k's
    # copy up ran: piece k would get piece k+2's values.
    assert dev.get().tolist() == np.arange(21).astype(dtype).tolist()
    assert fakecupy.races() == [] and fakecupy.pending() == 0


def test_in_pieces_reduce_sender_copies_nothing_back(cp, fake):
    stager, device, _ = fake
    data = np.arange(10, dtype=np.float64)
    dev = device(data)
    log = []
    _staged_in_pieces(stager, 16).run(_piecewise(log, "send"), dev, copy_back=False, pieces=True)
    assert "h2d" not in fakecupy.events() and [n for _, n in log] == [2] * 5
    assert np.concatenate([v for v, _ in log]).tolist() == data.tolist()
    assert dev.tolist() == data.tolist() and fakecupy.races() == []


def test_in_pieces_out_of_place_copies_the_input_down(cp, fake):
    stager, device, _ = fake
    src, dst = device(np.arange(9, dtype=np.float32)), device(np.zeros(9, np.float32))
    log = []
    _staged_in_pieces(stager, 8).run(_piecewise(log, "src"), dst, src, pieces=True)
    assert np.concatenate([v for v, _ in log]).tolist() == list(range(9))
    assert dst.tolist() == [2 * x for x in range(9)] and src.tolist() == list(range(9))
    assert fakecupy.races() == [] and fakecupy.pending() == 0


def test_in_pieces_only_when_asked_and_the_same_pieces_everywhere(cp, fake):
    """Not asked: whole. Asked: staged, direct and host buffers all go in the same
    pieces, so ranks whose buffers live in different places make the same MPI calls."""
    stager, device, _ = fake
    dev = device(np.ones(8, np.float32))
    staging = _staged_in_pieces(stager, 8)
    assert staging.run(_allreduce(), dev) == "host"             # not asked: whole
    assert fakecupy.events().count("d2h") == 1
    aware = _policy(stager, True)
    aware.piece_bytes = 8
    assert aware.run(_allreduce(), dev, pieces=True) == ["device"] * 4   # 32 bytes
    assert dev.tolist() == [4] * 8
    host = np.ones(8, np.float32)
    assert staging.run(_allreduce(), host, pieces=True) == ["host"] * 4
    assert staging.run(_allreduce(), host) == "host"


def test_in_pieces_body_raises_waits_for_queued_copies(cp, fake):
    stager, device, _ = fake
    dev = device(np.arange(6, dtype=np.float32))
    calls = []

    def fn(d, _s):
        calls.append(d.size)
        if len(calls) == 2:
            raise FakeMPIError("MPI_ERR_TRUNCATE")
        d *= 10
    with pytest.raises(FakeMPIError):
        _staged_in_pieces(stager, 8).run(fn, dev, pieces=True)
    # Piece 0 holds its result, the rest the old values; nothing left queued on the slots.
    assert dev.tolist() == [0, 10, 2, 3, 4, 5] and fakecupy.pending() == 0
    assert stager.pooled() == {"float32": [2, 2]} and fakecupy.races() == []


def test_a_missing_wait_before_mpi_gives_a_wrong_value(cp, fake, monkeypatch):
    """The stand-in runs copies late: MPI reading a slot without waiting for its copy
    down reads stale memory (so the tests above would catch a missing wait)."""
    stager, device, _ = fake
    monkeypatch.setattr(fakecupy.Event, "synchronize", lambda self: None)
    dev = device(np.arange(8, dtype=np.float32))
    log = []
    with pytest.raises(AssertionError, match="still being copied"):
        _staged_in_pieces(stager, 8).run(_piecewise(log), dev, pieces=True)


def test_a_missing_wait_before_refilling_a_slot_gives_a_wrong_value(cp, fake, monkeypatch):
    """Without the side stream's wait for a slot's copy up, the next copy down
    refills it first: the earlier piece gets a later piece's values."""
    stager, device, _ = fake
    honest = fakecupy.Stream.wait_event

    def forgetful(stream, event):   # drops only the waits for the other side stream
        op = event._op
        if stream.non_blocking and op is not None and op.stream.non_blocking:
            return None
        return honest(stream, event)
    monkeypatch.setattr(fakecupy.Stream, "wait_event", forgetful)
    dev = device(np.arange(12, dtype=np.float32))
    seen = []

    def fn(d, _s):   # an Allreduce that does not look (the checks above would)
        seen.append(fakecupy.host_busy(d))
        d *= 3
        d += 1
    _staged_in_pieces(stager, 16).run(fn, dev, pieces=True)
    assert dev.tolist() != [3 * x + 1 for x in range(12)]
    assert dev.tolist()[:4] == [3 * x + 1 for x in range(8, 12)]   # piece 0 got piece 2's
    assert seen == [False, False, True]
    assert any("host memory" in r for r in fakecupy.races())


def _counting_transport(monkeypatch, piece):
    mpi = pytest.importorskip("mpi4py.MPI")
    from mpikv.transport.mpi import MPITransport
    monkeypatch.setenv("MPIKV_CUDA_AWARE", "0")
    return MPITransport(mpi.COMM_SELF, config.resolve(timeout=30, staging_piece=piece))


def test_transport_stages_elementwise_calls_in_pieces(cp, monkeypatch):
    transport = _counting_transport(monkeypatch, 16)
    try:
        assert transport.staging.piece_bytes == transport.pull_staging.piece_bytes == 16
        dev = cp.asarray(np.arange(10, dtype=np.float32))   # 40 bytes: 3 pieces
        for call in (lambda: transport.allreduce_(dev, ("t", [])),
                     lambda: transport.reduce_(dev, 0, ("t", [])),
                     lambda: transport.bcast_(dev, 0, ("t", []))):
            before = fakecupy.events().count("d2h")
            call()
            assert fakecupy.events().count("d2h") - before == 3
        before = fakecupy.events().count("d2h")
        transport.allgatherv_(dev, [10], [0], ("t", []))      # per-rank blocks: whole
        assert fakecupy.events().count("d2h") - before == 1
        assert dev.tolist() == list(range(10)) and fakecupy.races() == []
    finally:
        transport.close()


def test_staged_reducer_asks_for_pieces_only_for_elementwise_allreduce(cp, fake):
    from mpikv.reducers.allreduce import AllreduceReducer
    from mpikv.reducers.base import even_blocks
    from mpikv.reducers.reduce_scatter import ReduceScatterReducer
    stager, device, _ = fake

    class Doubling(SimpleNamespace):
        size, rank = 2, 0

        def allreduce_(self, buf, what):
            fakecupy.mark("mpi")
            buf *= 2
    staging = _staged_in_pieces(stager, 16)
    red = StagedReducer(AllreduceReducer(Doubling(), 1 << 20), staging)
    assert red.inner.elementwise and not ReduceScatterReducer(Doubling(), 1).elementwise
    dev = device(np.arange(10, dtype=np.float32))
    red.allreduce(dev, None, ("t", []))
    assert fakecupy.events().count("mpi") == 3 and dev.tolist() == [2 * x for x in range(10)]
    before = fakecupy.events().count("mpi")
    red.reduce_to_owners(dev, None, even_blocks(10, 2), ("t", []))   # blocks: whole
    assert fakecupy.events().count("mpi") - before == 1 and fakecupy.races() == []


def test_staging_piece_option():
    assert config.resolve(environ={}).staging_piece == _pipeline.DEFAULT_STAGING_PIECE == 4 << 20
    assert config.resolve(environ={"MPIKV_STAGING_PIECE": "0"}).staging_piece == 0
    assert config.resolve(staging_piece=65536,
                          environ={"MPIKV_STAGING_PIECE": "0"}).staging_piece == 65536
    with pytest.raises(ValueError, match="MPIKV_STAGING_PIECE"):
        config.resolve(environ={"MPIKV_STAGING_PIECE": "-1"})
