"""Benchmarks of mpikv against raw mpi4py on the same bytes, in the same run.

    scripts/mpirun.sh -n 2 python -m mpikv.bench agreement

``agreement``: what the per-call agreement step costs (fingerprint, one small
gather to rank 0 and one broadcast), for calls of 1 to 1000 keys, next to a
raw ``MPI_Barrier`` and a raw 4 KiB in-place ``Allreduce``.
"""

import argparse
import json
import sys
import time

import numpy as np


def _median_us(fn, comm, repeat):
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    # The slowest rank's median is the call's cost.
    return max(comm.allgather(float(np.median(times)))) * 1e6


def bench_agreement(repeat):
    """Returns rows of (case, microseconds per call)."""
    from mpi4py import MPI

    import mpikv
    from mpikv.agreement import describe

    comm = MPI.COMM_WORLD
    kv = mpikv.create("dist_sync")
    rows = []
    buf = np.ones(1024, np.float32)
    rows.append(("raw MPI_Barrier", _median_us(comm.Barrier, comm, repeat)))
    rows.append(("raw Allreduce 4 KiB in place",
                 _median_us(lambda: comm.Allreduce(MPI.IN_PLACE, buf), comm, repeat)))
    rows.append(("kv.barrier() (agreement + MPI_Barrier)", _median_us(kv.barrier, comm, repeat)))
    for nkeys in (1, 100, 1000):
        keys = list(range(nkeys * 10, nkeys * 10 + nkeys))
        kv.init(keys, [np.zeros(1024, np.float32)] * nkeys)
        grads = [np.ones(1024, np.float32)] * nkeys

        def agree_only():
            call = kv._read("push", keys, grads, need_values=True, settings=kv._push_settings(0))
            digest, _ = describe(call)
            kv._transport.agree(digest, bool(call.errors), ("push", keys))

        rows.append((f"agreement of a push of {nkeys} key(s) (read + fingerprint + exchange)",
                     _median_us(agree_only, comm, max(10, repeat // nkeys))))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mpikv.bench", description=__doc__)
    parser.add_argument("what", choices=["agreement"])
    parser.add_argument("--repeat", type=int, default=1000)
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    from mpi4py import MPI
    rows = bench_agreement(args.repeat)
    if MPI.COMM_WORLD.rank == 0:
        if args.json:
            print(json.dumps([{"case": c, "us": round(us, 2)} for c, us in rows]))
        else:
            print(f"{MPI.COMM_WORLD.size} ranks; median microseconds per call (slowest rank)")
            for case, us in rows:
                print(f"{us:10.1f}  {case}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
