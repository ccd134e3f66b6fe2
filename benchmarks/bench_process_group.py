"""The "mpikv" torch.distributed backend against gloo and raw mpi4py, interleaved.

    scripts/mpirun.sh -n 2 .venv/bin/python benchmarks/bench_process_group.py

Per size: the median of ``--reps`` all_reduce calls (SUM, float32, in place) on the
"mpikv" group, the gloo group, and mpi4py's Allreduce (IN_PLACE) on the same
ranks, taking turns call by call; in brackets the store strategy the group's
tuning table chose for the size.
"""

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import mpikv.torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,64M", help="bytes per call (K, M suffixes)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    mpikv.torch.init_process_group("gloo")
    ours = dist.new_group(backend="mpikv")
    comm = MPI.COMM_WORLD.Dup()
    for text in args.sizes.split(","):
        n = int(float(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]) // 4
        t = torch.ones(n)
        a = t.numpy()
        reps = args.reps if n < (1 << 20) else max(5, args.reps // 10)
        ways = {"mpikv": lambda: dist.all_reduce(t, group=ours),
                "gloo": lambda: dist.all_reduce(t),
                "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)}
        times = {k: [] for k in ways}
        for _ in range(reps):
            for name, call in ways.items():
                comm.Barrier()
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        slowest = {k: comm.allreduce(float(np.median(v)), op=MPI.MAX) for k, v in times.items()}
        if comm.rank == 0:
            line = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in slowest.items())
            how = mpikv.torch.process_group.backend_of(ours).sums.strategy(a.nbytes)
            print(f"{text} x {comm.size} ranks ({how}): {line}; mpikv/gloo {slowest['mpikv'] / slowest['gloo']:.2f}, "
                  f"mpikv/mpi4py {slowest['mpikv'] / slowest['mpi4py']:.2f}", flush=True)
    dist.destroy_process_group(ours)
    dist.destroy_process_group()
    comm.Free()


if __name__ == "__main__":
    main()
