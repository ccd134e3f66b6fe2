"""A torch.distributed script on the "mpikv" backend whose last rank never comes to
an all_reduce (uneven data, say): the job must end, naming the collective."""

import sys

import torch
import torch.distributed as dist

import mpikv.torch

mpikv.torch.init_process_group("mpikv")
t = torch.ones(3)
dist.all_reduce(t)                      # every rank: the group works
assert t.tolist() == [dist.get_world_size()] * 3
if dist.get_rank() != dist.get_world_size() - 1:
    dist.all_reduce(t)                  # the last rank never comes
    print("unreachable", flush=True)
    sys.exit(5)
print(f"rank {dist.get_rank()}: left the loop", flush=True)
