"""multi_precision=True: float16 and bfloat16 values with float32 master copies on the owners.

Every optimizer, step by step at 1-4 ranks, against the same optimizer run in
float32 on one process: the stored 16-bit values are the float32 weights
rounded once, exactly. The masters survive a checkpoint resumed on another
number of ranks.
"""

import numpy as np
import pytest

from mpikv import optimizer as opt


pytestmark = pytest.mark.mpi

DTYPES = ["float16"]
try:
    import ml_dtypes
    DTYPES.append("bfloat16")
except ImportError:   # the bf16 extra is not installed: float16 only
    ml_dtypes = None

OPTIMIZERS = {
    "sgd": lambda **kw: opt.SGD(learning_rate=0.05, momentum=0.9, wd=0.01, **kw),
    "nag": lambda **kw: opt.NAG(learning_rate=0.05, momentum=0.9, **kw),
    "adam": lambda **kw: opt.Adam(learning_rate=0.01, wd=0.01, **kw),
    "adamw": lambda **kw: opt.AdamW(learning_rate=0.01, wd=0.01, **kw),
    "rmsprop": lambda **kw: opt.RMSProp(learning_rate=0.01, centered=True, **kw),
    "lamb": lambda **kw: opt.LAMB(learning_rate=0.01, wd=0.01, **kw),
}
SHAPES = {"small": (5,), "split": (40,)}   # split over the owners (bigarray_bound=16)
STEPS = 4


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def grad(rank, step, key, dtype):
    """k/64 values: exact in 16 bits, and their sums over ranks exact in float32."""
    n = int(np.prod(SHAPES[key]))
    k = (np.arange(n) * (rank + 3) + 7 * step + rank) % 97 - 48
    return (k / 64.0).astype(np.float32).astype(dtype).reshape(SHAPES[key])


def initial(key, dtype):
    n = int(np.prod(SHAPES[key]))
    return (1.0 + np.arange(n) / 32.0).astype(np.float32).astype(dtype).reshape(SHAPES[key])


def reference(name, dtype, contributors):
    """The float32 weights after each step (one process, whole arrays)."""
    updater = opt.get_updater(OPTIMIZERS[name]())
    weights = {k: initial(k, dtype).astype(np.float32) for k in SHAPES}
    after = []
    for step, ranks in enumerate(contributors):
        for k in SHAPES:
            total = sum(grad(r, step, k, dtype).astype(np.float32) for r in ranks)
            updater(k, total, weights[k])
        after.append({k: w.copy() for k, w in weights.items()})
    return after


def _pull(kv, dtype):
    out = [np.zeros(SHAPES[k], dtype) for k in SHAPES]
    kv.pull(list(SHAPES), out=out)
    return dict(zip(SHAPES, out))


def _assert_rounded(got, want32, dtype, where):
    for k in SHAPES:
        np.testing.assert_array_equal(got[k].view(np.uint16),
                                      want32[k].astype(dtype).view(np.uint16),
                                      err_msg=f"{where}, key {k}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_step_is_the_float32_step_rounded_once(make_store, comm, name, dtype):
    dt = _dtype(dtype)
    kv = make_store(bigarray_bound=16)
    kv.init(list(SHAPES), [initial(k, dt) for k in SHAPES])
    kv.set_optimizer(OPTIMIZERS[name](multi_precision=True))
    want = reference(name, dt, [range(comm.size)] * STEPS)
    for step in range(STEPS):
        kv.push(list(SHAPES), [grad(kv.rank, step, k, dt) for k in SHAPES])
        _assert_rounded(_pull(kv, dt), want[step], dt, f"step {step}")
    # The masters are states on the owners: 4 more bytes per element over all ranks,
    # beside the float32 moments; one 8-byte count per key or shard.
    states = comm.allreduce(kv.optimizer_state_nbytes())
    plain = OPTIMIZERS[name]()
    elements = sum(int(np.prod(s)) for s in SHAPES.values())
    shards = 1 + comm.size   # "small" whole, "split" over every rank
    assert states == elements * 4 * (len(plain.elementwise_state_names) + 1) + 8 * shards


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_multi_precision_small_updates_are_lost(make_store, comm, dtype):
    dt = _dtype(dtype)
    results = {}
    for mp in (False, True):
        kv = make_store()
        kv.init("w", np.ones(4, dt))
        # Each step moves the weight by 1e-4: under half a 16-bit step at 1.0.
        kv.set_optimizer(opt.SGD(learning_rate=1e-4 / comm.size, multi_precision=mp))
        for _ in range(50):
            kv.push("w", np.ones(4, dt))
        results[mp] = _pull_one(kv, dt)
    assert (results[False] == np.ones(4, dt)).all()           # each step rounded away
    assert (results[True].astype(np.float32) < 1.0).all()      # 50 steps kept in float32


def _pull_one(kv, dt):
    out = np.zeros(4, dt)
    kv.pull("w", out=out)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_masters_resume_on_another_number_of_ranks(make_store, comm, tmp_path_factory, name, dtype):
    dt = _dtype(dtype)
    path = comm.bcast(str(tmp_path_factory.mktemp("mp")) if comm.rank == 0 else None)
    kv = make_store(bigarray_bound=16)
    kv.init(list(SHAPES), [initial(k, dt) for k in SHAPES])
    kv.set_optimizer(OPTIMIZERS[name](multi_precision=True))
    for step in range(2):
        kv.push(list(SHAPES), [grad(kv.rank, step, k, dt) for k in SHAPES])
    kv.save_checkpoint(f"{path}/ck")
    # Resume on one rank fewer (one rank at 1), which goes on for two more steps.
    m = max(1, comm.size - 1)
    sub = comm.Split(0 if comm.rank < m else 1, comm.rank)
    if comm.rank < m:
        other = make_store(comm=sub, bigarray_bound=16)
        other.load_checkpoint(f"{path}/ck")
        for step in range(2, 4):
            other.push(list(SHAPES), [grad(other.rank, step, k, dt) for k in SHAPES])
        want = reference(name, dt, [range(comm.size)] * 2 + [range(m)] * 2)
        _assert_rounded(_pull(other, dt), want[-1], dt, f"resumed on {m} rank(s)")
    comm.Barrier()
