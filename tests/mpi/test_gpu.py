"""GPU values through ``dist_sync_device`` stores: what a GPU machine must pass.

Each test runs three ways:

* ``cupy``: real cupy on a real GPU (skipped where cupy is missing or sees
  no GPU, as in CI); the MPI library's CUDA-awareness is detected.
* ``stand-in-staged`` and ``stand-in-direct``: ``tests/fakecupy.py``, a CPU
  stand-in that keeps cupy's rules (no implicit host conversion, no mixing of
  host and device arrays, operands on the current device) with
  ``MPIKV_CUDA_AWARE=0`` (staged through host buffers) and ``=1`` (the
  "device" pointer goes straight to MPI). They check mpikv's device code
  paths on machines without a GPU; they say nothing about CUDA itself.

Each rank uses GPU ``rank % device_count``. Values are checked on the host.
Run: ``scripts/mpirun.sh -n 2 python -m pytest tests/mpi/test_gpu.py --with-mpi``.
"""

import numpy as np
import pytest

from mpikv.arrays import backends
from mpikv import optimizer
from mpikv.transport import cuda

from .. import fakecupy
from .conftest import TEST_TIMEOUT

pytestmark = pytest.mark.mpi

@pytest.fixture
def gkv(cp, make_store):
    return make_store("dist_sync_device")


def _tri(n):
    return n * (n + 1) // 2  # the sum of rank + 1 over n ranks


def test_push_pull(cp, comm, gkv):
    n, r = comm.size, comm.rank
    gkv.init(3, cp.full((2, 3), 5, cp.float32))
    out = cp.zeros((2, 3), cp.float32)
    gkv.pull(3, out=out)
    assert out.get().tolist() == [[5] * 3] * 2
    gkv.push(3, cp.full((2, 3), r + 1, cp.float32))
    gkv.pull(3, out=out)
    assert isinstance(out, cp.ndarray)
    np.testing.assert_array_equal(out.get(), np.full((2, 3), _tri(n), np.float32))


def test_device_list_is_summed(cp, comm, gkv):
    n, r = comm.size, comm.rank
    gkv.init("w", cp.zeros(4, cp.float64))
    gkv.push("w", [cp.full(4, r + 1, cp.float64) for _ in range(3)])
    outs = [cp.empty(4, cp.float64) for _ in range(2)]
    gkv.pull("w", out=outs)
    for o in outs:
        assert o.get().tolist() == [3 * _tri(n)] * 4


def test_pushpull_in_place_and_into_out(cp, comm, gkv):
    n, r = comm.size, comm.rank
    gkv.init([0, 1], [cp.zeros(5, cp.float32), cp.zeros((2, 2), cp.int64)])
    a = cp.full(5, r + 1, cp.float32)
    b = cp.full((2, 2), 2 * (r + 1), cp.int64)
    gkv.pushpull([0, 1], [a, b])
    assert a.get().tolist() == [_tri(n)] * 5
    assert b.get().tolist() == [[2 * _tri(n)] * 2] * 2
    out = cp.zeros(5, cp.float32)
    gkv.pushpull(0, cp.ones(5, cp.float32), out=out)
    assert out.get().tolist() == [n] * 5


def test_float16_summed_in_float32(cp, comm, gkv):
    gkv.init(7, cp.zeros(3, cp.float16))
    value = cp.asarray(np.array([2048, 1, 0.5], np.float16)) if comm.rank == 0 else \
        cp.asarray(np.array([1, 1, 0.5], np.float16))
    out = cp.zeros(3, cp.float16)
    gkv.pushpull(7, value, out=out)
    ranks = comm.size
    want = np.array([2048 + (ranks - 1), ranks, 0.5 * ranks], np.float32).astype(np.float16)
    np.testing.assert_array_equal(out.get(), want)


def test_split_array(make_store, cp, comm):
    kv = make_store("dist_sync_device", bigarray_bound=10)
    n, r = comm.size, comm.rank
    kv.init("big", cp.zeros(1001, cp.float32))
    kv.push("big", cp.arange(1001, dtype=cp.float32) * (r + 1))
    out = cp.empty(1001, cp.float32)
    kv.pull("big", out=out)
    np.testing.assert_array_equal(out.get(), np.arange(1001, dtype=np.float32) * _tri(n))


def test_sgd_on_device_weights(cp, comm, gkv):
    n = comm.size
    gkv.init("w", cp.ones((3, 3), cp.float32))
    gkv.set_optimizer(optimizer.SGD(learning_rate=0.1))
    gkv.push("w", cp.ones((3, 3), cp.float32))
    w = cp.empty((3, 3), cp.float32)
    gkv.pull("w", out=w)
    np.testing.assert_allclose(w.get(), np.full((3, 3), 1 - 0.1 * n, np.float32), rtol=1e-6)


def test_host_out_from_device_store(cp, comm, gkv):
    gkv.init(9, cp.full(2, 4, cp.float32))
    out = np.zeros(2, np.float32)
    gkv.pull(9, out=out)
    assert out.tolist() == [4, 4]


def test_torch_cuda_tensors(cp, comm, gkv):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    gkv.init("t", torch.zeros(4, device=device))
    grad = torch.full((4,), float(comm.rank + 1), device=device)
    gkv.pushpull("t", grad)  # written back into the tensor, no copy to the host for the user
    assert grad.cpu().tolist() == [float(_tri(comm.size))] * 4


def test_decision_is_reported(comm):
    facts = cuda.describe()
    assert facts["device_path"] in ("direct", "staged")
    assert isinstance(facts["cuda_aware_mpi_source"], str)


def test_async_calls_on_this_ranks_gpu(cp, comm, gkv):
    # The worker thread must run on the caller's GPU (cupy's current device is
    # per thread) and hand results back only once its stream is done.
    n, r = comm.size, comm.rank
    keys = ["a", "b"]
    gkv.init(keys, [cp.zeros(6, cp.float32), cp.zeros((2, 2), cp.float64)])
    grads = [cp.full(6, r + 1, cp.float32), cp.full((2, 2), 2 * (r + 1), cp.float64)]
    outs = [cp.empty(6, cp.float32), cp.empty((2, 2), cp.float64)]
    before = fakecupy.allocated() if getattr(cp, "STAND_IN", False) else None
    handles = [gkv.pushpull_async(keys, grads, out=outs), gkv.pull_async("a", out=grads[0])]
    gkv.wait(handles)
    if before is not None:  # nothing was put on another rank's GPU
        grew = {d for d, b in fakecupy.allocated().items() if b != before.get(d, 0)}
        assert grew <= {cp.cuda.Device().id}, grew
    assert outs[0].get().tolist() == [_tri(n)] * 6
    assert outs[1].get().tolist() == [[2 * _tri(n)] * 2] * 2
    assert grads[0].get().tolist() == [_tri(n)] * 6
    assert grads[0].device.id == cp.cuda.Device().id
    if before is not None:  # done means done: no output still being written
        assert not any(fakecupy.unfinished(a) for a in outs + grads)


def test_optimizers_on_device_match_host(make_store, cp, comm):
    # The same steps on a host store and a device store give the same weights.
    r = comm.rank
    rng = np.random.default_rng(7)
    shapes = {"w": (4, 5), "big": (1003,), "b": (3,)}
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    steps = [{k: rng.standard_normal(s).astype(np.float32) * (r + 1) for k, s in shapes.items()}
             for _ in range(3)]
    for opt in ("sgd", "nag", "adam", "adamw", "rmsprop", "lamb"):
        kwargs = {"momentum": 0.9} if opt in ("sgd", "nag") else {}
        got = {}
        for where in ("host", "device"):
            kv = make_store("dist_sync_device", bigarray_bound=100)
            put = (lambda a: cp.asarray(a)) if where == "device" else (lambda a: a.copy())
            keys = sorted(shapes)
            kv.init(keys, [put(init[k]) for k in keys])
            kv.set_optimizer(optimizer.create(opt, learning_rate=0.05, wd=0.01, **kwargs))
            for grads in steps:
                kv.push(keys, [put(grads[k]) for k in keys])
            outs = [put(np.empty(shapes[k], np.float32)) for k in keys]
            kv.pull(keys, out=outs)
            got[where] = [o.get() if where == "device" else o for o in outs]
        for host, dev in zip(got["host"], got["device"]):
            np.testing.assert_allclose(dev, host, rtol=2e-5, atol=1e-6, err_msg=opt)


def test_checkpoint_round_trip_of_gpu_values(make_store, cp, comm, tmp_path_factory):
    r = comm.rank
    path = comm.bcast(str(tmp_path_factory.mktemp("ckpt") / "gpu.ckpt") if r == 0 else None)
    kv = make_store("dist_sync_device", bigarray_bound=10)
    kv.init(["w", "v"], [cp.ones(25, cp.float32), cp.zeros((2, 3), cp.float64)])
    kv.set_optimizer(optimizer.Adam(learning_rate=0.1))
    kv.push(["w", "v"], [cp.full(25, r + 1.0, cp.float32), cp.ones((2, 3), cp.float64)])
    kv.save_checkpoint(path)
    kv.push(["w", "v"], [cp.ones(25, cp.float32), cp.ones((2, 3), cp.float64)])
    want = [cp.empty(25, cp.float32), cp.empty((2, 3), cp.float64)]
    kv.pull(["w", "v"], out=want)

    fresh = make_store("dist_sync_device", bigarray_bound=10)
    fresh.load_checkpoint(path)  # keys come from the file, onto this rank's GPU
    fresh.push(["w", "v"], [cp.ones(25, cp.float32), cp.ones((2, 3), cp.float64)])
    got = [cp.empty(25, cp.float32), cp.empty((2, 3), cp.float64)]
    fresh.pull(["w", "v"], out=got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.get(), w.get())
    assert fresh.optimizer_state_nbytes() == kv.optimizer_state_nbytes()

    host = make_store(bigarray_bound=10)
    host.load_checkpoint(path)  # the same file, on the host
    host.push(["w", "v"], [np.ones(25, np.float32), np.ones((2, 3), np.float64)])
    out = [np.empty(25, np.float32), np.empty((2, 3), np.float64)]
    host.pull(["w", "v"], out=out)
    for o, w in zip(out, want):
        np.testing.assert_allclose(o, w.get(), rtol=1e-6)


class _RefusingComm:
    """A communicator whose data collectives raise an MPI error on device buffers,
    as a library built CUDA-aware but unable to use the GPU at run time does."""

    COLLECTIVES = ("Allreduce", "Reduce", "Bcast", "Allgatherv", "Reduce_scatter")

    def __init__(self, comm, cp):
        self._comm, self._cp = comm, cp

    def _device(self, arg):
        if isinstance(arg, list) and arg:
            arg = arg[0]
        return isinstance(arg, self._cp.ndarray)

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self.COLLECTIVES:
            return attr

        def call(*args, **kwargs):
            if any(self._device(a) for a in args):
                from mpi4py import MPI
                raise MPI.Exception(MPI.ERR_BUFFER)
            return attr(*args, **kwargs)
        return call


def test_refused_device_buffers_fall_back_to_staging(cp, comm, caplog):
    # A library believed CUDA-aware that refuses device buffers (an MPI error,
    # on every rank alike) costs one warning, not the job: calls are staged.
    if not getattr(cp, "STAND_IN", False) or cuda.detect().aware is not True:
        pytest.skip("needs the stand-in with MPIKV_CUDA_AWARE=1")
    from mpikv.store import config
    from mpikv.tuning import table as tuning
    from mpikv.store.kvstore import KVStore
    from mpikv.transport.mpi import MPITransport

    class RefusingTransport(MPITransport):
        def __init__(self, comm, options):
            super().__init__(comm, options)
            self.comm = _RefusingComm(self.comm, cp)

    options = config.resolve(timeout=TEST_TIMEOUT, autotune=False)
    kv = KVStore("dist_sync_device", RefusingTransport(comm, options), options,
                 tuning.forced("allreduce", "test"))
    kv.init("w", cp.zeros(4, cp.float32))
    value = cp.full(4, comm.rank + 1, cp.float32)
    kv.pushpull("w", value)
    kv.pushpull("w", value)
    assert value.get().tolist() == [comm.size * _tri(comm.size)] * 4
    facts = cuda.describe()
    assert facts["device_path"] == "staged" and facts["device_fallback"] is True
    assert "MPI_ERR_BUFFER" in facts["device_fallback_reason"]
    assert "MPI failed on a device buffer" in caplog.text


def test_float16_device_list_summed_in_float32(cp, comm, gkv):
    # Several GPUs' float16 gradients are summed in float32 on the store's GPU.
    gkv.init("h", cp.zeros(2, cp.float16))
    big = cp.asarray(np.array([2048, 1], np.float16))
    ones = cp.ones(2, cp.float16)
    out = cp.zeros(2, cp.float16)
    gkv.pushpull("h", [big, ones, ones], out=out)
    n = comm.size
    want = np.array([n * 2050, 3 * n], np.float32).astype(np.float16)
    np.testing.assert_array_equal(out.get(), want)


@pytest.mark.parametrize("store", ["local", "device", "dist_sync", "dist_sync_device"])
def test_every_store_type_takes_gpu_values(make_store, cp, comm, store):
    n, r = comm.size, comm.rank
    workers = 1 if store in ("local", "device") else n
    tri = r + 1 if workers == 1 else _tri(n)  # a local store sums only its own values
    kv = make_store(store)
    keys = ["a", "b"]
    kv.broadcast(keys, [cp.full(3, 7 + r, cp.float32), cp.zeros((2, 2), cp.float64)],
                 out=[cp.empty(3, cp.float32), cp.empty((2, 2), cp.float64)])
    first = cp.empty(3, cp.float32)
    kv.pull("a", out=first)
    assert first.get().tolist() == [7 if workers > 1 else 7 + r] * 3  # rank 0's, or its own
    grads = [[cp.full(3, r + 1, cp.float32)] * 2, cp.full((2, 2), r + 1, cp.float64)]
    outs = [cp.empty(3, cp.float32), cp.empty((2, 2), cp.float64)]
    kv.pushpull(keys, grads, out=outs)
    assert outs[0].get().tolist() == [2 * tri] * 3
    assert outs[1].get().tolist() == [[tri] * 2] * 2
    kv.set_optimizer(optimizer.SGD(learning_rate=0.5))
    kv.push("b", cp.ones((2, 2), cp.float64))
    kv.pull("b", out=outs[1])
    assert outs[1].get().tolist() == [[tri - 0.5 * workers] * 2] * 2
    bufs = kv.gradient_buffers(keys)
    assert all(backends.is_device(b) == ("device" in store) for b in bufs)
    for b in bufs:
        b[...] = 2
    kv.push(keys, bufs)
    kv.pull("a", out=first)
    assert first.get().tolist() == [2 * tri - 0.5 * 2 * workers] * 3


def test_store_on_one_gpu_values_on_another(make_store, cp, comm):
    # Keys initialised while GPU 1 was current live there; later calls made
    # with GPU 0 current, on GPU 0 values, must still work on GPU 1's memory.
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    n, r = comm.size, comm.rank
    kv = make_store("dist_sync_device", bigarray_bound=10)
    with cp.cuda.Device(1):
        kv.init(["w", "big"], [cp.ones(4, cp.float32), cp.zeros(30, cp.float32)])
    with cp.cuda.Device(0):
        kv.pushpull(["w", "big"], [cp.full(4, r + 1, cp.float32), cp.ones(30, cp.float32)])
        kv.set_optimizer(optimizer.Adam(learning_rate=0.1))
        grads = [cp.ones(4, cp.float32), [cp.ones(30, cp.float32), cp.ones(30, cp.float32)]]
        kv.wait(kv.push_async(["w", "big"], grads))
        outs = [cp.empty(4, cp.float32), cp.empty(30, cp.float32)]
        kv.pull(["w", "big"], out=outs)
    # The store's work buffers and optimizer states are on its GPU, not the caller's.
    assert {buf.device.id for buf in kv._engine.layouts.scratch_buffers()} == {1}
    assert {a.device.id for owned in kv.owned_states(["w", "big"]).values()
            for part in owned.parts if part.state is not None
            for name, a in part.state.items() if name != "t"} <= {1}
    # Adam's first step moves each weight by -lr (the gradient's sign).
    np.testing.assert_allclose(outs[0].get(), np.full(4, _tri(n) - 0.1, np.float32), rtol=1e-5)
    np.testing.assert_allclose(outs[1].get(), np.full(30, n - 0.1, np.float32), rtol=1e-5)


def test_async_handles_wait_for_every_gpu_they_touch(make_store, cp, comm):
    # Outputs on two GPUs, and a store on a GPU that is not the caller's: the
    # handle is done only when every GPU's work is, and the worker starts only
    # once the caller's earlier writes into the store's memory have finished.
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    n = comm.size
    kv = make_store("dist_sync_device")
    with cp.cuda.Device(1):
        kv.init("w", cp.zeros(4, cp.float32))
    with cp.cuda.Device(0):
        kv.push("w", cp.ones(4, cp.float32))          # inline: writes GPU 1's memory
        handle = kv.pushpull_async("w", cp.ones(4, cp.float32))
        out0 = cp.empty(4, cp.float32)
        with cp.cuda.Device(1):
            out1 = cp.empty(4, cp.float32)
        kv.wait([handle, kv.pull_async("w", out=[out0, out1])])
        if getattr(cp, "STAND_IN", False):
            assert not fakecupy.unfinished(out0) and not fakecupy.unfinished(out1)
        assert out0.get().tolist() == out1.get().tolist() == [n] * 4


# -- issue 26: placement and ordering ------------------------------------------------
def _other_gpu(cp, comm):
    count = cp.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip("needs two GPUs")
    return (comm.rank + 1) % count   # not the current GPU (rank % count)


def test_keys_live_on_the_gpu_of_their_first_value(make_store, cp, comm):
    # model.to(f"cuda:{i}") sets no current GPU: a key's memory goes with its value.
    n, r = comm.size, comm.rank
    gpu = _other_gpu(cp, comm)
    kv = make_store("dist_sync_device", bigarray_bound=10)
    with cp.cuda.Device(gpu):
        values = [cp.full(4, 2, cp.float32), cp.zeros(30, cp.float32)]
    kv.init(["w", "big"], values)
    assert {kv._engine.entries[k].arena.device.id for k in ("w", "big")} == {gpu}
    with cp.cuda.Device(gpu):
        grads = [cp.full(4, r + 1, cp.float32), cp.ones(30, cp.float32)]
    kv.pushpull(["w", "big"], grads)
    assert grads[0].get().tolist() == [_tri(n)] * 4 and grads[1].get().tolist() == [n] * 30
    assert grads[0].device.id == gpu
    assert {buf.device.id for buf in kv._engine.layouts.scratch_buffers()} <= {gpu}


@pytest.mark.parametrize("call", ["push", "pushpull", "sgd"])
def test_values_from_another_gpu_are_read_after_their_writers(make_store, cp, comm, call):
    # The store's GPU is not the value's: the copy between them must come after the
    # kernel that wrote the value on its own GPU's stream (no synchronisation here).
    n, r = comm.size, comm.rank
    gpu = _other_gpu(cp, comm)
    kv = make_store("dist_sync_device")
    kv.init(["a", "b"], [cp.zeros(5, cp.float32), cp.zeros(3, cp.float64)])
    if call == "sgd":
        kv.set_optimizer(optimizer.SGD(learning_rate=1.0, rescale_grad=1.0))
    with cp.cuda.Device(gpu):
        a, b = cp.zeros(5, cp.float32), cp.zeros(3, cp.float64)
        a += r + 1   # kernels queued on the other GPU's stream, not waited for
        b += 2 * (r + 1)
    outs = [cp.empty(5, cp.float32), cp.empty(3, cp.float64)]
    if call == "pushpull":
        kv.pushpull(["a", "b"], [a, b], out=outs)
    else:
        kv.push(["a", "b"], [a, b])
        kv.pull(["a", "b"], out=outs)
    sign = -1 if call == "sgd" else 1
    assert outs[0].get().tolist() == [sign * _tri(n)] * 5
    assert outs[1].get().tolist() == [sign * 2 * _tri(n)] * 3


@pytest.mark.parametrize("call", ["pull", "pushpull", "broadcast"])
def test_sync_calls_return_outputs_complete_for_every_stream(cp, comm, gkv, call):
    # A synchronous call's device outputs are written when it returns: a kernel on a
    # non-blocking stream (torch's side streams, say) reads them without waiting.
    n, r = comm.size, comm.rank
    gkv.init(["a", "b"], [cp.full(6, 7, cp.float32), cp.full((2, 2), 7, cp.float64)])
    outs = [cp.zeros(6, cp.float32), cp.zeros((2, 2), cp.float64)]
    if call == "pull":
        want = 7
        gkv.pull(["a", "b"], out=outs)
    elif call == "pushpull":
        want = _tri(n)
        gkv.pushpull(["a", "b"], [cp.full(6, r + 1, cp.float32),
                                  cp.full((2, 2), r + 1, cp.float64)], out=outs)
    else:
        want = 5
        gkv.broadcast(["c", "d"], [cp.full(6, 5 + r, cp.float32),
                                   cp.full((2, 2), 5 + r, cp.float64)], out=outs)
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        got = [o * 1 for o in outs]
    side.synchronize()
    assert got[0].get().tolist() == [want] * 6
    assert got[1].get().tolist() == [[want] * 2] * 2


@pytest.mark.parametrize("where", ["host", "device"])
def test_fused_push_of_the_stores_own_values_swapped(make_store, cp, comm, where):
    # The inputs are views of the memory the sum is gathered into: overlaps of device
    # views are found by memory ranges, as for host arrays, and the bucket is gathered
    # elsewhere first.
    n = comm.size
    kv = make_store("dist_sync_device" if where == "device" else "dist_sync")
    make = cp if where == "device" else np
    kv.init(["a", "b"], [make.full(4, 1, np.float32), make.full(4, 2, np.float32)])
    va, vb = kv.value_buffers(["a", "b"])
    kv.push(["a", "b"], [vb, va])   # a <- n * b, b <- n * a
    outs = [make.zeros(4, np.float32), make.zeros(4, np.float32)]
    kv.pull(["a", "b"], out=outs)
    got = [o.get() if where == "device" else o for o in outs]
    assert got[0].tolist() == [2 * n] * 4 and got[1].tolist() == [n] * 4


def test_the_stand_in_poisons_device_buffers_a_host_only_mpi_gets(cp, comm):
    # What the store must never do: hand a device buffer to an MPI that cannot read
    # GPU memory. The stand-in makes that a wrong sum, as a GPU would (or worse).
    if not getattr(cp, "STAND_IN", False):
        pytest.skip("the stand-in's rule")
    a = cp.full(4, comm.rank + 1, cp.float64)
    cp.cuda.get_current_stream().synchronize()
    out = np.zeros(4)
    comm.Allreduce(a, out)
    if cuda.detect().aware:
        assert out.tolist() == [_tri(comm.size)] * 4
    else:
        assert np.isnan(out).all()


@pytest.mark.parametrize("how", ["pushpull", "pushpull_async"])
def test_a_big_key_with_kernels_queued_before_each_call(make_store, cp, comm, how):
    # 50 kernels write the value before each call and nobody waits for them: the
    # sum must be exact. 64 KiB here; tests/gpu/test_stream_race.py is the 256 MiB
    # stress for a real GPU.
    n, r = comm.size, comm.rank
    size = (64 << 10) // 4
    kv = make_store("dist_sync_device")
    kv.init("big", cp.zeros(size, cp.float32))
    grad = cp.zeros(size, cp.float32)
    for step in range(2):
        grad.fill(r)
        for _ in range(50):
            grad += 1
        if how == "pushpull":
            kv.pushpull("big", grad)
        else:
            kv.wait(kv.pushpull_async("big", grad))
        # every rank's 50 + r, summed
        want = 50 * n + _tri(n) - n
        assert float(grad[0]) == want and float(grad[-1]) == want
        assert int((grad != want).sum()) == 0
