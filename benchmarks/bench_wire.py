"""The 16-bit wire's codec alone: encode + decode time per element, numpy against torch.

From a clone of mpikv (one process, no MPI)::

    OMP_NUM_THREADS=1 python benchmarks/bench_wire.py              # 16 Mi floats
    OMP_NUM_THREADS=1 python benchmarks/bench_wire.py --mi 4 --reps 9

Per case, on one float32 gradient of ``--mi`` Mi random normal values: the
sender's encode (the cast, or with error feedback: add the residual, round,
keep what the rounding lost) and one decode (16 bits back to float32, what an
owner does per rank before its float32 sum), through
:mod:`mpikv.arrays.compression`'s codecs with the backend forced to numpy (the
store without torch, and every release before issue 39) or torch (views of the
same memory; the default where torch is loaded). Cases take turns; the figure
is the median over ``--reps`` rounds, in ns per element. torch runs with one
thread (``torch.set_num_threads(1)``), as a rank of the tests does.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's mpikv comes first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench(mi, reps):
    import torch

    from mpikv.arrays import compression as C

    torch.set_num_threads(1)
    n = mi << 20
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    wire = np.empty(n, np.uint16)
    back = np.empty(n, np.float32)
    cases = []
    for backend in ("numpy", "torch"):
        for kind in ("fp16", "bf16"):
            for feedback in (False, True):
                codec, ws = C.SixteenBit(kind, feedback), C.Workspace()
                residual = np.zeros(n, np.float32) if feedback else None
                cases.append(((backend, kind, feedback), codec, ws, residual))
    times = {c[0]: {"encode": [], "decode": []} for c in cases}
    saved = C.BACKEND
    try:
        for _ in range(reps + 1):   # the first round warms the buffers up, untimed
            for name, codec, ws, residual in cases:
                C.BACKEND = name[0]
                a = time.perf_counter()
                codec.encode(g, residual, wire, ws)
                b = time.perf_counter()
                codec.decode(wire, n, ws, back)
                c = time.perf_counter()
                times[name]["encode"].append((b - a) / n * 1e9)
                times[name]["decode"].append((c - b) / n * 1e9)
    finally:
        C.BACKEND = saved
    rows = []
    for name, t in times.items():
        enc, dec = statistics.median(t["encode"][1:]), statistics.median(t["decode"][1:])
        rows.append({"backend": name[0], "kind": name[1], "error feedback": name[2],
                     "encode ns": enc, "decode ns": dec, "total ns": enc + dec})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_wire.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mi", type=int, default=16, help="Mi float32 values (default 16)")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    args = parser.parse_args(argv)
    rows = bench(args.mi, args.reps)
    print(f"16-bit wire codec, {args.mi} Mi float32 values, median of {args.reps} rounds, "
          f"ns per element")
    print(f"  {'backend':7s} {'type':4s} {'feedback':8s} {'encode':>7s} {'decode':>7s} "
          f"{'total':>7s}")
    for r in rows:
        print(f"  {r['backend']:7s} {r['kind']:4s} {str(r['error feedback']):8s} "
              f"{r['encode ns']:7.2f} {r['decode ns']:7.2f} {r['total ns']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
