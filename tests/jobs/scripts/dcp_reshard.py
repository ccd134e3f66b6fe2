"""A torch.distributed.checkpoint round trip that reshards, as torch users write it, on
gloo; tests/jobs/test_unchanged_torch.py runs it as it is and with the backend's name
changed to "mpikv". An FSDP2 model and its AdamW state after 2 steps are saved (each
rank its shards); a whole model and optimizer (no FSDP) load them on every rank; the
FSDP2 model's full weights and AdamW state (DTensor.full_tensor(): torch's functional
all-gather) are compared with what was loaded. Rank 0 saves the whole model:
DIRECTORY/whole.pt.

    mpikv run -n 2 dcp_reshard.py DIRECTORY
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                               torch.nn.Linear(10, 3)).double()


def main(directory):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=data, dtype=torch.float64)).square().sum().backward()
        optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)

    whole = make()
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    whole(torch.zeros(1, 6, dtype=torch.float64)).sum().backward()
    whole_optimizer.step()   # (its state exists, to be overwritten)
    whole_state, whole_optim_state = get_state_dict(whole, whole_optimizer)
    state = {"model": whole_state, "optim": whole_optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(whole, whole_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])

    full = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(model, options=full)
    moments = get_optimizer_state_dict(model, optimizer, options=full)["state"]
    loaded = get_state_dict(whole, whole_optimizer)[1]["state"]
    same = (all(torch.equal(weights[k], v) for k, v in whole.state_dict().items())
            and moments.keys() == loaded.keys()
            and all(torch.equal(moments[k][s], loaded[k][s]) for k in moments
                    for s in ("exp_avg", "exp_avg_sq")))
    steps = {int(s["step"]) for s in whole_optimizer.state_dict()["state"].values()}
    print(f"RESHARDED rank={rank} same={same} steps={sorted(steps)} "
          f"weight={whole[0].weight.flatten()[:3].tolist()}", flush=True)
    if rank == 0:
        torch.save(whole.state_dict(), f"{directory}/whole.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
