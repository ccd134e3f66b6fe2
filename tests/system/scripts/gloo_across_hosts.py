"""Run by tests/system/test_cluster.py under scripts/cluster.sh run: each rank prints
what the cluster told it, then sums its rank + 1 over torch.distributed's gloo on the
cluster's interface (a framework other than MPI, on the same hosts)."""

import os
import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
env = {k: os.environ[f"MPIKV_CLUSTER_{k.upper()}"]
       for k in ("master", "ifname", "hosts", "ranks_per_host", "rate")}
total = "no torch"
try:
    import torch
    import torch.distributed as dist
except ImportError:
    torch = None
if torch is not None:
    os.environ["GLOO_SOCKET_IFNAME"] = env["ifname"]
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind((env["master"], 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://{env['master']}:{port}",
                            rank=comm.rank, world_size=comm.size)
    t = torch.tensor([comm.rank + 1.0])
    dist.all_reduce(t)
    total = float(t)
    dist.destroy_process_group()
print(f"rank {comm.rank} host {socket.gethostname()} master {env['master']} "
      f"ifname {env['ifname']} hosts {env['hosts']} per-host {env['ranks_per_host']} "
      f"rate {env['rate']} gloo-sum {total}", flush=True)
