"""The cupy stand-in (tests/fakecupy.py) is honest: what a GPU would get wrong, it gets wrong.

Each test is a rule of CUDA that a store bug could break unseen on a stand-in
that ran kernels at once and handed host pointers to MPI (issue 26).
"""

import ctypes
import threading

import numpy as np
import pytest

from .. import fakecupy


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.delenv(fakecupy.AWARE_ENV, raising=False)
    return fakecupy.install(monkeypatch)


def _at(pointer, like):
    """What the host reads at a device pointer, as ``like``'s dtype."""
    raw = (ctypes.c_char * like.nbytes).from_address(pointer)
    return np.frombuffer(raw, like.dtype).copy()


def test_the_pointer_mpi_gets_is_poison_unless_mpi_is_cuda_aware(cp, monkeypatch):
    a = cp.full(4, 3, cp.float32)
    a.get()  # written
    got = _at(a.__cuda_array_interface__["data"][0], np.zeros(4, np.float32))
    assert np.isnan(got).all()          # a host-only MPI would sum NaNs
    ints = cp.full(2, 5, cp.int64)
    ints.get()
    assert _at(ints.__cuda_array_interface__["data"][0], np.zeros(2, np.int64)).tolist() == [-1, -1]
    monkeypatch.setenv(fakecupy.AWARE_ENV, "1")
    assert _at(a.__cuda_array_interface__["data"][0], np.zeros(4, np.float32)).tolist() == [3] * 4


def test_writes_through_the_poison_pointer_are_lost(cp):
    a = cp.zeros(3, cp.float64)
    a.get()
    raw = (ctypes.c_double * 3).from_address(a.__cuda_array_interface__["data"][0])
    raw[0] = 42.0   # a host-only MPI "receiving" into device memory
    assert a.get().tolist() == [0, 0, 0]


def test_handing_mpi_an_empty_view_of_unfinished_memory_is_no_race(cp):
    """No byte is read: an empty block's pointer (Scatterv, Reduce_scatter) is harmless."""
    a = cp.zeros(3, cp.float32)
    a += 1
    a[1:1].__cuda_array_interface__
    assert fakecupy.races() == []
    a[1:2].__cuda_array_interface__
    assert fakecupy.races()
    cp.cuda.get_current_stream().synchronize()


def test_kernels_run_late(cp):
    a = cp.zeros(3, cp.float32)
    a += 1
    assert fakecupy.pending() > 0
    # A CUDA-aware MPI reading now sees memory before the kernels ran.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fakecupy.AWARE_ENV, "1")
        assert np.isnan(_at(a.__cuda_array_interface__["data"][0], np.zeros(3, np.float32))).all()
    assert fakecupy.races()          # ... and it is recorded
    cp.cuda.get_current_stream().synchronize()
    assert fakecupy.pending() == 0 and a.get().tolist() == [1, 1, 1]


def test_the_legacy_stream_is_one_per_device_for_every_thread(cp):
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(s=cp.cuda.get_current_stream()))
    thread.start()
    thread.join()
    assert seen["s"] is cp.cuda.get_current_stream()
    with cp.cuda.Device(1):
        assert cp.cuda.get_current_stream() is not seen["s"]


def test_a_non_blocking_stream_is_not_ordered_after_the_legacy_stream(cp):
    a = cp.zeros(4, cp.float32)
    a += 2                               # queued on the legacy stream
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        b = a * 10                       # reads a before the += ran
    side.synchronize()
    assert b.get().tolist() != [20] * 4
    assert fakecupy.races()


def test_an_event_orders_a_side_stream(cp):
    a = cp.zeros(4, cp.float32)
    a += 2
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        b = a * 10
    side.synchronize()
    assert b.get().tolist() == [20] * 4 and fakecupy.races() == []


def test_a_blocking_stream_waits_for_the_legacy_stream(cp):
    a = cp.zeros(4, cp.float32)
    a += 2
    blocking = cp.cuda.Stream()
    with blocking:
        b = a * 10
    blocking.synchronize()
    assert b.get().tolist() == [20] * 4 and fakecupy.races() == []


def test_peer_copies_are_ordered_on_the_destination_stream_only(cp):
    with cp.cuda.Device(1):
        src = cp.zeros(4, cp.float32)
        src += 3                         # queued on GPU 1
    copied = src.copy()                  # on GPU 0's stream: nothing waits for GPU 1
    assert copied.device.id == 0
    assert copied.get().tolist() != [3] * 4 and fakecupy.races()


def test_a_peer_copy_after_an_event_is_right(cp):
    with cp.cuda.Device(1):
        src = cp.zeros(4, cp.float32)
        src += 3
        done = cp.cuda.Event()
        done.record()
    cp.cuda.get_current_stream().wait_event(done)
    assert src.copy().get().tolist() == [3] * 4 and fakecupy.races() == []


def test_new_memory_is_garbage_until_its_kernel_runs(cp):
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        a = cp.ones(2, cp.float32)       # the fill is queued on the side stream
    assert np.isnan(a.get()).all()       # a get on the legacy stream does not wait for it
    side.synchronize()
    assert a.get().tolist() == [1, 1]


def test_dlpack_on_cuda_round_trips_and_numpy_refuses_it(cp):
    a = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    assert a.__dlpack_device__() == (fakecupy.DLPACK_CUDA, 0)
    with pytest.raises((RuntimeError, BufferError, TypeError, ValueError)):
        np.from_dlpack(a)

    class Producer:   # another library's CUDA array, through its capsule
        def __dlpack_device__(self):
            return a.__dlpack_device__()

        def __dlpack__(self, **kwargs):
            return a.__dlpack__(**kwargs)
    b = cp.from_dlpack(Producer())
    b[0, 0] = 9
    assert b.shape == (2, 3) and a.get().tolist() == [[9, 1, 2], [3, 4, 5]]
    assert b.base is a.base              # the same memory, found from the pointer


def test_from_dlpack_takes_host_memory_labelled_cuda_and_refuses_cpu(cp):
    host = np.arange(4, dtype=np.int32)

    class FakeCudaTensor:   # what a test double of a CUDA torch tensor may hand out
        def __dlpack_device__(self):
            return (fakecupy.DLPACK_CUDA, 1)

        def __dlpack__(self, stream=None, max_version=None, **kwargs):
            return fakecupy.dlpack_capsule(host, 1, max_version=max_version)
    d = cp.from_dlpack(FakeCudaTensor())
    assert d.device.id == 1 and d.get().tolist() == [0, 1, 2, 3]
    with cp.cuda.Device(1):
        d += 1
        cp.cuda.get_current_stream().synchronize()
    assert host.tolist() == [1, 2, 3, 4]     # the producer's memory, no copy
    with pytest.raises(TypeError):
        cp.from_dlpack(np.zeros(2))


def test_mpi4py_takes_the_dlpack_pointer(cp, monkeypatch):
    MPI = pytest.importorskip("mpi4py.MPI")
    a = cp.full(3, 2, cp.float64)
    a.get()
    out = np.zeros(3)
    MPI.COMM_SELF.Allreduce(a, out)      # not staged, MPI not CUDA-aware: poison
    assert np.isnan(out).all()
    monkeypatch.setenv(fakecupy.AWARE_ENV, "1")
    MPI.COMM_SELF.Allreduce(a, out)
    assert out.tolist() == [2, 2, 2]


def test_refilling_host_memory_an_unfinished_copy_still_reads_is_a_race(cp):
    """A pinned buffer copied up asynchronously must not be refilled (by a copy down
    on another stream) before that copy ran: the copy up would take the new values."""
    up, down = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    first, second = cp.full(3, 1.0), cp.full(3, 2.0)
    target = cp.zeros(3)
    cp.cuda.get_current_stream().synchronize()
    host = np.full(3, 7.0)
    target.set(host, stream=up)                          # reads host when it runs
    assert fakecupy.host_busy(host) and not fakecupy.host_busy(np.zeros(3))
    second.get(stream=down, out=host, blocking=False)    # refills host: not after the copy up
    assert any("host memory" in r and "still reads" in r for r in fakecupy.races())
    down.synchronize()
    up.synchronize()
    assert target.tolist() == [2.0] * 3                  # the wrong value a GPU may give
    assert not fakecupy.host_busy(host)
    # Ordered by an event, the same refill is no race and the copy up keeps its values.
    before = len(fakecupy.races())
    host[...] = 7.0
    target.set(host, stream=up)
    down.wait_event(up.record())
    first.get(stream=down, out=host, blocking=False)
    down.synchronize()
    assert target.tolist() == [7.0] * 3 and host.tolist() == [1.0] * 3
    assert fakecupy.races()[before:] == []
