"""shard="none": every rank updates every part; nothing is gathered after a step, and the
weights are those of shard="optimizer" bit for bit (every case of the case table runs at
this level too: tests/mpi/test_trainer.py, against one process)."""

import numpy as np
import pytest
import torch

import mpikv
import mpikv.torch

pytestmark = pytest.mark.mpi


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 12, generator=g), torch.randn(5, 3, generator=g)


def _train_step(net, trainer, rank, step):
    x, y = _batch(rank, step)
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    with trainer.kvstore.count_bytes() as counted:
        trainer.step()
    return counted.bytes


def _trainer(make_store, net, shard, opt=torch.optim.Adam, kw=None):
    # bigarray_bound=50: the larger weights are split over the owners in flat shards
    return mpikv.torch.Trainer(net, opt, kw or {"lr": 0.01, "weight_decay": 0.01},
                               make_store(bigarray_bound=50), shard=shard)


@pytest.mark.parametrize("opt,kw", [(torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
                                    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                                       "nesterov": True}),
                                    (torch.optim.Adagrad, {"lr": 0.05,
                                                           "initial_accumulator_value": 0.1})])
def test_no_weights_travel_after_a_step_and_they_equal_the_sharded_ones(make_store, comm,
                                                                         opt, kw):
    net_a, net_b = _net(), _net()
    sharded = _trainer(make_store, net_a, "optimizer", opt, kw)
    replicated = _trainer(make_store, net_b, "none", opt, kw)
    assert (sharded.shard, replicated.shard) == ("optimizer", "none")
    for step in range(5):
        gathered = _train_step(net_a, sharded, comm.rank, step)
        moved = _train_step(net_b, replicated, comm.rank, step)
        if comm.size > 1:
            # The owners' weights, gathered: what others own of the 8,195 float32 weights.
            assert gathered >= 4 * 8195 * (comm.size - 1) // comm.size - 64
            # The first step gathers once and copies the owners' state to the replicas;
            # then no weights travel (only the step's small agreement calls).
            assert (moved >= gathered) if step == 0 else (moved < 2048), (step, moved)
        for (name, a), b in zip(net_a.named_parameters(), net_b.parameters()):
            assert torch.equal(a, b), (step, name)
    # Every rank holds the same weights.
    flat = torch.cat([p.detach().reshape(-1) for p in net_b.parameters()]).numpy()
    everyone = comm.allgather(flat)
    assert all(np.array_equal(everyone[0], w) for w in everyone)


def test_after_a_load_the_next_step_gathers_and_the_replicas_follow_the_loaded_state(
        make_store, comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("replicas") / "ck") if comm.rank == 0
                      else None)
    net_a, net_b = _net(), _net()
    sharded = _trainer(make_store, net_a, "optimizer")
    replicated = _trainer(make_store, net_b, "none")
    for step in range(3):
        _train_step(net_a, sharded, comm.rank, step)
        _train_step(net_b, replicated, comm.rank, step)
    sharded.save_checkpoint(path)
    for step in range(3, 5):   # moves both away from the checkpoint
        _train_step(net_a, sharded, comm.rank, step)
        _train_step(net_b, replicated, comm.rank, step)
    sharded.load_checkpoint(path)
    replicated.load_checkpoint(path)   # a shard="optimizer" checkpoint: the same format
    for step in range(3, 7):
        _train_step(net_a, sharded, comm.rank, step)
        moved = _train_step(net_b, replicated, comm.rank, step)
        if comm.size > 1:
            assert (moved > 4 * 8195 // 2) if step == 3 else (moved < 2048), (step, moved)
        for a, b in zip(net_a.parameters(), net_b.parameters()):
            assert torch.equal(a, b), step


def test_without_shard_one_host_keeps_the_state_sharded(make_store, comm):
    trainer = mpikv.torch.Trainer(_net(), torch.optim.SGD, {"lr": 0.1}, make_store())
    assert trainer.shard == "optimizer"
    assert ("one rank" if comm.size == 1 else "one host") in trainer.shard_reason


@pytest.mark.parametrize("how,message", [
    ("mxnet", "pass a torch.optim class"),
    ("half", "no 16-bit parameters"),
    ("whole", "elementwise optimizer"),
])
def test_shard_none_refuses_what_it_cannot_replicate_on_every_rank(make_store, comm, how,
                                                                    message):
    net = _net()
    opt, kw, extra = torch.optim.SGD, {"lr": 0.1}, {}
    if how == "mxnet":
        opt, kw = "sgd", {"learning_rate": 0.1}
    elif how == "half":
        net = net.to(torch.bfloat16)
    else:
        extra = {"split_parameters": False}
        opt = torch.optim.Adafactor
    with pytest.raises(mpikv.InputError, match=message):
        mpikv.torch.Trainer(net, opt, kw, make_store(), shard="none", **extra)


class _WithRows(torch.nn.Module):
    """A sparse embedding (its rows on the owners, row tables) and a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 6, sparse=True)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def test_sparse_embedding_rows_stay_with_their_owners_beside_replicated_dense_parts(
        make_store, comm):
    nets = [_WithRows(), _WithRows()]
    trainers = [mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.2, "momentum": 0.9},
                                    make_store(bigarray_bound=10), shard=shard)
                for net, shard in zip(nets, ("optimizer", "none"))]
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        idx, y = torch.randint(0, 40, (5, 3), generator=g), torch.randn(5, 3, generator=g)
        for net, trainer in zip(nets, trainers):
            trainer.zero_grad()
            torch.nn.functional.mse_loss(net(idx), y).backward()
            trainer.step()
        for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters()):
            assert torch.equal(a, b), (step, name)
