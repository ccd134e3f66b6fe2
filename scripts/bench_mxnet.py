"""What mpikv.mxnet adds to a call: Gluon's per-parameter pushpull with NDArrays against
the same call on the mpikv store with numpy arrays, in one job (median of the slowest
rank, microseconds).

    MPIKV_VENV=.venv-mxnet scripts/mpirun.sh -n 2 .venv-mxnet/bin/python scripts/bench_mxnet.py
"""

import time

import numpy as np
import mxnet as mx
from mpi4py import MPI

import mpikv
import mpikv.mxnet

REPS = 200


def timed(fn, comm):
    times = []
    for _ in range(REPS):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return max(comm.allgather(float(np.median(times)))) * 1e6


def main():
    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in (4 << 10, 4 << 20):
        n = nbytes // 4
        for optimizer in (False, True):
            adapter = mpikv.mxnet.create("dist_sync")
            plain = mpikv.create("dist_sync")
            adapter.init(0, mx.nd.zeros((n,)))
            plain.init(0, np.zeros(n, np.float32))
            if optimizer:
                adapter.set_optimizer(mx.optimizer.SGD(learning_rate=0.0, momentum=0.9))
                plain.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.0, momentum=0.9))
            grad_nd, weight_nd = mx.nd.ones((n,)), mx.nd.zeros((n,))
            grad, weight = np.ones(n, np.float32), np.zeros(n, np.float32)
            # Gluon's calls: with update_on_kvstore, pushpull(i, grad, out=weight);
            # without, pushpull(i, grad) (the sum back into the gradient).
            if optimizer:
                a = timed(lambda: adapter.pushpull(0, grad_nd, out=weight_nd, priority=0), comm)
                b = timed(lambda: plain.pushpull(0, grad, out=weight, priority=0), comm)
            else:
                a = timed(lambda: adapter.pushpull(0, grad_nd, priority=0), comm)
                b = timed(lambda: plain.pushpull(0, grad, priority=0), comm)
            rows.append((nbytes, optimizer, a, b))
    if comm.rank == 0:
        print(f"{comm.size} ranks, {REPS} calls each, median of the slowest rank")
        print("key      optimizer on owners  mpikv.mxnet (NDArray) us  mpikv (numpy) us  added us")
        for nbytes, optimizer, a, b in rows:
            print(f"{nbytes >> 10:>5} KiB {str(optimizer):>19} {a:>25.1f} {b:>17.1f} {a - b:>9.1f}")


if __name__ == "__main__":
    main()
