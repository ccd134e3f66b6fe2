"""bfloat16 values (ml_dtypes arrays and torch tensors) at 1-4 ranks: sums in float32,
rounded once, equal on every rank; split keys; exact in checkpoints."""

import numpy as np
import pytest

import mpikv


ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
pytestmark = pytest.mark.mpi


def contribution(rank, size, seed):
    """Each rank's bfloat16 values: random, with enough mantissa to round."""
    rng = np.random.default_rng(seed + rank)
    return rng.standard_normal(size).astype(np.float32).astype(BF16)


def reference(n, size, seed):
    """The float32 sum of every rank's bfloat16 values, in rank order, rounded once."""
    total = np.zeros(size, np.float32)
    for r in range(n):
        total += contribution(r, size, seed).astype(np.float32)
    return total.astype(BF16)


def check_sums(comm, kv, put, size, op):
    """Pushes each rank's bfloat16 values through ``put`` (host or GPU); checks the sum."""
    kv.init(["x", "f"], [put(np.zeros(size, BF16)), put(np.zeros(3, np.float32))])
    mine = put(contribution(kv.rank, size, seed=size))
    out = put(np.zeros(size, BF16))
    if op == "push_pull":
        kv.push(["x", "f"], [mine, put(np.ones(3, np.float32))])
        kv.pull("x", out=out)
    else:
        kv.pushpull("x", mine, out=out)
    assert out.dtype == BF16
    got = out if isinstance(out, np.ndarray) else out.get()
    want = reference(comm.size, size, seed=size)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    everyone = comm.allgather(got.tobytes())
    assert all(e == everyone[0] for e in everyone)


@pytest.mark.parametrize("size", [7, 300])   # 300: split over the owners (bound 100)
@pytest.mark.parametrize("op", ["push_pull", "pushpull"])
def test_bfloat16_sums_are_float32_sums_rounded_once(make_store, comm, size, op):
    kv = make_store(bigarray_bound=100)
    check_sums(comm, kv, lambda a: a, size, op)


def test_two_device_values_per_rank_sum_once(make_store, comm):
    kv = make_store()
    kv.init("x", np.zeros(5, BF16))
    a, b = contribution(kv.rank, 5, 1), contribution(kv.rank + 100, 5, 1)
    kv.push("x", [a, b])
    out = np.zeros(5, BF16)
    kv.pull("x", out=out)
    total = np.zeros(5, np.float32)
    for r in range(comm.size):
        total += contribution(r, 5, 1).astype(np.float32) + contribution(r + 100, 5, 1).astype(
            np.float32)
    np.testing.assert_array_equal(out.view(np.uint16), total.astype(BF16).view(np.uint16))


def test_torch_bfloat16_tensors_without_copies(make_store, comm):
    torch = pytest.importorskip("torch")
    kv = make_store()
    kv.init("t", torch.zeros(6, dtype=torch.bfloat16))
    mine = torch.from_numpy(contribution(kv.rank, 6, 2).view(np.int16)).view(torch.bfloat16)
    kv.pushpull("t", mine)   # the sum lands in the tensor itself
    want = reference(comm.size, 6, 2)
    np.testing.assert_array_equal(mine.view(torch.int16).numpy().view(np.uint16),
                                  want.view(np.uint16))


def test_bfloat16_values_and_adam_states_round_trip_a_checkpoint(make_store, comm,
                                                                 tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("bf16")) if comm.rank == 0 else None)
    kv = make_store(bigarray_bound=100)
    kv.init(["x", "y"], [contribution(0, 300, 3), contribution(0, 9, 4)])
    kv.set_optimizer(mpikv.optimizer.Adam(learning_rate=0.01))
    kv.push(["x", "y"], [contribution(kv.rank, 300, 5), contribution(kv.rank, 9, 6)])
    kv.save_checkpoint(f"{path}/ck")
    before = [np.zeros(300, BF16), np.zeros(9, BF16)]
    kv.pull(["x", "y"], out=before)
    other = make_store(bigarray_bound=100)
    other.load_checkpoint(f"{path}/ck")
    after = [np.zeros(300, BF16), np.zeros(9, BF16)]
    other.pull(["x", "y"], out=after)
    for b, a in zip(before, after):
        assert a.dtype == BF16
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_torch_bfloat16_without_ml_dtypes_is_an_error_on_every_rank(make_store, comm, monkeypatch):
    torch = pytest.importorskip("torch")
    from mpikv import dtypes
    from .conftest import raises_everywhere
    kv = make_store()
    if comm.rank == comm.size - 1:   # one rank lacks the package
        monkeypatch.setattr(dtypes, "BFLOAT16", None)
    message = raises_everywhere(comm, mpikv.DTypeError,
                                lambda: kv.init("t", torch.zeros(3, dtype=torch.bfloat16)))
    assert "bfloat16, which needs the ml_dtypes package (pip install mpikv[bf16])" in message
    assert message.endswith("nothing was applied")
    kv.init("t", np.zeros(3, BF16))   # nothing was created: the key is still free
