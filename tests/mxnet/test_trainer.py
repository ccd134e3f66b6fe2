"""Gluon's Trainer, unchanged, trains through mpikv.mxnet at 1-4 ranks (under mpiexec).

Every test compares with MXNet's own single-process run on the global batch
(``mx.kv.create("local")``), within float32 rounding, and checks that every
rank holds bit-identical weights.
"""

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")
from mxnet import gluon  # noqa: E402

import mpikv.mxnet  # noqa: E402,F401 - registers the mpikv_* store names

from .conftest import same_on_every_rank  # noqa: E402
from .helpers import close, make_net, rows, step, train_local, weights  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS = 4

OPTIMIZERS = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3, "clip_gradient": 0.05}),
    ("sgd", {"learning_rate": 0.2}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}),
    ("adam", {"learning_rate": 0.01, "wd": 1e-3, "clip_gradient": 0.1}),
    ("rmsprop", {"learning_rate": 0.01, "centered": True, "wd": 1e-3}),
    ("rmsprop", {"learning_rate": 0.01}),
    ("lamb", {"learning_rate": 0.01, "wd": 1e-3}),
]


def train_mpikv(comm, optimizer, params, update_on_kvstore, kvstore="mpikv_dist_sync",
                steps=STEPS, changes=None, setup=None):
    net = make_net()
    if setup:
        setup(net)
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(params), kvstore=kvstore,
                            update_on_kvstore=update_on_kvstore)
    lrs = []
    for i in range(steps):
        if changes and i in changes:
            changes[i](trainer)
        step(net, trainer, i, rows(comm.rank, comm.size))
        lrs.append(trainer.learning_rate)
    return net, trainer, lrs


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("optimizer,params", OPTIMIZERS,
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(OPTIMIZERS)])
def test_trainer_equals_the_local_store(comm, optimizer, params, update_on_kvstore):
    want, _ = train_local(optimizer, params, STEPS, update_on_kvstore)
    net, trainer, _ = train_mpikv(comm, optimizer, params, update_on_kvstore)
    assert isinstance(trainer._kvstore, mpikv.mxnet.KVStore)
    assert trainer._kvstore.type == "mpikv_dist_sync"
    assert trainer._update_on_kvstore is update_on_kvstore
    assert trainer._kvstore.num_workers == comm.size and trainer._kvstore.rank == comm.rank
    got = weights(net)
    close(got, want)
    same_on_every_rank(comm, got)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_store_object_works_as_the_kvstore_argument(comm, update_on_kvstore):
    params = {"learning_rate": 0.1, "momentum": 0.5}
    want, _ = train_local("sgd", params, STEPS, update_on_kvstore)
    kv = mpikv.mxnet.create("dist_sync")
    net, trainer, _ = train_mpikv(comm, "sgd", params, update_on_kvstore, kvstore=kv)
    assert trainer._kvstore is kv
    close(weights(net), want)


def test_two_devices_per_rank(comm):
    """Two CPU contexts per rank: the store sums them, then over the ranks."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    params = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
    want, _ = train_local("sgd", params, STEPS)
    net = make_net(ctx=ctxs)
    trainer = gluon.Trainer(net.collect_params(), "sgd", params, kvstore="mpikv_dist_sync")
    for i in range(STEPS):
        step(net, trainer, i, rows(comm.rank, comm.size), ctxs=ctxs)
    for ctx in ctxs:
        close(weights(net, ctx), want)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in weights(net, ctxs[0])]),
                                  np.concatenate([w.ravel() for w in weights(net, ctxs[1])]))


def test_set_learning_rate_and_other_changes_are_followed(comm):
    """Gap 5: the Trainer changes its optimizer in place; the owners follow."""
    def lr(trainer):
        trainer.set_learning_rate(0.03)

    def wd_and_momentum(trainer):
        trainer.optimizer.wd = 0.01
        trainer.optimizer.momentum = 0.5
    changes = {1: lr, 3: wd_and_momentum}
    params = {"learning_rate": 0.1, "momentum": 0.9}
    want, want_lrs = train_local("sgd", params, 5, changes=changes)
    net, trainer, lrs = train_mpikv(comm, "sgd", params, True, steps=5, changes=changes)
    close(weights(net), want)
    assert lrs == want_lrs == [0.1, 0.03, 0.03, 0.03, 0.03]
    config = trainer._kvstore.kvstore.optimizer.get_config()
    assert (config["learning_rate"], config["wd"], config["momentum"]) == (0.03, 0.01, 0.5)
    assert config["rescale_grad"] == 1.0 / 24


def test_a_learning_rate_schedule(comm):
    """The scheduler becomes mpikv's; trainer.learning_rate follows it as with MXNet's store."""
    def params():
        return {"learning_rate": 0.1, "momentum": 0.9,
                "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)}
    want, want_lrs = train_local("sgd", params(), 6)
    net, trainer, lrs = train_mpikv(comm, "sgd", params(), True, steps=6)
    close(weights(net), want)
    assert lrs == pytest.approx(want_lrs)
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    sched = trainer._kvstore.kvstore.optimizer.lr_scheduler
    assert (sched.name, sched.step, sched.factor, sched.base_lr) == ("factor", 2, 0.5, 0.1)


def test_lr_mult_and_wd_mult_of_parameters(comm):
    """Gap 4: each Parameter's lr_mult/wd_mult (behind optimizer.param_dict), also changed
    during training."""
    def setup(net):
        net[0].weight.lr_mult = 0.5
        net[0].bias.wd_mult = 0.0
        net[1].weight.wd_mult = 3.0

    def later(trainer):
        for p in trainer._params:
            if p.name.endswith("bias") and p.lr_mult == 1.0:
                p.lr_mult = 2.0
    params = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}
    want, _ = train_local("sgd", params, 4, setup=setup, changes={2: later})
    net, trainer, _ = train_mpikv(comm, "sgd", params, True, steps=4, setup=setup,
                                  changes={2: later})
    close(weights(net), want)
    opt = trainer._kvstore.kvstore.optimizer
    index = trainer._param2idx
    assert opt.lr_mult == {index[net[0].weight.name]: 0.5, index[net[0].bias.name]: 2.0,
                           index[net[1].bias.name]: 2.0}
    assert opt.wd_mult == {index[net[0].bias.name]: 0.0, index[net[1].weight.name]: 3.0}


def test_the_store_optimizer_is_public(comm):
    """Gap 8: kv.optimizer is the MXNet object the owners run; kv.kvstore.optimizer mpikv's."""
    kv = mpikv.mxnet.create("dist_sync")
    assert kv.optimizer is None and kv.kvstore.optimizer is None
    opt = mx.optimizer.Adam(learning_rate=0.02, beta1=0.8, wd=0.1, rescale_grad=0.5)
    kv.set_optimizer(opt)
    assert kv.optimizer is opt and kv._updater.optimizer is opt
    config = kv.kvstore.optimizer.get_config()
    assert {k: config[k] for k in ("name", "learning_rate", "beta1", "beta2", "wd",
                                   "rescale_grad", "epsilon")} == {
        "name": "adam", "learning_rate": 0.02, "beta1": 0.8, "beta2": 0.999, "wd": 0.1,
        "rescale_grad": 0.5, "epsilon": 1e-8}


def test_set_optimizer_runs_mxnet_rules_on_the_owners(comm):
    """Gap 3: an mx.optimizer object on the store gives what MXNet's own updater gives
    for the summed gradient, for every supported kind."""
    makers = [lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
              lambda: mx.optimizer.NAG(learning_rate=0.1, momentum=0.9, wd=0.01),
              lambda: mx.optimizer.Adam(learning_rate=0.01, wd=0.01),
              lambda: mx.optimizer.RMSProp(learning_rate=0.01, centered=True, gamma2=0.8),
              lambda: mx.optimizer.LAMB(learning_rate=0.01, wd=0.01)]
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((5, 4)).astype(np.float32)
    grads = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3)]
    for make in makers:
        kv = mpikv.mxnet.create("dist_sync")
        kv.init(0, mx.nd.array(w0))
        kv.set_optimizer(make())
        updater = mx.optimizer.get_updater(make())
        ref, out = mx.nd.array(w0), mx.nd.zeros((5, 4))
        for g in grads:
            # rank 0 pushes g, the others zeros: the sum is g on any number of ranks
            kv.push(0, mx.nd.array(g if comm.rank == 0 else np.zeros_like(g)))
            kv.pull(0, out=out)
            updater(0, mx.nd.array(g), ref)
        np.testing.assert_allclose(out.asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=kv.optimizer.__class__.__name__)


def test_ndarrays_in_every_operation(comm):
    """Gaps 1 and 2: NDArray values and outputs in init, push, pull, pushpull, broadcast;
    results are written into the caller's NDArrays (no copy through numpy)."""
    n, r = comm.size, comm.rank
    kv = mpikv.mxnet.create("dist_sync")
    kv.init("w", mx.nd.full((2, 3), 2.0 + r))           # rank 0's value is used
    out = mx.nd.zeros((2, 3))
    kv.pull("w", out=out)
    assert (out.asnumpy() == 2.0).all()
    kv.push("w", [mx.nd.ones((2, 3)), mx.nd.full((2, 3), float(r))])   # two devices
    kv.pull("w", out=[out, out])
    assert (out.asnumpy() == n + n * (n - 1) / 2).all()
    grad = mx.nd.full((2, 3), float(r + 1))
    kv.pushpull("w", grad)                               # out=None: written into grad
    assert (grad.asnumpy() == n * (n + 1) / 2).all()
    outs = [mx.nd.zeros((2, 3), ctx=mx.cpu(i)) for i in range(2)]
    kv.pushpull("w", mx.nd.ones((2, 3)), out=outs)
    assert all((o.asnumpy() == n).all() for o in outs)
    dst = [mx.nd.zeros((4,)), mx.nd.zeros((4,))]
    kv.broadcast(["a", "b"], [mx.nd.full((4,), 5.0 + r), mx.nd.full((4,), 7.0 + r)], out=dst)
    assert (dst[0].asnumpy() == 5).all() and (dst[1].asnumpy() == 7).all()
    kv.barrier()
    kv._barrier()


def test_module_fit(comm):
    """mx.mod.Module drives it too (string keys, rescale by the workers' batch)."""
    from .helpers import BATCH, batch
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=16, name="fc1"),
                               act_type="relu")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=3, name="fc2"),
                               name="softmax")
    xs, ys = zip(*(batch(i) for i in range(3)))

    def fit(kv, part, size):
        mx.random.seed(1)
        x = np.concatenate([x[part] for x in xs])
        y = np.concatenate([y[part] for y in ys])
        mod = mx.mod.Module(out, context=mx.cpu())
        mod.fit(mx.io.NDArrayIter(x, y, batch_size=BATCH // size), kvstore=kv,
                optimizer="sgd", optimizer_params={"learning_rate": 0.1, "momentum": 0.9,
                                                   "wd": 1e-3},
                initializer=mx.init.Xavier(), num_epoch=2)
        return mod, {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    _, want = fit("local", slice(None), 1)
    mod, got = fit(mpikv.mxnet.create("dist_sync"), rows(comm.rank, comm.size), comm.size)
    assert mod._update_on_kvstore
    assert sorted(got) == sorted(want)
    close([got[k] for k in sorted(got)], [want[k] for k in sorted(want)])
    # MXNet's default: no weight decay for biases (by name), followed per key.
    assert mod._kvstore.kvstore.optimizer.wd_mult == {"fc1_bias": 0.0, "fc2_bias": 0.0}


@pytest.mark.parametrize("make", [
    lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, multi_precision=True),
    lambda: mx.optimizer.SGD(learning_rate=0.001, multi_precision=True),
    lambda: mx.optimizer.NAG(learning_rate=0.1, momentum=0.9, multi_precision=True),
    lambda: mx.optimizer.Adam(learning_rate=0.01, multi_precision=True)],
    ids=["sgd-momentum", "sgd-small-steps", "nag", "adam"])
def test_float16_weights_with_float32_masters(comm, make):
    """multi_precision=True: float32 master copies on the owners, as MXNet keeps them in
    its updater; float16 weights equal MXNet's bit for bit (CPU MXNet trains no float16
    layers, so this drives the store directly)."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((6, 5)).astype(np.float16)
    grads = [rng.standard_normal((6, 5)).astype(np.float16) for _ in range(4)]
    kv = mpikv.mxnet.create("dist_sync")
    kv.init(0, mx.nd.array(w0, dtype="float16"))
    kv.set_optimizer(make())
    updater = mx.optimizer.get_updater(make())
    ref, out = mx.nd.array(w0, dtype="float16"), mx.nd.zeros((6, 5), dtype="float16")
    for g in grads:
        kv.push(0, mx.nd.array(g if comm.rank == 0 else np.zeros_like(g), dtype="float16"))
        kv.pull(0, out=out)
        updater(0, mx.nd.array(g, dtype="float16"), ref)
    np.testing.assert_array_equal(out.asnumpy(), ref.asnumpy())
    assert out.dtype == np.float16
