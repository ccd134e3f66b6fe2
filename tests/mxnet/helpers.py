"""A small Gluon model, its data and training loop, shared by the tests and their job script.

The global batch of every step is the same on every rank count: rank ``r`` of
``n`` takes rows ``[r*B/n, (r+1)*B/n)`` and every rank calls
``trainer.step(B)``, so the ranks' summed gradients are the global batch's,
as one process computes them.
"""

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

BATCH = 24          # divisible by 1, 2, 3 and 4 ranks
FEATURES, HIDDEN, CLASSES = 8, 16, 3


def make_net(seed=0, ctx=None):
    """Two dense layers, initialised from ``seed`` (the same on every rank)."""
    mx.random.seed(seed)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(HIDDEN, activation="relu", in_units=FEATURES),
            gluon.nn.Dense(CLASSES, in_units=HIDDEN))
    net.initialize(mx.init.Xavier(), ctx=ctx or mx.cpu())
    return net


def batch(step):
    """The global batch of ``step``: features and labels."""
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.float32)
    return x, y


def rows(rank, size):
    """This rank's rows of a global batch."""
    share = BATCH // size
    return slice(rank * share, (rank + 1) * share)


def step(net, trainer, i, part=slice(None), ctxs=None, weight=1.0):
    """One training step on ``part`` of batch ``i``, split over ``ctxs`` (devices)."""
    x, y = batch(i)
    x, y = x[part], y[part]
    ctxs = ctxs or [mx.cpu()]
    xs = gluon.utils.split_and_load(mx.nd.array(x), ctxs, even_split=False)
    ys = gluon.utils.split_and_load(mx.nd.array(y), ctxs, even_split=False)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        # weight 0 (the resume job's other ranks): gradients of exactly zero.
        losses = [loss_fn(net(a), b) if weight == 1.0 else
                  loss_fn(net(a), b, mx.nd.full((b.shape[0], 1), weight, ctx=b.context))
                  for a, b in zip(xs, ys)]
    for loss in losses:
        loss.backward()
    trainer.step(BATCH)


def weights(net, ctx=None):
    """The parameters' values, in the net's order."""
    return [p.data(ctx).asnumpy() for p in net.collect_params().values()]


def train_local(optimizer, params, steps, update_on_kvstore=True, changes=None, setup=None):
    """MXNet's own single-process run with the global batch: the reference.

    ``changes``: ``{step: fn(trainer)}`` applied before that step;
    ``setup``: ``fn(net)`` before the Trainer is made.
    """
    net = make_net()
    if setup:
        setup(net)
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(params),
                            kvstore=mx.kv.create("local"), update_on_kvstore=update_on_kvstore)
    lrs = []
    for i in range(steps):
        if changes and i in changes:
            changes[i](trainer)
        step(net, trainer, i)
        lrs.append(trainer.learning_rate)
    return weights(net), lrs


def close(got, want):
    """Equal within float32 rounding (a few ulps of values of order 1)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
