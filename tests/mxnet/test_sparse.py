"""MXNet's sparse clients on mpikv (issue 23, item 5), under mpiexec at 1-4 ranks.

Gluon's Trainer with row_sparse parameters and gradients through
``mpikv_dist_sync`` (their keys are mpikv row tables), against MXNet's own
single-process run on the global batch; MXNet's ``dist_sync`` test of row_sparse
keys (``tests/nightly/dist_sync_kvstore.py``, its ``test`` optimizer) with the
same expected values; every MXNet optimizer on the owners against MXNet's own
updater; and the decisions and errors MXNet's clients see.
"""

import warnings

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")
from mxnet import autograd, gluon  # noqa: E402
import mxnet.optimizer.contrib  # noqa: E402,F401 - registers GroupAdaGrad

import mpikv  # noqa: E402
import mpikv.mxnet  # noqa: E402
from mpikv.mxnet import optimizers  # noqa: E402

from ..mpi.conftest import raises_everywhere  # noqa: E402
from .conftest import same_on_every_rank  # noqa: E402

pytestmark = pytest.mark.mpi
warnings.filterwarnings("ignore", message=".*float16.*")

ROWS, DIM, BATCH, STEPS = 30, 4, 12, 4


# -- Gluon's Trainer with sparse parameters ------------------------------------------------
def _net(sparse_weight, dtype="float32"):
    mx.random.seed(7)
    net = gluon.nn.Sequential()   # (SparseEmbedding is not a HybridBlock)
    with net.name_scope():
        net.add(gluon.contrib.nn.SparseEmbedding(ROWS, DIM) if sparse_weight else
                gluon.nn.Embedding(ROWS, DIM, sparse_grad=True))
        net.add(gluon.nn.Dense(1, in_units=2 * DIM))
    net.initialize(mx.init.Uniform(0.5))
    return net


def _batch(step):
    rng = np.random.default_rng(50 + step)
    # Zipf-like ids: some rows every step, many never.
    ids = np.minimum(rng.zipf(1.5, (BATCH, 2)) - 1, ROWS - 1).astype(np.float32)
    return ids, rng.standard_normal((BATCH, 1)).astype(np.float32)


def _values(net):
    out = []
    for p in net.collect_params().values():
        if p._stype == "row_sparse":
            out.append(p.row_sparse_data(mx.nd.arange(p.shape[0])).asnumpy())
        else:
            out.append(p.data().asnumpy())
    return out


def _train(net, trainer, part, steps=STEPS):
    loss_fn = gluon.loss.L2Loss()
    for i in range(steps):
        x, y = _batch(i)
        x, y = mx.nd.array(x[part]), mx.nd.array(y[part])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(1)
    return _values(net)


def _params(optimizer, extra):
    # rescale_grad given, step(1): with sparse weights the store exists before the first
    # step, and MXNet's dist Trainer refuses a rescale_grad that changes then.
    return optimizer, {"rescale_grad": 1.0 / BATCH, **extra}


SPARSE_OPTIMIZERS = [
    _params("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),          # lazy
    _params("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "lazy_update": False}),
    _params("adam", {"learning_rate": 0.05, "wd": 0.01}),                          # lazy
    _params("adam", {"learning_rate": 0.05, "lazy_update": False}),
    _params("signum", {"learning_rate": 0.05, "wd": 0.01}),     # MXNet's own, dense fallback
    _params("ftml", {"learning_rate": 0.05}),
    # MXNet's own; lazy on a row_sparse weight only (its dense kernel zeroes rows never pushed)
    _params("ftrl", {"learning_rate": 0.05, "wd": 0.01}),
]


def _mine(comm):
    share = BATCH // comm.size
    return slice(comm.rank * share, (comm.rank + 1) * share)


@pytest.mark.parametrize("sparse_weight", [False, True], ids=["sparse_grad", "row_sparse"])
@pytest.mark.parametrize("optimizer,params", SPARSE_OPTIMIZERS,
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(SPARSE_OPTIMIZERS)])
def test_gluon_sparse_trainer_equals_mxnets_local_run(comm, sparse_weight, optimizer, params):
    ref = _net(sparse_weight)
    # MXNet's own: a local store (sparse weights need one), or none (dense weight).
    want = _train(ref, gluon.Trainer(ref.collect_params(), optimizer, dict(params),
                                     kvstore=mx.kv.create("local") if sparse_weight else None),
                  slice(None))
    net = _net(sparse_weight)
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(params),
                            kvstore="mpikv_dist_sync")
    got = _train(net, trainer, _mine(comm))
    kv = trainer._kvstore
    assert isinstance(kv, mpikv.mxnet.KVStore) and trainer._update_on_kvstore is True
    emb = trainer._param2idx[net[0].weight.name]
    assert kv._row_keys == {emb: ((ROWS, DIM), np.dtype(np.float32))}
    rule = type(kv.kvstore.optimizer).__name__
    assert rule == ("MXNetRule" if optimizer in ("signum", "ftml", "ftrl") else
                    {"sgd": "SGD", "adam": "Adam"}[optimizer])
    for g, w in zip(got, want):   # (float32 rounding: helpers.close's tolerance)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
    same_on_every_rank(comm, got)


def test_only_the_rows_asked_for_are_fetched(comm):
    """row_sparse_pull of a row table moves only the ids asked for (the store's own
    call, counted), into a row_sparse out that holds just them."""
    net = _net(True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore="mpikv_dist_sync")
    weight = net[0].weight
    calls = []
    ids = mx.nd.array([[3, 1], [3, 7]])     # 2-D, repeated, unsorted, float: as MXNet takes
    got = weight.row_sparse_data(ids)       # creates the store and the table
    kv = trainer._kvstore.kvstore
    real = kv.row_sparse_pull
    kv.row_sparse_pull = lambda key, **kw: calls.append(kw["row_ids"]) or real(key, **kw)
    got = weight.row_sparse_data(ids)
    assert got.stype == "row_sparse"
    np.testing.assert_array_equal(got.indices.asnumpy(), [1, 3, 7])
    assert [sorted(set(c.tolist())) for c in calls] == [[1, 3, 7]]
    same_on_every_rank(comm, [got.asnumpy()])


def test_update_on_kvstore_decisions_and_errors_are_mxnets(comm):
    """MXNet's Trainer decides with mpikv_dist_sync as with dist_sync: sparse weights
    and sparse gradients update on the store; update_on_kvstore=False is refused."""
    refusals = {True: "Cannot set update_on_kvstore=False when sparse weights are present",
                False: "Cannot set update_on_kvstore=False on dist kvstore when sparse "
                       "gradients are present"}
    for sparse_weight, message in refusals.items():
        trainer = gluon.Trainer(_net(sparse_weight).collect_params(), "sgd",
                                kvstore="mpikv_dist_sync", update_on_kvstore=False)
        with pytest.raises(ValueError, match=message):
            trainer._init_kvstore()
    # The store passed as an object: taken (MXNet takes only its own KVStore class there).
    kv = mpikv.mxnet.create("dist_sync")
    assert isinstance(kv, mx.kv.KVStore)
    for sparse_weight in (False, True):
        trainer = gluon.Trainer(_net(sparse_weight).collect_params(), "sgd", kvstore=kv)
        trainer._init_kvstore()
        assert trainer._kvstore is kv and trainer._update_on_kvstore is True
        assert trainer._distributed is True


def test_a_distributed_trainer_cannot_be_reset(comm, shared_dir):
    """MXNet's test_gluon_trainer_reset: loading parameters would reset the store."""
    import os
    params = gluon.ParameterDict()
    x = params.get("x", shape=(4, 2), lr_mult=1.0, stype="row_sparse")
    params.initialize(ctx=mx.cpu(0), init="zeros")
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1}, kvstore="mpikv_dist_sync")
    fname = os.path.join(shared_dir, f"reset_{comm.rank}.params")
    params.save(fname)
    x.row_sparse_data(mx.nd.arange(0, 4))
    assert trainer._kv_initialized and trainer._update_on_kvstore
    with pytest.raises(RuntimeError, match="Cannot reset distributed KVStore"):
        params.load(fname)


# -- MXNet's dist_sync test of row_sparse keys ----------------------------------------------
RATE = 2


@pytest.mark.parametrize("multi_precision", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mxnets_dist_sync_row_sparse_checks(comm, dtype, multi_precision):
    """tests/nightly/dist_sync_kvstore.py's row_sparse checks, with its ``test``
    optimizer (w += rescale_grad * grad), on mpikv: the same expected values."""
    kv = mx.kv.create("mpikv_dist_sync")
    rank, n = kv.rank, kv.num_workers
    shape, big = (2, 3), (120, 5)
    kv.init(["9", "11", "97"], [mx.nd.ones(shape, dtype=dtype).tostype("row_sparse"),
                                mx.nd.ones(shape, dtype=dtype).tostype("row_sparse"),
                                mx.nd.ones(big, dtype=dtype).tostype("row_sparse")])
    kv.init("3", mx.nd.ones(shape, dtype=dtype))
    kv.set_optimizer(mx.optimizer.create("test", rescale_grad=RATE,
                                         multi_precision=multi_precision))
    assert type(kv.kvstore.optimizer).__name__ == "MXNetRule"
    # check_row_sparse_keys
    v = mx.nd.zeros(shape, dtype=dtype)
    v[rank % shape[0]] = rank + 1
    rng = np.random.default_rng(rank)
    for i in range(3):
        kv.push("9", v.tostype("row_sparse"))
        row_ids_np = rng.integers(0, shape[0], shape[0])
        row_ids = mx.nd.array(row_ids_np).reshape((shape[0] // 2, 2)).astype(dtype)
        val = mx.nd.zeros(shape, stype="row_sparse", dtype=dtype)
        kv.row_sparse_pull("9", out=val, row_ids=row_ids)
        updated = np.ones(shape)
        for r in range(n):
            updated[r % shape[0]] += (r + 1) * RATE * (i + 1)
        expected = np.zeros(shape)
        expected[row_ids_np] = updated[row_ids_np]
        np.testing.assert_array_equal(val.asnumpy(), expected)
        # dense keys with the same optimizer
        kv.push("3", mx.nd.ones(shape, dtype=dtype) * (rank + 1))
        dense = mx.nd.zeros(shape, dtype=dtype)
        kv.pull("3", out=dense)
        np.testing.assert_array_equal(dense.asnumpy(), (n + 1) * n * RATE / 2 * (i + 1) + 1)
    # check_row_sparse_keys_with_zeros
    for _ in range(2):
        kv.push("11", mx.nd.sparse.zeros("row_sparse", shape, dtype=dtype))
        kv.push("97", mx.nd.sparse.zeros("row_sparse", big, dtype=dtype))
        val = mx.nd.sparse.zeros("row_sparse", shape, dtype=dtype)
        big_val = mx.nd.sparse.zeros("row_sparse", big, dtype=dtype)
        kv.row_sparse_pull("11", out=val, row_ids=mx.nd.array(np.arange(shape[0])))
        kv.row_sparse_pull("97", out=big_val, row_ids=mx.nd.array(np.arange(big[0])))
        assert (val.asnumpy() == 1).all() and (big_val.asnumpy() == 1).all()
        kv.row_sparse_pull("11", out=val, row_ids=mx.nd.array([]))
        kv.row_sparse_pull("97", out=big_val, row_ids=mx.nd.array([]))
        assert (val.asnumpy() == 0).all() and (big_val.asnumpy() == 0).all()
    # check_big_row_sparse_keys
    prng = np.random.default_rng(123)
    indices = np.flatnonzero(prng.random(big[0]) < 0.3)
    update_rows = [indices[::(r + 1) * 2] for r in range(n)]
    v = np.zeros(big, dtype=dtype)
    v[update_rows[rank]] = rank + 1
    for i in range(3):
        kv.push("97", mx.nd.array(v, dtype=dtype).tostype("row_sparse"))
        row_ids_np = np.random.default_rng(rank + 10 * i).integers(0, big[0], big[0])
        val = mx.nd.zeros(big, stype="row_sparse", dtype=dtype)
        kv.row_sparse_pull("97", out=val, row_ids=mx.nd.array(row_ids_np).reshape((-1, 2)))
        updated = np.ones(big)
        for r in range(n):
            updated[update_rows[r]] += (r + 1) * RATE * (i + 1)
        expected = np.zeros(big)
        expected[row_ids_np] = updated[row_ids_np]
        np.testing.assert_array_equal(val.asnumpy(), expected)
    # a dense out of a row table, and pull of every row
    dense = mx.nd.zeros(big, dtype=dtype)
    kv.pull("97", out=dense)
    np.testing.assert_array_equal(dense.asnumpy(), updated)


# -- every MXNet optimizer on the owners ----------------------------------------------------
def _all_optimizers():
    return sorted(mx.optimizer.Optimizer.opt_registry)


def _make(name, multi_precision):
    kw = {"learning_rate": 0.05, "wd": 0.01, "rescale_grad": 0.5,
          "multi_precision": multi_precision}
    if name == "groupadagrad":
        kw.pop("wd")    # (it takes no weight decay)
    return mx.optimizer.create(name, **kw)


#: MXNet rules whose step reads the whole weight: refused for split keys
WHOLE_WEIGHT = ("lars", "lbsgd", "groupadagrad")


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("dtype,multi_precision",
                         [("float32", False), ("float16", False), ("float16", True)],
                         ids=["f32", "f16", "f16-mp"])
@pytest.mark.parametrize("name", _all_optimizers())
def test_every_mxnet_optimizer_on_the_owners(comm, name, dtype, multi_precision, split):
    """Each optimizer of mx.optimizer (and contrib's GroupAdaGrad, and MXNet's own
    ``test``) run through the store equals MXNet's own updater on the sum: the five
    mapped ones by mpikv, the others by MXNet's own operators on the owners (bit for
    bit). A dtype MXNet itself cannot update is an OptimizerError on every rank."""
    if split and name == "lamb":
        pytest.skip("mpikv's LAMB sums its norms over the owners: tests/mxnet/test_trainer.py")
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((6, 3)).astype(dtype)
    grads = [rng.standard_normal((6, 3)).astype(dtype) for _ in range(3)]
    ref = mx.nd.array(w0, dtype=dtype)
    updater = mx.optimizer.get_updater(_make(name, multi_precision))
    mx.random.seed(1)
    try:
        for g in grads:
            updater(0, mx.nd.array(g, dtype=dtype), ref)
        want = ref.asnumpy()
    except mx.base.MXNetError:
        want = None
    kv = mpikv.mxnet.create("dist_sync", bigarray_bound=4 if split else None)
    kv.set_optimizer(_make(name, multi_precision))
    kv.init(0, mx.nd.array(w0, dtype=dtype))
    mp_opt = kv.kvstore.optimizer
    mapped = name in ("sgd", "ccsgd", "nag", "adam", "rmsprop", "lamb")
    assert (type(mp_opt).__name__ == "MXNetRule") is not mapped
    zero = mx.nd.zeros((6, 3), dtype=dtype)

    def push_all():
        mx.random.seed(1)
        for g in grads:   # rank 0's gradient, the others' zeros: the sum is exact
            kv.push(0, mx.nd.array(g, dtype=dtype) if comm.rank == 0 else zero)

    if want is None and mapped:
        push_all()   # mpikv's own RMSProp updates float16 weights where MXNet's cannot
        return
    if want is None:
        msg = raises_everywhere(comm, mpikv.OptimizerError, push_all)
        assert f"cannot update {dtype} weights" in msg
        return
    if split and comm.size > 1 and name in WHOLE_WEIGHT:
        msg = raises_everywhere(comm, mpikv.OptimizerError, push_all)
        assert "reads the whole weight, but key 0 is split over" in msg
        return
    if name == "sgld" and (comm.size > 1 or split):
        push_all()   # random noise drawn on each owner: no single-process reference
        return
    push_all()
    out = mx.nd.zeros((6, 3), dtype=dtype)
    kv.pull(0, out=out)
    got = out.asnumpy()
    if mapped and dtype == "float16":
        # mpikv's own steps run in float32 (rounded once into the weight, or its float32
        # master's rounding); MXNet's in float16, or in its own order: a few float16 ulps.
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=0, atol=5e-3)
    elif mapped:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)
    same_on_every_rank(comm, [got])


def test_mxnet_rules_on_a_row_table_and_their_states_resume(comm, shared_dir):
    """MXNet's Signum (no sparse kernel: MXNet densifies the gradient, every row steps)
    on a row table equals MXNet's updater; its states save and load with the optimizer."""
    import os
    kv = mpikv.mxnet.create("dist_sync")
    kv.set_optimizer(mx.optimizer.Signum(learning_rate=0.1, momentum=0.5))
    w0 = np.arange(20, dtype=np.float32).reshape(10, 2) / 10
    kv.init(5, mx.nd.array(w0).tostype("row_sparse"))
    ref = mx.nd.array(w0)
    updater = mx.optimizer.get_updater(mx.optimizer.Signum(learning_rate=0.1, momentum=0.5))
    for step in range(2):
        g = np.zeros((10, 2), np.float32)
        g[[1, 4, 4 + step]] = [[1, -1], [2, 2], [-3, 1]]
        mine = mx.nd.array(g if comm.rank == 0 else np.zeros_like(g)).tostype("row_sparse")
        kv.push(5, mine)
        updater(0, mx.nd.array(g).tostype("row_sparse"), ref)
    out = mx.nd.zeros((10, 2))
    kv.pull(5, out=out)
    np.testing.assert_array_equal(out.asnumpy(), ref.asnumpy())
    fname = os.path.join(shared_dir, "signum.states")
    kv.save_optimizer_states(fname, dump_optimizer=True)
    kv.load_optimizer_states(fname)
    assert type(kv.optimizer) is mx.optimizer.Signum and kv.optimizer.momentum == 0.5


# -- errors as MXNet's clients catch them ---------------------------------------------------
def test_errors_are_mxnets_and_mpikvs(comm):
    kv = mpikv.mxnet.create("dist_sync")
    kv.init("e", mx.nd.ones((4, 2)).tostype("row_sparse"))
    out = mx.nd.sparse.zeros("row_sparse", (4, 2))
    msg = raises_everywhere(comm, mx.base.MXNetError,
                            lambda: kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([9])))
    assert msg.startswith("ShapeError") and "indices must lie in [0, 4)" in msg
    msg = raises_everywhere(comm, mpikv.UnknownKeyError,
                            lambda: kv.row_sparse_pull("nope", out=out, row_ids=mx.nd.array([0])))
    msg = raises_everywhere(comm, mx.base.MXNetError,
                            lambda: kv.pull("nope", out=mx.nd.zeros((4, 2))))
    assert msg.startswith("UnknownKeyError")
    msg = raises_everywhere(comm, AssertionError, lambda: kv.row_sparse_pull("e", out=out))
    assert "row_sparse_pull needs row_ids" in msg
    msg = raises_everywhere(comm, mpikv.ShapeError, lambda: kv.push(
        "e", mx.nd.ones((5, 2)).tostype("row_sparse")))
    msg = raises_everywhere(comm, mpikv.DuplicateInitError, lambda: kv.init(
        "e", mx.nd.ones((4, 2)).tostype("row_sparse")))
    msg = raises_everywhere(comm, mpikv.ShapeError, lambda: kv.row_sparse_pull(
        "e", out=mx.nd.zeros((3, 2)), row_ids=mx.nd.array([0])))
    # still usable, nothing applied
    kv.row_sparse_pull("e", out=out, row_ids=mx.nd.array([0, 3]))
    np.testing.assert_array_equal(out.asnumpy()[[0, 3]], 1.0)


def test_is_capable_as_mxnet():
    kv = mpikv.mxnet.create("local")
    assert kv.is_capable("optimizer") and kv.is_capable("OPTIMIZER")
    assert kv.is_capable(mx.kv.KVStoreBase.OPTIMIZER)
    with pytest.raises(ValueError, match="Unknown capability: sparse"):
        kv.is_capable("sparse")
    with pytest.raises(AttributeError):   # (MXNet's own store: capability.lower())
        kv.is_capable(None)


def test_an_optimizer_config_round_trip():
    """An MXNetRule's config (its class and own attributes) rebuilds the MXNet object."""
    opt = mx.optimizer.Signum(learning_rate=0.3, momentum=0.7, wd_lh=0.01, wd=0.02)
    mp = optimizers.to_mpikv(opt)
    config = mp.get_config()
    assert config["name"] == "mxnet" and config["kind"] == \
        "mxnet.optimizer.optimizer:Signum"
    assert config["attributes"] == {"momentum": 0.7, "wd_lh": 0.01}
    back = optimizers.to_mxnet(config)
    assert type(back) is mx.optimizer.Signum
    assert (back.lr, back.wd, back.momentum, back.wd_lh) == (0.3, 0.02, 0.7, 0.01)
    assert optimizers.to_mpikv(back).get_config() == config


# -- MXNet rules through Gluon's Trainer (dense parameters) ---------------------------------
@pytest.mark.parametrize("optimizer,params", [
    ("signum", {"learning_rate": 0.01, "momentum": 0.9, "wd_lh": 0.01}),
    ("adagrad", {"learning_rate": 0.05, "wd": 1e-3}),
    ("adadelta", {"learning_rate": 1.0}),
    ("ftml", {"learning_rate": 0.01}),
    ("adamax", {"learning_rate": 0.01, "clip_gradient": 0.1}),
], ids=["signum", "adagrad", "adadelta", "ftml", "adamax"])
def test_trainer_with_mxnet_rules_follows_changes(comm, optimizer, params):
    """MXNet's own optimizers on the owners through an unchanged Gluon Trainer (the
    helpers' MLP), with set_learning_rate and an attribute changed mid-training,
    against MXNet's own local store on the global batch."""
    from .helpers import close, make_net, rows, step, train_local, weights

    def lr(trainer):
        trainer.set_learning_rate(trainer.learning_rate / 2)

    def attr(trainer):
        trainer.optimizer.clip_gradient = 0.05
    changes = {1: lr, 2: attr}
    want, want_lrs = train_local(optimizer, params, 4, changes=changes)
    net = make_net()
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(params),
                            kvstore="mpikv_dist_sync")
    lrs = []
    for i in range(4):
        changes.get(i, lambda t: None)(trainer)
        step(net, trainer, i, rows(comm.rank, comm.size))
        lrs.append(trainer.learning_rate)
    assert type(trainer._kvstore.kvstore.optimizer).__name__ == "MXNetRule"
    assert lrs == want_lrs
    close(weights(net), want)
    same_on_every_rank(comm, weights(net))


@pytest.mark.parametrize("sparse_weight", [False, True], ids=["sparse_grad", "row_sparse"])
def test_gluon_sparse_trainer_on_two_devices_per_rank(comm, sparse_weight):
    """Two CPU contexts per rank: each device's rows pushed together; a row_sparse_pull
    for several outputs with one id array fetches once and fills each."""
    ctxs = [mx.cpu(0), mx.cpu(1)]

    def run(kv, part):
        mx.random.seed(7)
        net = gluon.nn.Sequential()
        with net.name_scope():
            net.add(gluon.contrib.nn.SparseEmbedding(ROWS, DIM) if sparse_weight else
                    gluon.nn.Embedding(ROWS, DIM, sparse_grad=True))
            net.add(gluon.nn.Dense(1, in_units=2 * DIM))
        net.initialize(mx.init.Uniform(0.5), ctx=ctxs)
        trainer = gluon.Trainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.1, "momentum": 0.9,
                                 "rescale_grad": 1.0 / BATCH}, kvstore=kv)
        for i in range(3):
            x, y = _batch(i)
            xs = gluon.utils.split_and_load(mx.nd.array(x[part]), ctxs, even_split=False)
            ys = gluon.utils.split_and_load(mx.nd.array(y[part]), ctxs, even_split=False)
            with autograd.record():
                losses = [gluon.loss.L2Loss()(net(a), b) for a, b in zip(xs, ys)]
            for loss in losses:
                loss.backward()
            trainer.step(1)
        emb = net[0].weight
        return [emb.data(c).asnumpy() if emb._stype == "default" else
                emb.row_sparse_data(mx.nd.arange(ROWS, ctx=c)).asnumpy() for c in ctxs] + \
            [net[1].weight.data(c).asnumpy() for c in ctxs]

    want = run(mx.kv.create("local"), slice(None))
    got = run("mpikv_dist_sync", _mine(comm))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
    same_on_every_rank(comm, got)
