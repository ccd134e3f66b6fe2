"""bfloat16 values on GPUs at 1-4 ranks, the three ways of ``tests/mpi/test_gpu.py``.

The stand-in holds bfloat16 arrays as cupy 14 does but runs no kernel on
them, so these tests pass only if mpikv moves bfloat16 as raw 16 bits and
does every cast itself (:mod:`mpikv.arrays.halfbits`). Results must equal the host
path's, bit for bit: float32 sums rounded once, float32 master arithmetic.
"""

import numpy as np
import pytest


from . import test_multi_precision as mp
from .test_bfloat16 import check_sums, contribution
from .test_bfloat16 import reference as sum_reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
pytestmark = pytest.mark.mpi


def _bits(a):
    return (a.get() if not isinstance(a, np.ndarray) else a).view(np.uint16)


@pytest.mark.parametrize("size", [7, 300])   # 300: split over the owners (bound 100)
@pytest.mark.parametrize("op", ["push_pull", "pushpull"])
def test_device_bfloat16_sums_are_float32_sums_rounded_once(make_store, cp, comm, size, op):
    kv = make_store("dist_sync_device", bigarray_bound=100)
    check_sums(comm, kv, cp.asarray, size, op)


def test_several_gpus_bfloat16_values_are_summed_once(make_store, cp, comm):
    # Two values per rank (one per GPU), a host value among them: one float32 sum, one rounding.
    kv = make_store("dist_sync_device")
    kv.init("x", cp.zeros(5, BF16))
    a = cp.asarray(contribution(kv.rank, 5, 1))
    with cp.cuda.Device((comm.rank + 1) % cp.cuda.runtime.getDeviceCount()):
        b = cp.asarray(contribution(kv.rank + 100, 5, 1))
    host = contribution(kv.rank + 200, 5, 1)
    kv.push("x", [a, b, host])
    out = [cp.zeros(5, BF16), np.zeros(5, BF16)]
    kv.pull("x", out=out)
    total = np.zeros(5, np.float32)
    for r in range(comm.size):
        for extra in (0, 100, 200):
            total += contribution(r + extra, 5, 1).astype(np.float32)
    for o in out:
        np.testing.assert_array_equal(_bits(o), total.astype(BF16).view(np.uint16))


@pytest.mark.parametrize("name", list(mp.OPTIMIZERS))
def test_every_optimizer_on_device_bfloat16_is_the_float32_step_rounded_once(make_store, cp, comm,
                                                                             name):
    kv = make_store("dist_sync_device", bigarray_bound=16)
    kv.init(list(mp.SHAPES), [cp.asarray(mp.initial(k, BF16)) for k in mp.SHAPES])
    kv.set_optimizer(mp.OPTIMIZERS[name](multi_precision=True))
    want = mp.reference(name, BF16, [range(comm.size)] * mp.STEPS)
    for step in range(mp.STEPS):
        kv.push(list(mp.SHAPES), [cp.asarray(mp.grad(kv.rank, step, k, BF16)) for k in mp.SHAPES])
        outs = [cp.zeros(mp.SHAPES[k], BF16) for k in mp.SHAPES]
        kv.pull(list(mp.SHAPES), out=outs)
        got = {k: o.get() for k, o in zip(mp.SHAPES, outs)}
        mp._assert_rounded(got, want[step], BF16, f"step {step}")


def test_without_masters_each_step_is_rounded_as_on_the_host(make_store, cp, comm):
    # No master copy: the weight is widened, stepped in float32 and rounded every step.
    got = {}
    for where, put in (("host", lambda a: a), ("device", cp.asarray)):
        kv = make_store("dist_sync_device", bigarray_bound=16)
        kv.init(list(mp.SHAPES), [put(mp.initial(k, BF16)) for k in mp.SHAPES])
        kv.set_optimizer(mp.OPTIMIZERS["adam"]())
        for step in range(mp.STEPS):
            kv.push(list(mp.SHAPES), [put(mp.grad(kv.rank, step, k, BF16)) for k in mp.SHAPES])
        outs = [put(np.zeros(mp.SHAPES[k], BF16)) for k in mp.SHAPES]
        kv.pull(list(mp.SHAPES), out=outs)
        got[where] = [_bits(o) for o in outs]
    for host, dev in zip(got["host"], got["device"]):
        np.testing.assert_array_equal(dev, host)
    assert any((h != mp.initial(k, BF16).view(np.uint16).reshape(h.shape)).any()
               for h, k in zip(got["host"], mp.SHAPES))   # the steps did move the weights


def test_device_bfloat16_values_and_masters_round_trip_a_checkpoint(make_store, cp, comm,
                                                                    tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("gbf16")) if comm.rank == 0 else None)
    keys = list(mp.SHAPES)

    def store():
        kv = make_store("dist_sync_device", bigarray_bound=16)
        kv.init(keys, [cp.asarray(mp.initial(k, BF16)) for k in keys])
        kv.set_optimizer(mp.OPTIMIZERS["adam"](multi_precision=True))
        return kv

    def step(kv, s):
        kv.push(keys, [cp.asarray(mp.grad(kv.rank, s, k, BF16)) for k in keys])

    def pulled(kv):
        outs = [cp.zeros(mp.SHAPES[k], BF16) for k in keys]
        kv.pull(keys, out=outs)
        return [_bits(o) for o in outs]

    kv = store()
    step(kv, 0)
    kv.save_checkpoint(f"{path}/ck")
    step(kv, 1)
    other = store()
    other.load_checkpoint(f"{path}/ck")   # values, moments and float32 masters, exactly
    step(other, 1)
    for a, b in zip(pulled(kv), pulled(other)):
        np.testing.assert_array_equal(a, b)


def test_torch_cuda_bfloat16_tensors_without_copies(make_store, cp, comm):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or getattr(cp, "STAND_IN", False):
        pytest.skip("needs torch with CUDA and real cupy")
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    kv = make_store("dist_sync_device")
    kv.init("t", torch.zeros(6, dtype=torch.bfloat16, device=device))
    bits = torch.from_numpy(contribution(kv.rank, 6, 2).view(np.int16)).to(device)
    mine = bits.view(torch.bfloat16)
    kv.pushpull("t", mine)   # the sum lands in the tensor itself
    np.testing.assert_array_equal(mine.view(torch.int16).cpu().numpy().view(np.uint16),
                                  sum_reference(comm.size, 6, 2).view(np.uint16))
