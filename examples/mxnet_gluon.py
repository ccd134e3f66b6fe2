"""MXNet Gluon's crash-course training loop, data-parallel on MPI through mpikv.mxnet.

    MPIKV_VENV=.venv-mxnet scripts/mpirun.sh -n 2 .venv-mxnet/bin/python examples/mxnet_gluon.py
    .venv-mxnet/bin/python examples/mxnet_gluon.py          # one process

(``bash scripts/setup_mxnet.sh`` makes ``.venv-mxnet``: MXNet 1.9.1, numpy < 1.24.)

This is the script of MXNet's Gluon tutorials (a multilayer perceptron, a
DataLoader, ``autograd.record``, ``loss.backward``, ``trainer.step``) as its
distributed-training tutorial writes it for MXNet's own store: create the
store, give each worker its share of the data with a sampler, hand the store
to the Trainer. Against that script, one line changes, the store's name
(``mx.kv.create("dist_sync")`` becomes ``mx.kv.create("mpikv_dist_sync")``),
and one line is added, ``import mpikv.mxnet``, which registers that name with
MXNet. No scheduler, no parameter servers: every MPI rank is a worker, and
the owner of some parameters, whose SGD it runs.

The data need no download: scikit-learn's digits (8x8 images) where
scikit-learn is installed, else ten synthetic classes of 64 features.
"""

import argparse
import hashlib
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, init, nd
from mxnet.gluon import nn

import mpikv.mxnet  # noqa: F401  (added: registers kvstore="mpikv_dist_sync")


def load_data(seed=0):
    """``(train_x, train_y, test_x, test_y, name)``: float32 features, int labels."""
    try:
        from sklearn.datasets import load_digits
        x, y = load_digits(return_X_y=True)
        x, name = x.astype(np.float32) / 16.0, "scikit-learn's digits"
    except ImportError:
        rng = np.random.default_rng(seed)
        centers = rng.standard_normal((10, 64)).astype(np.float32)
        y = rng.integers(0, 10, 2000)
        x = centers[y] + 2.2 * rng.standard_normal((2000, 64)).astype(np.float32)
        name = "synthetic data (10 classes, 64 features)"
    order = np.random.default_rng(seed + 1).permutation(len(x))
    x, y = x[order], y[order].astype(np.float32)
    cut = len(x) * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:], name


class SplitSampler(gluon.data.sampler.Sampler):
    """The indices of this worker's part of the data set, shuffled each epoch."""

    def __init__(self, length, num_parts, part_index, seed=0):
        self.part_len = length // num_parts
        self.start = self.part_len * part_index
        self.seed, self.epoch = seed, 0

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        self.epoch += 1
        return iter(self.start + rng.permutation(self.part_len))

    def __len__(self):
        return self.part_len


def accuracy(output, label):
    return (output.argmax(axis=1) == label.astype("float32")).mean().asscalar()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="global batch (all workers)")
    p.add_argument("--lr", type=float, default=0.05)
    a = p.parse_args()

    store = mx.kv.create("mpikv_dist_sync")       # changed: was mx.kv.create("dist_sync")
    rank, workers = store.rank, store.num_workers
    mx.random.seed(42)
    train_x, train_y, test_x, test_y, data_name = load_data()

    net = nn.Sequential()
    net.add(nn.Dense(128, activation="relu"),
            nn.Dense(64, activation="relu"),
            nn.Dense(10))
    net.initialize(init=init.Xavier())
    softmax_cross_entropy = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": a.lr, "momentum": 0.9},
                            kvstore=store)
    per_worker = a.batch // workers
    train_data = gluon.data.DataLoader(
        gluon.data.ArrayDataset(nd.array(train_x), nd.array(train_y)),
        batch_size=per_worker, last_batch="discard",
        sampler=SplitSampler(len(train_x), workers, rank))
    if rank == 0:
        print(f"{data_name}: {len(train_x)} training, {len(test_x)} test samples; "
              f"{workers} worker(s), global batch {per_worker * workers}")

    start = time.time()
    for epoch in range(a.epochs):
        train_loss, train_acc, tic = 0.0, 0.0, time.time()
        for data, label in train_data:
            with autograd.record():
                output = net(data)
                loss = softmax_cross_entropy(output, label)
            loss.backward()
            trainer.step(per_worker * workers)   # gradients summed over all workers
            train_loss += loss.mean().asscalar()
            train_acc += accuracy(output, label)
        test_acc = accuracy(net(nd.array(test_x)), nd.array(test_y))
        if rank == 0:
            print(f"Epoch {epoch}: loss {train_loss / len(train_data):.3f}, train acc "
                  f"{train_acc / len(train_data):.3f}, test acc {test_acc:.3f}, "
                  f"{time.time() - tic:.2f} sec")

    # Every worker ends with the same weights: compare their hashes.
    digest = hashlib.sha256(b"".join(p.data().asnumpy().tobytes()
                                     for p in net.collect_params().values())).hexdigest()
    comm = store.kvstore.comm      # the MPI communicator under the store
    digests = comm.allgather(digest) if comm is not None else [digest]
    if rank == 0:
        same = len(set(digests)) == 1
        print(f"final test accuracy {test_acc:.3f} in {time.time() - start:.1f} s; "
              f"weights {'equal' if same else 'DIFFERENT'} on all {workers} worker(s)")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
