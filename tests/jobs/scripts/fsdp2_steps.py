"""An FSDP2 training script as torch users write it (fully_shard, AdamW, 3 steps), on
gloo; tests/jobs/test_unchanged_torch.py runs it as it is and with the backend's name
changed to "mpikv". Each rank saves its shards: DIRECTORY/rank<R>.pt.

    mpikv run -n 2 fsdp2_steps.py DIRECTORY
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main(directory):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).double()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 16, generator=data, dtype=torch.float64)
        y = torch.randn(8, 4, generator=data, dtype=torch.float64)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    torch.save({name: p.to_local().clone() for name, p in model.named_parameters()},
               f"{directory}/rank{rank}.pt")
    print(f"rank {rank} saved", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
