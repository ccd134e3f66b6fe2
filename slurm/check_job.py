"""A small mpikv job that checks an MPI launch: are all ranks one job, and do sums work?

    srun --mpi=pmix python slurm/check_job.py            # in an allocation
    mpiexec python slurm/check_job.py                    # in an allocation
    mpiexec -n 2 python slurm/check_job.py --expect 2    # anywhere

First it checks that ``COMM_WORLD`` has as many ranks as were launched: a
wrong PMI plugin (``srun --mpi=pmi2`` or ``--mpi=none`` with Open MPI 5)
silently starts N independent size-1 jobs, which would all "pass" on their own.
The expected count is ``--expect N``, else ``MPIKV_EXPECT_NTASKS`` (the job
scripts set it to the allocation's ``SLURM_NTASKS``), else ``SLURM_NTASKS`` (an
``srun`` step), else ``OMPI_COMM_WORLD_SIZE`` (``mpiexec``).

Then every rank pushes rank-dependent values into a ``dist_sync`` store (a small
key and one split over all owners), pulls, and checks the sums. Each rank prints
``mpikv-check rank R/N host H sum OK``; rank 0 ends with ``mpikv-check PASSED n=N``.
Exit codes: 0 passed; 3 wrong size; 4 wrong sums.
"""

import argparse
import os
import socket
import sys

import numpy as np


def expected_size(args):
    for name, value in (("--expect", args.expect),
                        ("MPIKV_EXPECT_NTASKS", os.environ.get("MPIKV_EXPECT_NTASKS")),
                        ("SLURM_NTASKS", os.environ.get("SLURM_NTASKS")),
                        ("OMPI_COMM_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE"))):
        if value not in (None, ""):
            return int(value), name
    return None, None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", type=int, help="the number of ranks launched")
    parser.add_argument("--timeout", type=float, default=60,
                        help="seconds a store call may wait for the others (default 60)")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    want, source = expected_size(args)
    if want is None:
        print(f"mpikv-check rank {rank}/{size} host {host}: cannot tell how many ranks were "
              "launched (no --expect, MPIKV_EXPECT_NTASKS, SLURM_NTASKS or "
              "OMPI_COMM_WORLD_SIZE); not checking the size", flush=True)
    elif size != want:
        print(f"mpikv-check FAILED on host {host}: COMM_WORLD has {size} rank(s) but {want} "
              f"were launched ({source}={want}). The ranks did not join one MPI job: with "
              "srun use --mpi=pmix (Open MPI 5 has no PMI2; pmi2 and none start "
              "independent singletons).", file=sys.stderr, flush=True)
        return 3

    import mpikv

    # bigarray_bound=16: the 40-element key is split over every owner.
    kv = mpikv.create("dist_sync", timeout=args.timeout, bigarray_bound=16)
    assert kv.rank == rank and kv.num_workers == size, (kv.rank, kv.num_workers, rank, size)
    small, big = np.zeros((2, 3)), np.zeros(40)
    kv.init("small", small)
    kv.init("big", big)
    kv.push("small", np.full((2, 3), rank + 1.0))
    kv.push("big", np.arange(40.0) * (rank + 1))
    kv.pull("small", out=small)
    kv.pull("big", out=big)
    total = size * (size + 1) / 2  # the sum of rank + 1 over all ranks
    ok = bool(np.all(small == total) and np.array_equal(big, np.arange(40.0) * total))
    if ok:
        print(f"mpikv-check rank {rank}/{size} host {host} sum OK", flush=True)
    else:
        print(f"mpikv-check rank {rank}/{size} host {host} sum WRONG: small {small.ravel()}, "
              f"big[:4] {big[:4]}, want {total}", flush=True)
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    hosts = comm.gather(host)
    if rank == 0:
        if all_ok:
            # MPIKV_FAULT_TOLERANT=1 made the store fault tolerant (created: a ULFM launch)
            ft = " fault_tolerant" if os.environ.get("MPIKV_FAULT_TOLERANT") == "1" else ""
            print(f"mpikv-check PASSED n={size} hosts={','.join(sorted(set(hosts)))}{ft}",
                  flush=True)
        else:
            print(f"mpikv-check FAILED n={size}: wrong sums", flush=True)
    return 0 if all_ok else 4


if __name__ == "__main__":
    sys.exit(main())
