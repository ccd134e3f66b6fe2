"""A torch.distributed.checkpoint save and load as torch users write them, on gloo;
tests/jobs/test_unchanged_torch.py runs it as it is and with the backend's name
changed to "mpikv". A model and its SGD state after 2 DDP steps are saved, a new
model and optimizer load them, and rank 0 prints what it loaded.

    mpikv run -n 2 dcp_roundtrip.py DIRECTORY
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP


def make(seed):
    torch.manual_seed(seed)
    model = DDP(torch.nn.Linear(8, 4).double())
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, optimizer, rank, steps):
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(4, 8, generator=data, dtype=torch.float64)
        model(x).square().sum().backward()
        optimizer.step()


def main(directory):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = make(0)
    train(model, optimizer, rank, 2)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
             checkpoint_id=directory)
    again, again_optimizer = make(1)
    train(again, again_optimizer, rank, 1)   # (its momentum exists, to be overwritten)
    state = {"model": again.state_dict(), "optim": again_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    again.load_state_dict(state["model"])
    again_optimizer.load_state_dict(state["optim"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    moment = again_optimizer.state_dict()["state"][0]["momentum_buffer"]
    if rank == 0:
        print(f"LOADED same={same} weight={model.module.weight.flatten()[:3].tolist()} "
              f"momentum={moment.flatten()[:3].tolist()}", flush=True)
    # The DDP models go before their group: a gloo group whose last reference is a
    # Reducer's is destroyed holding the GIL, and joins a worker thread that waits for
    # the GIL to free a finished work's tensors (pytorch/pytorch#56297); seen here as a
    # rank that never exits.
    del model, again
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
