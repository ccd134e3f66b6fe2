"""mpikv.mxnet in one process: registration, NDArrays without copies, the local store."""

import ctypes
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")
from mxnet import gluon  # noqa: E402

import mpikv.mxnet  # noqa: E402
from mpikv.mxnet import ndarrays  # noqa: E402

from .helpers import BATCH, batch, close, make_net, train_local, weights  # noqa: E402


def _python(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_does_not_import_mxnet_and_names_register_when_it_is():
    out = _python("import sys, mpikv, mpikv.mxnet\n"
                  "print('mxnet' in sys.modules)\n"
                  "import mxnet as mx\n"
                  "print(sorted(k for k in mx.kv.KVStoreBase.kv_registry if 'mpikv' in k))")
    assert out.splitlines() == ["False", "['mpikv_device', 'mpikv_dist_device_sync', "
                                "'mpikv_dist_sync', 'mpikv_dist_sync_device', 'mpikv_local']"]
    # someone looks MXNet up without importing it first: still registered at the import
    out = _python("import importlib.util, mpikv.mxnet\n"
                  "assert importlib.util.find_spec('mxnet') is not None\n"
                  "import mxnet as mx\n"
                  "print('mpikv_dist_sync' in mx.kv.KVStoreBase.kv_registry)")
    assert out == "True"
    # MXNet imported first: registered at once
    out = _python("import mxnet as mx, mpikv.mxnet\n"
                  "print(type(mx.kv.create('mpikv_local')).__mro__[1].__name__)")
    assert out == "KVStore"


def test_the_kvstore_tutorial_with_ndarrays():
    """MXNet's KVStore tutorial, NDArrays and all, on mx.kv.create('mpikv_local')."""
    kv = mx.kv.create("mpikv_local")
    assert isinstance(kv, mx.kv.KVStoreBase) and kv.type == "mpikv_local"
    assert (kv.rank, kv.num_workers) == (0, 1)
    shape = (2, 3)
    kv.init(3, mx.nd.ones(shape) * 2)
    a = mx.nd.zeros(shape)
    kv.pull(3, out=a)
    assert (a.asnumpy() == 2).all()
    kv.push(3, mx.nd.ones(shape) * 8)
    kv.pull(3, out=a)
    assert (a.asnumpy() == 8).all()
    devices = [mx.nd.ones(shape, mx.cpu(i)) for i in range(4)]
    kv.push(3, devices)
    kv.pull(3, out=a)
    assert (a.asnumpy() == 4).all()
    seen = []

    def update(key, recv, stored):
        assert isinstance(recv, mx.nd.NDArray) and isinstance(stored, mx.nd.NDArray)
        seen.append(key)
        stored += recv * 2
    kv._set_updater(update)
    kv.pull(3, out=a)
    assert (a.asnumpy() == 4).all()
    kv.push(3, mx.nd.ones(shape))
    kv.pull(3, out=a)
    assert (a.asnumpy() == 6).all() and seen == [3]
    keys = [5, 7, 9]
    kv.init(keys, [mx.nd.ones(shape)] * len(keys))
    kv.push(keys, [mx.nd.ones(shape)] * len(keys))
    b = [mx.nd.zeros(shape)] * len(keys)
    kv.pull(keys, out=b)
    assert (b[1].asnumpy() == 3).all() and seen == [3, 5, 7, 9]
    kv.push(keys, [[mx.nd.ones(shape, mx.cpu(i)) for i in range(4)]] * len(keys))
    kv.pull(keys, out=b)
    assert (b[1].asnumpy() == 11).all()


def _data_pointer(nd):
    from mxnet.base import _LIB, check_call
    p = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(p)))
    return p.value


def test_views_are_the_ndarrays_memory():
    """Gap 2: no copy: a view is the NDArray's memory (writes show in the NDArray)."""
    nd = mx.nd.arange(12).reshape((3, 4))
    w = ndarrays.view(nd, writable=True)
    assert w.ctypes.data == _data_pointer(nd) and w.flags.writeable
    w[1, 2] = 42.0
    assert nd.asnumpy()[1, 2] == 42.0
    r = ndarrays.view(nd, writable=False)
    assert r.ctypes.data == _data_pointer(nd) and not r.flags.writeable
    row = nd[2]                              # a slice: its own offset in the same memory
    assert ndarrays.view(row, False).ctypes.data == _data_pointer(nd) + 8 * 4
    del nd
    assert w[1, 2] == 42.0                   # the view keeps the NDArray alive
    for dtype in ("float16", "float32", "float64", "int32", "int64"):
        assert ndarrays.view(mx.nd.ones((2,), dtype=dtype), False).dtype == np.dtype(dtype)


def test_pull_and_pushpull_write_into_the_callers_ndarrays():
    kv = mpikv.mxnet.create("local")
    kv.init("w", mx.nd.full((1000,), 3.0))
    out = mx.nd.zeros((1000,))
    # MXNet allocates an NDArray's memory when its first operator runs: its address
    # is fixed only once the zeros are written (before, it could read another one).
    out.wait_to_read()
    before = _data_pointer(out)
    kv.pull("w", out=out)
    assert _data_pointer(out) == before and (out.asnumpy() == 3).all()
    grad = mx.nd.full((1000,), 2.0)
    kv.pushpull("w", grad)
    assert (grad.asnumpy() == 2).all()
    kv.pull("w", out=out)
    assert (out.asnumpy() == 2).all()


def test_pending_mxnet_work_is_waited_for():
    """MXNet runs operators asynchronously: a value still being computed is read once
    it is written, and an output still being read is written only after."""
    kv = mpikv.mxnet.create("local")
    big = mx.nd.ones((600, 600))
    kv.init(0, mx.nd.zeros((600, 600)))
    for _ in range(3):
        value = mx.nd.dot(big, big)              # queued, maybe not yet run
        kv.push(0, value)
        reader = mx.nd.dot(big, value)           # queued: reads `value`
        kv.pull(0, out=value)                    # must wait for that read
        np.testing.assert_array_equal(reader.asnumpy(), 360000.0)
        np.testing.assert_array_equal(value.asnumpy(), 600.0)


def test_mkldnn_layouts_are_read_in_the_default_layout():
    """After an inference pass MKL-DNN may keep a weight in its own blocked layout
    (MXNet 1.9.1's DLPack export then refuses it); the view reads the real values."""
    net = gluon.nn.Conv2D(16, 3, in_channels=8)
    net.initialize()
    net(mx.nd.ones((2, 8, 10, 10))).wait_to_read()
    weight = net.weight.data()
    want = weight.asnumpy()
    kv = mpikv.mxnet.create("local")
    kv.init(0, weight)
    out = mx.nd.zeros(want.shape)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out.asnumpy(), want)


def test_sparse_ndarrays_on_the_local_store():
    """A row_sparse initial value makes a row table (a csr push to it: every row);
    sparse outputs, row_sparse_pull with one and several outputs."""
    kv = mpikv.mxnet.create("local")
    dense = np.arange(12, dtype=np.float32).reshape(4, 3)
    kv.init(0, mx.nd.array(dense).tostype("row_sparse"))
    got = mx.nd.zeros((4, 3))
    kv.pull(0, out=got)
    np.testing.assert_array_equal(got.asnumpy(), dense)
    assert kv._row_keys == {0: ((4, 3), np.dtype(np.float32))}
    kv.push(0, mx.nd.array(dense * 2).tostype("csr"))
    sparse_out = mx.nd.sparse.zeros("row_sparse", (4, 3))
    kv.pull(0, out=sparse_out)                                 # ignore_sparse=True: skipped
    assert sparse_out.asnumpy().sum() == 0
    kv.pull(0, out=sparse_out, ignore_sparse=False)
    np.testing.assert_array_equal(sparse_out.asnumpy(), dense * 2)
    rows = mx.nd.array([0, 2], dtype="int64")
    part = mx.nd.sparse.zeros("row_sparse", (4, 3))
    kv.row_sparse_pull(0, out=part, row_ids=rows)
    assert part.stype == "row_sparse"
    np.testing.assert_array_equal(part.indices.asnumpy(), [0, 2])
    np.testing.assert_array_equal(part.asnumpy()[[0, 2]], dense[[0, 2]] * 2)
    assert part.asnumpy()[[1, 3]].sum() == 0
    outs = [mx.nd.sparse.zeros("row_sparse", (4, 3)) for _ in range(2)]
    kv.row_sparse_pull(0, out=outs, row_ids=[mx.nd.array([1]), mx.nd.array([3])])
    np.testing.assert_array_equal(outs[0].indices.asnumpy(), [1])
    np.testing.assert_array_equal(outs[1].asnumpy()[3], dense[3] * 2)


def test_one_device_by_a_local_name_is_no_store():
    """MXNet's own rule (model.py _create_kvstore): one device and a name without
    "dist" means no store at all; with two devices the store is used."""
    net = make_net()
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore="mpikv_local")
    trainer._init_kvstore()
    assert trainer._kvstore is None
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = make_net(ctx=ctxs)
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore="mpikv_local")
    trainer._init_kvstore()
    assert isinstance(trainer._kvstore, mpikv.mxnet.KVStore)
    assert trainer._distributed is False


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_two_devices_on_the_local_store_follow_the_batch_size(update_on_kvstore):
    """Gap 5: on a local store the Trainer sets rescale_grad = 1/batch at every step
    (a changing batch is allowed); the owners follow it."""
    from mxnet import autograd
    sizes = [24, 12, 24, 6]

    def run(kvstore, ctxs):
        net = make_net(ctx=ctxs)
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01},
                                kvstore=kvstore, update_on_kvstore=update_on_kvstore)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        for i, size in enumerate(sizes):
            x, y = batch(i)
            xs = gluon.utils.split_and_load(mx.nd.array(x[:size]), ctxs)
            ys = gluon.utils.split_and_load(mx.nd.array(y[:size]), ctxs)
            with autograd.record():
                losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
            for loss in losses:
                loss.backward()
            trainer.step(size)
        return weights(net, ctxs[0]), trainer
    ctxs = [mx.cpu(0), mx.cpu(1)]
    want, _ = run(mx.kv.create("local"), ctxs)
    got, trainer = run("mpikv_local", ctxs)
    assert trainer._update_on_kvstore is update_on_kvstore
    close(got, want)
    if update_on_kvstore:
        assert trainer._kvstore.kvstore.optimizer.rescale_grad == 1.0 / sizes[-1]


def test_the_local_reference_is_the_global_batch():
    """The helpers' reference: BATCH rows per step, one process."""
    w, lrs = train_local("sgd", {"learning_rate": 0.1}, 2)
    assert len(w) == 4 and lrs == [0.1, 0.1] and BATCH == 24
