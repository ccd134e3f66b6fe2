"""Keys a checkpoint load creates behave like keys made by ``init``, at any rank count."""

import os

import numpy as np
import pytest

import mpikv
from mpikv import errors, optimizer

from .conftest import raises_everywhere

pytestmark = pytest.mark.mpi

INTS = np.arange(5, dtype=np.int32)
FLOATS = np.full(6, 2.0, np.float32)


def _push_int_key(kv, comm):
    return raises_everywhere(comm, errors.OptimizerError,
                             lambda: kv.push("i", np.ones(INTS.shape, np.int32)))


@pytest.mark.parametrize("optimizer_from", ["set_optimizer", "file"])
@pytest.mark.parametrize("bound", [1_000_000, 4], ids=["whole", "split"])
def test_int_key_loaded_from_a_checkpoint_is_refused_like_one_made_by_init(make_store, 
        comm, shared_dir, bound, optimizer_from):
    path = os.path.join(shared_dir, "ckpt")
    kv = make_store(bigarray_bound=bound)
    kv.init(["i", "w"], [INTS, FLOATS])
    if optimizer_from == "file":
        kv.set_optimizer(optimizer.SGD(learning_rate=0.1))
    kv.save_checkpoint(path)
    if optimizer_from != "file":
        kv.set_optimizer(optimizer.SGD(learning_rate=0.1))
    want = _push_int_key(kv, comm)  # the key was made by init
    assert "key 'i' holds integers" in want

    fresh = make_store(bigarray_bound=bound)
    fresh.load_checkpoint(path)  # creates both keys
    if optimizer_from != "file":
        fresh.set_optimizer(optimizer.SGD(learning_rate=0.1))
    assert _push_int_key(fresh, comm) == want

    # Nothing was applied, and the float key is still updated by the optimizer.
    fresh.push("w", np.ones(FLOATS.shape, np.float32))
    out = np.zeros(FLOATS.shape, np.float32)
    fresh.pull("w", out=out)
    np.testing.assert_allclose(out, FLOATS - np.float32(0.1) * comm.size, rtol=1e-6)
    ints = np.zeros(INTS.shape, np.int32)
    fresh.pull("i", out=ints)
    np.testing.assert_array_equal(ints, INTS)


def test_a_save_that_fails_on_one_rank_leaves_no_part_behind(comm, kv, tmp_path_factory,
                                                              monkeypatch):
    import os

    from mpikv import statefile
    base = comm.bcast(str(tmp_path_factory.mktemp("orphan")) if comm.rank == 0 else None)
    path = os.path.join(base, "ck")
    keys = [f"k{i}" for i in range(8)]  # every rank owns some, so every rank writes a part
    kv.init(keys, [np.ones(3)] * len(keys))
    kv.save_checkpoint(path)
    comm.Barrier()
    before = sorted(os.listdir(path + ".parts"))
    if comm.rank == comm.size - 1:  # the disk fills up under this rank only
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(statefile, "write_part", full)
    message = raises_everywhere(comm, mpikv.StateFileError, lambda: kv.save_checkpoint(path))
    assert "No space left on device" in message
    comm.Barrier()
    assert sorted(os.listdir(path + ".parts")) == before  # the previous save, whole


@pytest.mark.parametrize("bound", [1_000_000, 4], ids=["whole", "split"])
def test_a_strict_load_refuses_keys_the_store_does_not_hold(make_store, comm, shared_dir, bound):
    """``strict=True`` (the Trainer's): a file with keys the store lacks is one
    StateFileError on every rank, nothing loaded; without it they are created."""
    path = os.path.join(shared_dir, "ckpt")
    kv = make_store(bigarray_bound=bound)
    kv.init(["w", "extra"], [FLOATS, FLOATS + 1])
    kv.save_checkpoint(path)
    small = make_store(bigarray_bound=bound)
    small.init("w", np.zeros_like(FLOATS))
    message = raises_everywhere(comm, errors.StateFileError,
                                lambda: small.load_checkpoint(path, strict=True))
    assert "holds 1 key(s) this store does not: 'extra' (another model's checkpoint?)" in message
    out = np.ones_like(FLOATS)
    small.pull("w", out=out)
    np.testing.assert_array_equal(out, 0)   # nothing loaded
    raises_everywhere(comm, errors.UnknownKeyError, lambda: small.pull("extra", out=out))
    small.load_checkpoint(path)   # not strict: "extra" is made from the file
    small.pull("w", out=out)
    np.testing.assert_array_equal(out, FLOATS)
    small.pull("extra", out=out)
    np.testing.assert_array_equal(out, FLOATS + 1)
