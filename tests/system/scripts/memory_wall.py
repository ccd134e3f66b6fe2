"""One rank of the memory wall: an MLP trained with AdamW under a per-rank memory cap.

Each rank moves itself into a memory cgroup of its own (cgroup v1, a child of
``--cgroup``) whose limit is ``--cap-weights`` times the model's weight bytes,
counted from after the imports; then trains ``--steps`` steps, either as DDP
(``--how ddp``: weights, gradients, DDP's buckets and Adam's two moments on
every rank, about 5 x the weights) or with the Trainer's ``shard="parameters"``
(``--how parameters``). It prints its peak usage, as the cgroup counted it.
The kernel's OOM killer ends a rank that goes over.

Run: scripts/mpirun.sh -n 2 python memory_wall.py --cgroup DIR --how parameters
"""

import argparse
import os
import pathlib


def cap(parent, limit):
    """Moves this process into a new memory cgroup under ``parent`` limited to ``limit`` bytes."""
    group = pathlib.Path(parent) / f"rank_{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    swap = group / "memory.memsw.limit_in_bytes"
    if swap.exists():   # no escape into swap
        swap.write_text(str(limit))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cgroup", required=True)
    p.add_argument("--how", choices=["ddp", "parameters"], required=True)
    p.add_argument("--width", type=int, default=3072)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cap-weights", type=float, default=4.2)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    import torch
    import mpikv.torch

    torch.set_num_threads(1)
    weight_bytes = args.layers * (args.width * args.width + args.width) * 4
    group = cap(args.cgroup, int(args.cap_weights * weight_bytes))
    rank, size = mpikv.torch.rank(), mpikv.torch.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.width, args.width),
                                                      torch.nn.Tanh())
                                  for _ in range(args.layers)])
    if args.how == "ddp":
        mpikv.torch.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    else:
        net = model
        optimizer = mpikv.torch.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-4), model.named_parameters(),
            shard="parameters", module=model)
    data = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(16, args.width, generator=data)
        optimizer.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    print(f"rank {rank}/{size} {args.how}: trained {args.steps} steps, loss {loss.item():.6f}, "
          f"peak {peak / 2**20:.0f} MiB of a {args.cap_weights * weight_bytes / 2**20:.0f} MiB "
          f"cap ({weight_bytes / 2**20:.0f} MiB of weights)", flush=True)


if __name__ == "__main__":
    main()
