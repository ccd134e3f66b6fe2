"""PyTorch's DDP tutorial (its basic example, run by torchrun), on CPUs with gloo.

The starting point of the port in docs/torch.md: ported.py is this file with
three lines changed. Run: torchrun --nproc-per-node 2 ddp.py [weights.pt]
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    data = torch.Generator().manual_seed(rank)

    for step in range(5):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data))
        labels = torch.randn(20, 5, generator=data)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    if rank == 0 and len(sys.argv) > 1:
        torch.save(model.state_dict(), sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    demo_basic()
