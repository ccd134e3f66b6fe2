"""Gluon training that stops, saves and resumes on another number of ranks; run by
tests/mxnet/test_resume.py under mpiexec.

Usage:
    resume.py FIRST LAST --optimizer sgd|adam [--load PREFIX] [--save PREFIX] [--out W.npz]

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
from mxnet import gluon  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpikv.mxnet  # noqa: E402,F401

from tests.mxnet.helpers import make_net, step, weights  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda: ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}),
    "adam": lambda: ("adam", {"learning_rate": 0.01, "wd": 1e-3,
                              "lr_scheduler": mx.lr_scheduler.FactorScheduler(2, 0.7)}),
}


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), required=True)
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--out")
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    net = make_net(seed=0 if a.load is None else 99)
    net[0].weight.lr_mult = 0.5
    if a.load:
        net.load_parameters(a.load + ".params")
    name, params = OPTIMIZERS[a.optimizer]()
    trainer = gluon.Trainer(net.collect_params(), name, params, kvstore="mpikv_dist_sync")
    if a.load:
        trainer.load_states(a.load + ".states")
    for i in range(a.first, a.last):
        if i == 2 and a.optimizer == "sgd":
            trainer.set_learning_rate(0.05)     # before the save: the file must bring it
        step(net, trainer, i, weight=1.0 if comm.rank == 0 else 0.0)
    if a.save:
        trainer.save_states(a.save + ".states")
        if comm.rank == 0:
            net.save_parameters(a.save + ".params")
        comm.barrier()
    if a.out and comm.rank == 0:
        np.savez(a.out, *weights(net), lr=trainer.learning_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
