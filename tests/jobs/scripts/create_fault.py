"""A rank that fails or never comes before any store exists, while the others make
one; tests/jobs/test_create_watchdog.py runs it (issue 38, class 3).

Usage: create_fault.py CASE

Cases (rank 1 is the odd one; the others make a store and use it):
    raise_before: rank 1 raises before making any store.
    bad_comm: rank 1 gives create() a communicator that is not one (raises in it).
    stuck_before: rank 1 never comes (sleeps); the others' creation meets the timeout.
    ddp: rank 1 gives mpikv.torch.DistributedDataParallel an argument DDP does not
        take; the others go on to DistributedOptimizer, which makes the store.
    torch_group: every rank makes the "mpikv" torch.distributed group (torch wraps the
        exception hook then), rank 1 raises, the others wait in a barrier.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import mpikv


def main(case):
    odd = MPI.COMM_WORLD.Get_rank() == 1
    if case == "ddp":
        return ddp(odd)
    if case == "torch_group":
        return torch_group(odd)
    comm = None
    if odd and case == "raise_before":
        raise RuntimeError("boom before any store")
    if odd and case == "stuck_before":
        time.sleep(600)
    if odd and case == "bad_comm":
        comm = "world"
    kv = mpikv.create("dist_sync", comm=comm)
    kv.init("w", np.zeros(3))
    kv.push("w", np.ones(3))
    print(f"rank {kv.rank}: finished", flush=True)


def ddp(odd):
    import torch
    import mpikv.torch as mt
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model = mt.DistributedDataParallel(model, **({"bogus_argument": 1} if odd else {}))
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: finished", flush=True)


def torch_group(odd):
    import torch.distributed as dist
    import mpikv.torch as mt
    mt.init_process_group("mpikv")
    if odd:
        raise RuntimeError("boom after init_process_group")
    dist.barrier()
    print(f"rank {dist.get_rank()}: finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
