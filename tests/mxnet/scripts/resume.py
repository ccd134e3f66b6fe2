"""Gluon training that stops, saves and resumes on another number of ranks; run by
tests/mxnet/test_resume.py under mpiexec.

Usage:
    resume.py FIRST LAST --optimizer sgd|adam [--sparse grad|weight] [--load PREFIX]
              [--save PREFIX] [--out W.npz]

``--sparse``: an embedding table in front of the net, with a row_sparse gradient
(``Embedding(sparse_grad=True)``) or a row_sparse weight (``SparseEmbedding``): a row
table on the store, its rows and lazy optimizer state saved by their owners.

Rank 0 trains on the whole global batch; the other ranks on the same rows with loss
weight 0 (gradients of exactly zero), so the ranks' sum is the same on any number of
ranks and a resumed run can be compared bit for bit with one that never stopped.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpikv.mxnet  # noqa: E402,F401

from tests.mxnet.helpers import make_net, step, weights  # noqa: E402

ROWS, DIM, BATCH = 40, 3, 16

OPTIMIZERS = {
    "sgd": lambda: ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}),
    "adam": lambda: ("adam", {"learning_rate": 0.01, "wd": 1e-3,
                              "lr_scheduler": mx.lr_scheduler.FactorScheduler(2, 0.7)}),
}


def make_sparse_net(kind, seed):
    """An embedding of 2 ids per example (row_sparse gradient or weight), then Dense."""
    mx.random.seed(seed)
    net = gluon.nn.Sequential()   # (SparseEmbedding is not a HybridBlock)
    with net.name_scope():
        net.add(gluon.contrib.nn.SparseEmbedding(ROWS, DIM) if kind == "weight" else
                gluon.nn.Embedding(ROWS, DIM, sparse_grad=True))
        net.add(gluon.nn.Dense(1, in_units=2 * DIM))
    net.initialize(mx.init.Uniform(0.5))
    return net


def sparse_step(net, trainer, i, weight):
    """Step ``i`` on the whole global batch of Zipf-like ids; ``weight`` 0: zero gradients
    of the same rows."""
    rng = np.random.default_rng(500 + i)
    ids = np.minimum(rng.zipf(1.5, (BATCH, 2)) - 1, ROWS - 1).astype(np.float32)
    y = rng.standard_normal((BATCH, 1)).astype(np.float32)
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(mx.nd.array(ids)), mx.nd.array(y)) * weight
    loss.backward()
    trainer.step(1)


def sparse_weights(net):
    """Every parameter's whole value (a row_sparse weight: all its rows)."""
    return [p.row_sparse_data(mx.nd.arange(p.shape[0])).asnumpy() if p._stype == "row_sparse"
            else p.data().asnumpy() for p in net.collect_params().values()]


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), required=True)
    p.add_argument("--sparse", choices=["grad", "weight"])
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--out")
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    seed = 0 if a.load is None else 99
    net = make_sparse_net(a.sparse, seed) if a.sparse else make_net(seed=seed)
    net[0].weight.lr_mult = 0.5
    if a.load:
        net.load_parameters(a.load + ".params")
    name, params = OPTIMIZERS[a.optimizer]()
    if a.sparse:   # the store exists before the first step: a fixed rescale_grad
        params["rescale_grad"] = 1.0 / BATCH
    trainer = gluon.Trainer(net.collect_params(), name, params, kvstore="mpikv_dist_sync")
    if a.load:
        trainer.load_states(a.load + ".states")
    for i in range(a.first, a.last):
        if i == 2 and a.optimizer == "sgd":
            trainer.set_learning_rate(0.05)     # before the save: the file must bring it
        if a.sparse:
            sparse_step(net, trainer, i, weight=1.0 if comm.rank == 0 else 0.0)
        else:
            step(net, trainer, i, weight=1.0 if comm.rank == 0 else 0.0)
    # A row_sparse weight's whole value is a pull of its rows: collective, on every rank.
    values = sparse_weights(net) if a.sparse else weights(net)
    if a.save:
        trainer.save_states(a.save + ".states")
        if comm.rank == 0:   # save_parameters' file, from the values pulled above
            names = list(net._collect_params_with_prefix())
            mx.nd.save(a.save + ".params", dict(zip(names, map(mx.nd.array, values))))
        comm.barrier()
    if a.out and comm.rank == 0:
        np.savez(a.out, *values, lr=trainer.learning_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
