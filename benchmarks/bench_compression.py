"""``python -m mpikv bench compression``: bytes moved and time per push, compressed or not.

From a clone of mpikv (``python benchmarks/bench_compression.py`` takes the same options)::

    scripts/mpirun.sh -n 2 python -m mpikv bench compression                 # 1, 16, 64 MiB
    scripts/mpirun.sh -n 2 python -m mpikv bench compression --kib 256 --mode sgd --json

For each size, one float32 key of that many bytes, pushed by every rank
(random normal gradients, a different stream per rank) through one store per
case: uncompressed (the ``allreduce`` strategy, the measured default), 2-bit
(threshold 0.5), fp16 and bf16; and, for reference, raw mpi4py's in-place
``Allreduce`` of the same bytes. Mode ``pushpull`` (default):
``kv.pushpull(key, g, out=o)`` with the default updater; mode ``sgd``:
``kv.push`` + ``kv.pull`` with SGD on the owners.

Bytes: what one call brings to a rank (the largest over ranks; "push": the
push alone, without the pull of mode ``sgd``), counted by ``kv.count_bytes()``
and, for raw mpi4py, :class:`mpikv.transport.counting.CountingComm` (payload
received; reductions as their bandwidth-optimal algorithms move them). Time:
the median over iterations of the slowest rank, every case interleaved with
the others in each iteration.
"vs none" is the uncompressed case's figure over the case's (above 1: fewer
bytes, or faster).

Compression trades arithmetic for bytes: each rank encodes its whole
gradient and decodes what it receives, in numpy, a few passes over memory
each. Where ranks share memory (one node) moving bytes costs about as much
as those passes, so compression is slower there; it pays where the network
is slower than the encoding (several nodes, slow links).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the clone's benchmarks and mpikv come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timer, library, refill  # noqa: E402

CASES = ("none", "2bit", "fp16", "bf16")
MODES = ("pushpull", "sgd")
DEFAULT_KIB = (1024, 16 * 1024, 64 * 1024)


def bench_compression(sizes_kib, mode, iterations, comm):
    """Returns a result dict: per size, a row per case with bytes and milliseconds."""
    from mpi4py import MPI

    import mpikv
    from mpikv.transport.counting import CountingComm

    rows = []
    for kib in sizes_kib:
        n = kib * 1024 // 4
        g = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        out = np.zeros(n, np.float32)
        raw = g.copy()
        stores = {}
        for case in CASES:
            kv = mpikv.create("dist_sync", reducer="allreduce")
            if case == "2bit":
                kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
            elif case != "none":
                kv.set_gradient_compression({"type": case})
            kv.init("g", np.zeros(n, np.float32))
            if mode == "sgd":
                kv.set_optimizer(mpikv.optimizer.SGD(learning_rate=0.01))
            stores[case] = kv

        def push(kv):
            if mode == "pushpull":
                kv.pushpull("g", g, out=out)
            else:
                kv.push("g", g)

        def pull(kv):
            if mode == "sgd":
                kv.pull("g", out=out)

        def call(kv):
            push(kv)
            pull(kv)

        moved, pushed = {}, {}
        for case, kv in stores.items():
            call(kv)   # a key's first push sets up its buffers
            with kv.count_bytes() as by_push:
                push(kv)
            with kv.count_bytes() as by_pull:
                pull(kv)
            moved[case] = max(comm.allgather(by_push.bytes + by_pull.bytes))
            pushed[case] = max(comm.allgather(by_push.bytes))
        counter = CountingComm(comm)
        counter.Allreduce(MPI.IN_PLACE, raw)
        moved["raw"] = pushed["raw"] = max(comm.allgather(counter.bytes))

        cases = [("raw", refill(raw, g), lambda: comm.Allreduce(MPI.IN_PLACE, raw))]
        cases += [(case, None, lambda kv=kv: call(kv)) for case, kv in stores.items()]
        timer = Timer(comm)
        timer.run(cases, iterations)
        ms = {name: timer.median(name) * 1e3 for name, _, _ in cases}
        for name, _, _ in cases:
            rows.append({"KiB": kib, "case": name, "bytes": moved[name],
                         "push bytes": pushed[name], "ms": ms[name],
                         "bytes vs none": moved["none"] / moved[name] if moved[name] else None,
                         "time vs none": ms["none"] / ms[name]})
    return {"ranks": comm.size, "library": library(), "iterations": iterations, "mode": mode,
            "rows": rows}


_LABELS = {"raw": "raw mpi4py Allreduce in place", "none": "mpikv, uncompressed",
           "2bit": "mpikv, 2bit (threshold 0.5)", "fp16": "mpikv, fp16", "bf16": "mpikv, bf16"}


def show(res):
    """Prints the table of :func:`bench_compression` (rank 0)."""
    call = ("pushpull(key, g, out=o)" if res["mode"] == "pushpull"
            else "push + pull, SGD on the owners")
    print(f"Gradient compression, {call}: {res['ranks']} ranks, {res['library']}, "
          f"{res['iterations']} iterations; bytes a rank receives per call; ms: median of "
          f"the slowest rank; vs none: uncompressed / case (above 1: better)")
    print(f"  {'size':>9s}  {'case':32s} {'push KiB':>9s} {'KiB moved':>10s} {'vs none':>8s} "
          f"{'ms':>9s} {'vs none':>8s}")
    for r in res["rows"]:
        ratio = "-" if r["bytes vs none"] is None else f"{r['bytes vs none']:.2f}"
        print(f"  {r['KiB']:6d} KiB  {_LABELS[r['case']]:32s} {r['push bytes'] / 1024:9.1f} "
              f"{r['bytes'] / 1024:10.1f} {ratio:>8s} {r['ms']:9.2f} {r['time vs none']:8.2f}")


def main(argv=None):
    """Parses the options, runs the cases, prints on rank 0."""
    parser = argparse.ArgumentParser(prog="python -m mpikv bench compression",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kib", type=int, action="append",
                        help="key size in KiB, repeatable; default 1024, 16384, 65536")
    parser.add_argument("--mode", choices=MODES, default="pushpull")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = parser.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    res = bench_compression(args.kib or DEFAULT_KIB, args.mode, args.iterations, comm)
    if comm.rank == 0:
        if args.json:
            print(json.dumps(res))
        else:
            show(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
