"""mpikv.mxnet's errors: on every rank, the same class and message, nothing applied, the
store still usable, never a hang (under mpiexec, 1-4 ranks)."""

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")

import mpikv  # noqa: E402
import mpikv.mxnet  # noqa: E402
from mpikv.mxnet import ndarrays  # noqa: E402

from ..mpi.conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi


def _store(value=1.0):
    kv = mpikv.mxnet.create("dist_sync")
    kv.init(0, mx.nd.full((3,), value))
    return kv


def _value(kv, key=0, shape=(3,)):
    out = mx.nd.zeros(shape)
    kv.pull(key, out=out)
    return out.asnumpy()


@pytest.mark.parametrize("make", [lambda: mx.optimizer.AdaGrad(), lambda: mx.optimizer.Ftrl(),
                                  lambda: mx.optimizer.AdaDelta()],
                         ids=["AdaGrad", "Ftrl", "AdaDelta"])
def test_a_dtype_mxnets_own_optimizer_cannot_update(comm, make):
    """MXNet's AdaGrad, Ftrl, AdaDelta keep float32 states of a float16 weight and fail
    without multi_precision (in MXNet's own updater too): here an OptimizerError on
    every rank, nothing applied; float32 keys and multi_precision work."""
    kv = mpikv.mxnet.create("dist_sync")
    kv.init(0, mx.nd.full((3,), 1.0, dtype="float16"))
    kv.init(1, mx.nd.full((3,), 1.0))
    kv.set_optimizer(make())
    msg = raises_everywhere(comm, mpikv.OptimizerError,
                            lambda: kv.push(0, mx.nd.ones((3,), dtype="float16")))
    assert "cannot update float16 weights without multi_precision" in msg
    assert msg.endswith("nothing was applied")
    half = mx.nd.zeros((3,), dtype="float16")
    kv.pull(0, out=half)
    np.testing.assert_array_equal(half.asnumpy(), 1.0)
    kv.push(1, mx.nd.ones((3,)))                               # still usable
    assert (_value(kv, 1) < 1.0).all()
    opt = make()
    opt.multi_precision = True
    kv.set_optimizer(opt)
    kv.push(0, mx.nd.ones((3,), dtype="float16"))
    kv.pull(0, out=half)
    assert (half.asnumpy() < 1.0).all()


def test_different_optimizers_on_the_ranks(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    kv = _store()
    opt = mx.optimizer.Signum() if comm.rank == 1 else mx.optimizer.SGD()
    msg = raises_everywhere(comm, mpikv.MPIKVError, lambda: kv.set_optimizer(opt))
    assert "set_optimizer" in msg and "mxnet" in msg
    assert kv.kvstore.optimizer is None


def test_a_subclass_runs_and_a_string_is_refused(comm):
    class MySGD(mx.optimizer.SGD):
        pass
    kv = _store()
    kv.set_optimizer(MySGD(learning_rate=1.0))                  # MXNet runs it
    assert type(kv.kvstore.optimizer).__name__ == "MXNetRule"
    kv.push(0, mx.nd.ones((3,)))
    np.testing.assert_array_equal(_value(kv), 1.0 - comm.size)
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.set_optimizer("sgd"))
    assert "set_optimizer takes an mx.optimizer.Optimizer (or an mpikv.optimizer one), " \
           "not str" in msg


def test_an_unsupported_scheduler(comm):
    class Step(mx.lr_scheduler.LRScheduler):
        def __call__(self, num_update):
            return self.base_lr
    kv = _store()
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.set_optimizer(
        mx.optimizer.SGD(lr_scheduler=Step())))
    assert "the learning-rate scheduler" in msg and "Step is not supported" in msg
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1, warmup_steps=2)
    sched.base_lr = 0.2
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.set_optimizer(
        mx.optimizer.SGD(lr_scheduler=sched)))
    assert "warmup ends at 0.1 but its schedule starts at 0.2" in msg


def test_a_value_mpikv_refuses(comm):
    kv = _store()
    opt = mx.optimizer.SGD(learning_rate=0.5, momentum=1.5)
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.set_optimizer(opt))
    assert "momentum must be < 1.0, got 1.5" in msg


def test_a_bad_learning_rate_set_later(comm):
    """A Trainer's set_learning_rate(-1) reaches the push: an error on every rank, nothing
    applied; restored, the next push runs."""
    kv = _store()
    opt = mx.optimizer.SGD(learning_rate=0.5)
    kv.set_optimizer(opt)
    opt.set_learning_rate(-1.0)
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.push(0, mx.nd.ones((3,))))
    assert "optimizer: SGD hyperparameters: learning_rate must be >= 0.0, got -1.0" in msg
    np.testing.assert_array_equal(_value(kv), 1.0)
    opt.set_learning_rate(0.5)
    kv.pushpull(0, mx.nd.ones((3,)), out=mx.nd.zeros((3,)))
    np.testing.assert_array_equal(_value(kv), 1.0 - 0.5 * comm.size)


def test_a_learning_rate_changed_on_one_rank(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    kv = _store()
    opt = mx.optimizer.SGD(learning_rate=0.5)
    kv.set_optimizer(opt)
    if comm.rank == 0:
        opt.set_learning_rate(0.25)
    msg = raises_everywhere(comm, mpikv.MismatchError, lambda: kv.push(0, mx.nd.ones((3,))))
    assert "ranks differ in optimizer" in msg and "0.25" in msg
    np.testing.assert_array_equal(_value(kv), 1.0)


def test_a_bad_lr_mult_on_one_rank(comm):
    kv = _store()
    opt = mx.optimizer.SGD(learning_rate=0.5)
    kv.set_optimizer(opt)
    if comm.rank == comm.size - 1:
        opt.lr_mult = {0: -2.0}
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.push(0, mx.nd.ones((3,))))
    assert f"{'rank ' + str(comm.size - 1) + ': ' if comm.size > 1 else ''}optimizer: " \
           f"lr_mult of key 0 must be >= 0.0, got -2.0" in msg
    opt.lr_mult = {0: 2.0}
    kv.push(0, mx.nd.ones((3,)))
    np.testing.assert_array_equal(_value(kv), 1.0 - comm.size)


def test_an_ndarray_that_cannot_be_viewed(comm, monkeypatch):
    """A GPU NDArray (not supported yet; simulated: this MXNet has no GPU) on one rank."""
    kv = _store()
    bad = comm.size - 1
    if comm.rank == bad:
        monkeypatch.setattr(ndarrays, "problem", lambda nd: "an NDArray on gpu(0): ...")
    msg = raises_everywhere(comm, mpikv.ValueTypeError,
                            lambda: kv.push(0, mx.nd.ones((3,))))
    where = f"rank {bad}: " if comm.size > 1 else ""
    assert msg == f"ValueTypeError: push: {where}value for key 0 is an NDArray on gpu(0): " \
                  f"...; nothing was applied"
    msg = raises_everywhere(comm, mpikv.ValueTypeError,
                            lambda: kv.pull(0, out=mx.nd.zeros((3,))))
    assert f"{where}out for key 0 is an NDArray on gpu(0)" in msg
    monkeypatch.undo()
    np.testing.assert_array_equal(_value(kv), 1.0)


def test_the_real_gpu_message():
    class Ctx:
        device_type = "gpu"

        def __str__(self):
            return "gpu(0)"

    class FakeGPUArray:
        context = Ctx()
    assert ndarrays.problem(FakeGPUArray()) == (
        "an NDArray on gpu(0): mpikv.mxnet takes CPU NDArrays (GPU NDArrays are not "
        "supported yet; copy with .as_in_context(mx.cpu()))")


def test_the_stores_own_checks_still_apply(comm):
    kv = _store()
    msg = raises_everywhere(comm, mpikv.DTypeError,
                            lambda: kv.push(0, mx.nd.ones((3,), dtype="float64")))
    assert "value for key 0 has dtype float64, the stored value has dtype float32" in msg
    msg = raises_everywhere(comm, mpikv.DTypeError,
                            lambda: kv.init(1, mx.nd.ones((3,), dtype="uint8")))
    assert "which the store cannot hold" in msg
    msg = raises_everywhere(comm, mpikv.ShapeError,
                            lambda: kv.pull(0, out=mx.nd.zeros((4,))))
    assert "out for key 0 has shape (4,), the stored value has shape (3,)" in msg
    msg = raises_everywhere(comm, mpikv.ValueTypeError, lambda: kv.push(0, [1.0, 2.0, 3.0]))
    assert "value for key 0 is a float, not an array" in msg
    raises_everywhere(comm, mpikv.UnknownKeyError, lambda: kv.push(9, mx.nd.ones((3,))))
    raises_everywhere(comm, mpikv.DuplicateInitError, lambda: kv.init(0, mx.nd.ones((3,))))
    np.testing.assert_array_equal(_value(kv), 1.0)


def test_row_sparse_pull_needs_row_ids(comm):
    kv = _store()
    out = mx.nd.sparse.zeros("row_sparse", (3,))
    # (mpikv's InputError, and MXNet's store's AssertionError and MXNetError)
    for exc in (mpikv.InputError, AssertionError, mx.base.MXNetError):
        msg = raises_everywhere(comm, exc, lambda: kv.row_sparse_pull(0, out=out))
        assert "row_sparse_pull needs row_ids" in msg


def test_a_file_whose_optimizer_mxnet_lacks(comm, shared_dir):
    """A state file of mpikv's AdamW (no MXNet 1.9 class): refused on every rank."""
    import os
    fname = os.path.join(shared_dir, "adamw.states")
    plain = mpikv.create("dist_sync")
    plain.init(0, np.ones(3, np.float32))
    plain.set_optimizer(mpikv.optimizer.AdamW(learning_rate=0.01))
    plain.push(0, np.ones(3, np.float32))
    plain.save_optimizer_states(fname, dump_optimizer=True)
    kv = _store()
    opt = mx.optimizer.Adam()
    kv.set_optimizer(opt)
    msg = raises_everywhere(comm, mpikv.OptimizerError, lambda: kv.load_optimizer_states(fname))
    assert "the file's optimizer 'adamw' has no MXNet 1.9 class" in msg
    assert kv.optimizer is opt


def test_unknown_capability_and_store_type():
    kv = mpikv.mxnet.create("local")
    assert kv.is_capable("optimizer") and kv.is_capable(mx.kv.KVStoreBase.OPTIMIZER)
    with pytest.raises(ValueError, match="Unknown capability: sparse"):
        kv.is_capable("sparse")
    with pytest.raises(ValueError, match="unknown store type 'dist_async'"):
        mpikv.mxnet.create("dist_async")
    with pytest.raises(TypeError):
        mpikv.mxnet.create(3)


def test_a_closed_store(comm):
    with mpikv.mxnet.create("dist_sync") as kv:
        kv.init(0, mx.nd.ones((3,)))
        kv.set_optimizer(mx.optimizer.SGD())
    assert kv.optimizer is None
    msg = raises_everywhere(comm, mpikv.InputError, lambda: kv.push(0, mx.nd.ones((3,))))
    assert "closed" in msg
