"""Optimizer states through MXNet's own calls, at 1-4 ranks (under mpiexec).

``Trainer.save_states``/``load_states`` and ``Module``'s
``save_optimizer_states``/``load_optimizer_states`` round-trip on the same
number of ranks, bit for bit against a run that never stopped (other rank
counts: ``test_resume.py``). As with MXNet's own store, a file saved with the
optimizer brings it back: a new Trainer's optimizer is replaced by the file's.
"""

import os

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")
from mxnet import gluon  # noqa: E402

import mpikv  # noqa: E402
import mpikv.mxnet  # noqa: E402,F401

from ..mpi.conftest import raises_everywhere  # noqa: E402
from .helpers import make_net, rows, step, weights  # noqa: E402

pytestmark = pytest.mark.mpi


def _trainer(net, optimizer, params):
    return gluon.Trainer(net.collect_params(), optimizer, dict(params),
                         kvstore="mpikv_dist_sync", update_on_kvstore=True)


def _run(comm, trainer, net, first, last, changes=None):
    for i in range(first, last):
        if changes and i in changes:
            changes[i](trainer)
        step(net, trainer, i, rows(comm.rank, comm.size))


def _save(comm, net, trainer, prefix):
    trainer.save_states(prefix + ".states")
    if comm.rank == 0:
        net.save_parameters(prefix + ".params")
    comm.barrier()


def _resumed(comm, prefix, optimizer, params):
    """A new process's view: another initialisation, a fresh Trainer, then the loads."""
    net = make_net(seed=123)
    net.load_parameters(prefix + ".params")
    trainer = _trainer(net, optimizer, params)
    trainer.load_states(prefix + ".states")
    return net, trainer


def _lr_change(trainer):
    trainer.set_learning_rate(0.05)


CASES = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}, {1: _lr_change}),
    ("adam", {"learning_rate": 0.01, "wd": 1e-3}, {1: _lr_change}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}, None),
    ("rmsprop", {"learning_rate": 0.01, "centered": True}, None),
]


@pytest.mark.parametrize("optimizer,params,changes", CASES, ids=[c[0] for c in CASES])
def test_trainer_save_and_load_states(comm, shared_dir, optimizer, params, changes):
    """Gaps 6 and 7: the resumed Trainer takes the file's optimizer (kvstore._updater
    .optimizer): the rate set before saving and the rescale of the steps come back, so
    step() does not stop on "Possible change in the batch_size"; the weights then equal
    a run that never stopped, bit for bit."""
    net = make_net()
    trainer = _trainer(net, optimizer, params)
    _run(comm, trainer, net, 0, 6, changes)
    want = weights(net)

    prefix = os.path.join(shared_dir, optimizer)
    net = make_net()
    trainer = _trainer(net, optimizer, params)
    _run(comm, trainer, net, 0, 3, changes)
    _save(comm, net, trainer, prefix)
    saved_lr = trainer.learning_rate

    net, trainer = _resumed(comm, prefix, optimizer, params)
    kv = trainer._kvstore
    assert trainer.optimizer is kv._updater.optimizer is kv.optimizer          # gap 6
    assert trainer.learning_rate == saved_lr                                  # gap 7
    assert trainer.optimizer.rescale_grad == 1.0 / 24
    assert trainer.optimizer.param_dict[0] is trainer._params[0]
    assert kv.kvstore.optimizer.get_config()["learning_rate"] == saved_lr
    _run(comm, trainer, net, 3, 6)
    for got, w in zip(weights(net), want):
        np.testing.assert_array_equal(got, w)


def test_a_schedule_resumes_where_it_was(comm, shared_dir):
    def params():
        return {"learning_rate": 0.1, "momentum": 0.9,
                "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)}
    net = make_net()
    trainer = _trainer(net, "sgd", params())
    _run(comm, trainer, net, 0, 6)
    want, want_lr = weights(net), trainer.learning_rate

    prefix = os.path.join(shared_dir, "sched")
    net = make_net()
    trainer = _trainer(net, "sgd", params())
    _run(comm, trainer, net, 0, 3)
    _save(comm, net, trainer, prefix)
    net, trainer = _resumed(comm, prefix, "sgd", params())
    assert isinstance(trainer.optimizer.lr_scheduler, mx.lr_scheduler.FactorScheduler)
    assert trainer.optimizer.num_update == 3 and trainer.learning_rate == 0.05
    _run(comm, trainer, net, 3, 6)
    assert trainer.learning_rate == want_lr == 0.025
    for got, w in zip(weights(net), want):
        np.testing.assert_array_equal(got, w)


def test_the_files_optimizer_replaces_another_kind(comm, shared_dir):
    """Gap 7, as MXNet: a Trainer made with SGD that loads an Adam file trains with Adam;
    one made with momentum 0 that loads a momentum file gets the momentum (other state
    arrays)."""
    adam = {"learning_rate": 0.01, "wd": 1e-3}
    mom = {"learning_rate": 0.1, "momentum": 0.9}
    for saved, params, other in (("adam", adam, ("sgd", {"learning_rate": 0.5})),
                                 ("sgd", mom, ("sgd", {"learning_rate": 0.5}))):
        net = make_net()
        trainer = _trainer(net, saved, params)
        _run(comm, trainer, net, 0, 5)
        want = weights(net)
        prefix = os.path.join(shared_dir, "kind")
        net = make_net()
        trainer = _trainer(net, saved, params)
        _run(comm, trainer, net, 0, 2)
        _save(comm, net, trainer, prefix)
        net, trainer = _resumed(comm, prefix, *other)
        assert type(trainer.optimizer) is type(mx.optimizer.create(saved))
        assert trainer.learning_rate == params["learning_rate"]
        _run(comm, trainer, net, 2, 5)
        for got, w in zip(weights(net), want):
            np.testing.assert_array_equal(got, w)


def test_states_without_the_optimizer_keep_the_store_optimizer(comm, shared_dir):
    """MXNet's rule: a file saved without the optimizer (dump_optimizer=False, what
    Module saves) loads its states only; the store keeps its optimizer."""
    fname = os.path.join(shared_dir, "bare")
    kv = mpikv.mxnet.create("dist_sync")
    kv.init(3, mx.nd.ones((4,)))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.push(3, mx.nd.ones((4,)))
    kv.save_optimizer_states(fname)
    mine = mx.optimizer.SGD(learning_rate=0.2, momentum=0.9)
    kv.set_optimizer(mine)
    kv.load_optimizer_states(fname)
    assert kv.optimizer is mine
    assert kv.kvstore.optimizer.get_config()["learning_rate"] == 0.2
    out = mx.nd.zeros((4,))
    kv.push(3, mx.nd.ones((4,)))
    kv.pull(3, out=out)
    n = comm.size
    # w1 = 1 - 0.1 n; mom1 = -0.1 n (loaded); mom2 = 0.9 mom1 - 0.2 n; w2 = w1 + mom2
    want = np.float32(1 - 0.1 * n) + np.float32(0.9 * -0.1 * n - 0.2 * n)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)


def test_module_save_and_load_optimizer_states(comm, shared_dir):
    data = mx.sym.Variable("data")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=3, name="fc"),
                               name="softmax")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * comm.size, 5)).astype(np.float32)
    y = rng.integers(0, 3, 8 * comm.size).astype(np.float32)

    def module(arg=None, aux=None):
        mx.random.seed(2)
        mod = mx.mod.Module(out, context=mx.cpu())
        mod.bind(data_shapes=[("data", (8, 5))], label_shapes=[("softmax_label", (8,))])
        mod.init_params(mx.init.Xavier(), arg_params=arg, aux_params=aux)
        mod.init_optimizer(kvstore=mpikv.mxnet.create("dist_sync"), optimizer="adam",
                           optimizer_params={"learning_rate": 0.01})
        return mod

    def train(mod, batches):
        for b in batches:
            part = slice(b * 8 * comm.size + comm.rank * 8, b * 8 * comm.size + comm.rank * 8 + 8)
            mod.forward_backward(mx.io.DataBatch([mx.nd.array(x[part] * (b + 1))],
                                                 [mx.nd.array(y[part])]))
            mod.update()

    x = np.tile(x, (4, 1))
    y = np.tile(y, 4)
    mod = module()
    train(mod, range(4))
    want = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    mod = module()
    train(mod, range(2))
    fname = os.path.join(shared_dir, "module.states")
    mod.save_optimizer_states(fname)
    arg, aux = mod.get_params()
    mod = module(arg, aux)
    mod.load_optimizer_states(fname)
    train(mod, range(2, 4))
    for k, v in mod.get_params()[0].items():
        np.testing.assert_array_equal(v.asnumpy(), want[k], err_msg=k)


def test_a_corrupt_file_is_an_error_everywhere_and_changes_nothing(comm, shared_dir):
    fname = os.path.join(shared_dir, "bad.states")
    kv = mpikv.mxnet.create("dist_sync")
    kv.init(0, mx.nd.ones((3,)))
    opt = mx.optimizer.Adam(learning_rate=0.01)
    kv.set_optimizer(opt)
    kv.push(0, mx.nd.ones((3,)))
    kv.save_optimizer_states(fname, dump_optimizer=True)
    comm.barrier()
    if comm.rank == 0:
        with open(fname, "r+b") as f:
            f.seek(10)
            f.write(b"#")
    comm.barrier()
    raises_everywhere(comm, mpikv.StateFileError, lambda: kv.load_optimizer_states(fname))
    assert kv.optimizer is opt
    raises_everywhere(comm, mpikv.StateFileError,
                      lambda: kv.load_optimizer_states(fname + ".missing"))
    kv.push(0, mx.nd.ones((3,)))    # still usable
