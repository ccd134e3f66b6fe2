"""Training steps that stop, checkpoint and resume; run by tests/jobs/test_resume.py.

Usage:
    resume.py run FIRST LAST [--load CKPT] [--save CKPT] [--out WEIGHTS.npz]
    resume.py killsave CKPT WEIGHTS.npz
"""

import argparse
import sys
import time

import numpy as np

import mpikv
from mpikv import optimizer, statefile

SHAPES = {"conv": (40, 9), "bias": (7,), "fc": (3, 5)}  # conv is split (bound 100)


def make_store():
    return mpikv.create("dist_sync", bigarray_bound=100, timeout=120)


def fresh(kv):
    rng = np.random.default_rng(0)
    kv.init(sorted(SHAPES), [rng.standard_normal(SHAPES[k]).astype(np.float32)
                             for k in sorted(SHAPES)])
    sched = optimizer.FactorScheduler(step=2, factor=0.7, base_lr=0.05)
    kv.set_optimizer(optimizer.Adam(lr_scheduler=sched, wd=0.01))


def step(kv, i):
    # Rank 0 pushes the gradient, the others zeros: the sum is the same on any rank count.
    rng = np.random.default_rng(100 + i)
    grads = [rng.standard_normal(SHAPES[k]).astype(np.float32) for k in sorted(SHAPES)]
    if kv.rank:
        grads = [np.zeros_like(g) for g in grads]
    kv.push(sorted(SHAPES), grads)


def weights(kv):
    out = [np.zeros(SHAPES[k], np.float32) for k in sorted(SHAPES)]
    kv.pull(sorted(SHAPES), out=out)
    return dict(zip(sorted(SHAPES), out))


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["run", "killsave"])
    p.add_argument("args", nargs="*")
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--out")
    a = p.parse_args(argv)
    kv = make_store()
    if a.mode == "run":
        first, last = int(a.args[0]), int(a.args[1])
        if a.load:
            kv.load_checkpoint(a.load)
        else:
            fresh(kv)
        for i in range(first, last):
            step(kv, i)
        if a.save:
            kv.save_checkpoint(a.save)
        w = weights(kv)
        if a.out and kv.rank == 0:
            np.savez(a.out, **w)
        return 0
    ckpt, out = a.args
    fresh(kv)
    step(kv, 0)
    kv.save_checkpoint(ckpt)
    w = weights(kv)
    if kv.rank == 0:
        np.savez(out, **w)
    step(kv, 1)
    real = statefile.write_part

    def slow_write_part(*args, **kw):
        record = real(*args, **kw)
        print(f"IN_SAVE rank {kv.rank}", flush=True)
        time.sleep(120)
        return record

    statefile.write_part = slow_write_part
    kv.save_checkpoint(ckpt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
