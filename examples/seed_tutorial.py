"""MXNet's KVStore tutorial, on mpikv with numpy arrays.

    python examples/seed_tutorial.py                       # local store
    scripts/mpirun.sh -n 4 python examples/seed_tutorial.py --type dist_sync

On a local store it prints what MXNet's tutorial prints. On ``dist_sync`` with
N ranks every rank pushes the same values, so the results are sums over the
ranks (8N after every rank pushed 8); rank 0 prints the values, and each
"update on key" line comes from the rank that owns the key.
"""

import argparse
import sys

import numpy as np

import mpikv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="local", help="store type (default: local)")
    args = parser.parse_args(argv)

    kv = mpikv.create(args.type)
    show = print if kv.rank == 0 else (lambda *a, **k: None)
    show(f"store {kv.type}: {kv.num_workers} worker(s)")

    shape = (2, 3)
    kv.init(3, np.ones(shape) * 2)
    a = np.zeros(shape)
    kv.pull(3, out=a)
    show(a)

    kv.push(3, np.ones(shape) * 8)
    kv.pull(3, out=a)
    show(a)

    devices = [np.ones(shape) for _ in range(4)]
    kv.push(3, devices)
    kv.pull(3, out=a)
    show(a)

    def update(key, value, stored):
        print(f"update on key: {key}", flush=True)
        stored += value * 2

    kv.set_updater(update)
    kv.pull(3, out=a)
    show(a)

    kv.push(3, np.ones(shape))
    kv.pull(3, out=a)
    show(a)

    b = [np.zeros(shape) for _ in range(4)]
    kv.pull(3, out=b)
    show(b[1])

    keys = [5, 7, 9]
    kv.init(keys, [np.ones(shape)] * len(keys))
    kv.push(keys, [np.ones(shape)] * len(keys))
    b = [[np.zeros(shape) for _ in range(4)] for _ in keys]
    kv.pull(keys, out=b)
    show(b[1][1])

    kv.push(keys, [[np.ones(shape) for _ in range(4)] for _ in keys])
    kv.pull(keys, out=b)
    show(b[1][1])
    kv.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
