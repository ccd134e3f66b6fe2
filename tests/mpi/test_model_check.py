"""A randomised model check: random sequences of calls against a numpy model of the store.

Push, pull, pushpull (into values and into outputs), asynchronous calls, zero-copy
buffers and an updater switched on and off, over split, fused, float16 and integer
keys, with one or two devices per rank. Every rank draws the same call sequence.
"""

import numpy as np
import pytest



pytestmark = pytest.mark.mpi
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_calls_match_a_numpy_model(make_store, comm, seed):
    kv = make_store(bigarray_bound=40, bucket_bytes=200)
    n, r = kv.num_workers, kv.rank
    rng = np.random.default_rng(seed)  # the same on every rank
    keys = list(range(12))
    shapes = {k: tuple(int(x) for x in rng.integers(1, 9, size=rng.integers(1, 3))) for k in keys}
    shapes[3], shapes[7], shapes[10] = (50,), (9, 7), (41,)  # split over the owners
    dts = {k: DTYPES[int(rng.integers(len(DTYPES)))] for k in keys}
    init = {k: rng.integers(-3, 4, size=shapes[k]).astype(dts[k]) for k in keys}
    model = {k: init[k].astype(np.float64) for k in keys}
    kv.init(keys, [init[k] if r == 0 else np.zeros(shapes[k], dts[k]) for k in keys])
    updater, zero_copy, bad = None, {}, []

    def val(k, step, rank, dev):
        g = np.random.default_rng([seed, step, rank, dev, k])
        return g.integers(-3, 4, size=shapes[k]).astype(dts[k])

    def expect(k, sums):
        total = sum(sums)
        new = model[k] + 2 * total if updater else total
        model[k] = new.astype(dts[k]).astype(np.float64)

    def check(k, arr, what):
        if not np.array_equal(np.asarray(arr, np.float64), model[k]):
            bad.append(f"{what} key {k} ({dts[k].__name__}): {arr.ravel()[:4]} "
                       f"!= {model[k].ravel()[:4]}")

    for step in range(40):
        op = rng.choice(["push", "pull", "pushpull", "pushpull_out", "updater", "zero", "async"])
        sub = [int(k) for k in rng.choice(keys, size=int(rng.integers(1, 6)), replace=False)]
        ndev = int(rng.integers(1, 3))
        if op in ("push", "pushpull", "pushpull_out", "async"):
            vals = [[val(k, step, r, d) for d in range(ndev)] for k in sub]
            arg = [v[0] if ndev == 1 else v for v in vals]
            for k in sub:
                expect(k, [val(k, step, q, d).astype(np.float64)
                           for q in range(n) for d in range(ndev)])
            if op == "push":
                kv.push(sub, arg)
            elif op == "async":
                outs = [np.empty(shapes[k], dts[k]) for k in sub]
                kv.wait(kv.pushpull_async(sub, arg, out=outs))
                for k, o in zip(sub, outs):
                    check(k, o, f"step {step} async")
            elif op == "pushpull":
                kv.pushpull(sub, arg)
                for k, v in zip(sub, vals):
                    for d in v:
                        check(k, d, f"step {step} pushpull")
            else:
                outs = [np.empty(shapes[k], dts[k]) for k in sub]
                kv.pushpull(sub, arg, out=outs)
                for k, o in zip(sub, outs):
                    check(k, o, f"step {step} pushpull(out=)")
        elif op == "pull":
            outs = [np.empty(shapes[k], dts[k]) for k in sub]
            kv.pull(sub, out=outs)
            for k, o in zip(sub, outs):
                check(k, o, f"step {step} pull")
        elif op == "updater":
            updater = None if updater else (
                lambda key, inp, stored: stored.__iadd__((inp * 2).astype(stored.dtype)))
            kv.set_updater(updater)
        else:
            sub = sorted(set(sub) - {k for k in keys if dts[k] == np.float16})
            if not sub:
                continue
            bufs = zero_copy.setdefault(tuple(sub), None) or kv.gradient_buffers(sub)
            zero_copy[tuple(sub)] = bufs
            for k, b in zip(sub, bufs):
                b[...] = val(k, step, r, 0)
            for k in sub:
                expect(k, [val(k, step, q, 0).astype(np.float64) for q in range(n)])
            kv.pushpull(sub, bufs)
            for k, b in zip(sub, bufs):
                check(k, b, f"step {step} zero-copy")
    outs = [np.empty(shapes[k], dts[k]) for k in keys]
    kv.pull(keys, out=outs)
    for k, o in zip(keys, outs):
        check(k, o, "final pull")
    everyone = comm.allgather(bad)
    assert not any(everyone), everyone
