"""Trainer(..., sync=mpikv.torch.DiLoCo(...)) on 1-4 ranks: against one process that
simulates every rank's inner steps and the outer Nesterov step, against synchronous
SGD at every=1, through checkpoints, and its errors on every rank."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.torch import DiLoCo  # noqa: E402

from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi

BATCH = 3   # per rank


def make_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 1)).double()


def batch(step, rank):
    """Rank ``rank``'s batch of ``step`` (the same whatever the number of ranks)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 4, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def loss_of(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def weights(net):
    return {n: p.detach().clone().numpy() for n, p in net.named_parameters()}


def run(trainer, net, rank, steps, how="trainer"):
    for i in steps:
        trainer.zero_grad()
        loss_of(net, *batch(i, rank)).backward()
        if how == "allreduce":   # .grad averaged over the ranks before the inner step
            trainer.allreduce_grads()
        if how in ("trainer", "allreduce"):
            trainer.step()
        else:   # torch's face: the same step
            trainer.optimizer.step()


def train(rank, size, sync, steps, inner=None, seed=0, how="trainer", **kwargs):
    net = make_net(seed)
    cls, args = inner or (torch.optim.SGD, {"lr": 0.1})
    trainer = mpikv.torch.Trainer(net, cls, args, sync=sync, **kwargs)
    run(trainer, net, rank, range(steps), how)
    got = weights(net)
    trainer.close()
    return got


def diloco_reference(size, every, outer_lr, outer_momentum, steps, inner=None, switch=None):
    """One process: ``size`` replicas each stepping its inner optimizer on its own batches;
    every ``every`` steps the outer gradient (global minus local weights, averaged)
    through torch's SGD with Nesterov momentum on the global weights. ``switch``:
    ``(step, size)``: from that step (a sync) on, that many replicas, replica ``r``'s
    inner state that of old replica ``r % old size`` (as a load on other ranks gives)."""
    cls, args = inner or (torch.optim.SGD, {"lr": 0.1})
    glob = make_net()
    m = outer_momentum
    outer = torch.optim.SGD(glob.parameters(), lr=outer_lr, momentum=m, nesterov=m > 0)
    replicas = [make_net() for _ in range(size)]
    inners = [cls(r.parameters(), **args) for r in replicas]
    for i in range(steps):
        if switch is not None and i == switch[0]:
            size, old = switch[1], inners
            replicas = [copy.deepcopy(glob) for _ in range(size)]
            inners = [cls(r.parameters(), **args) for r in replicas]
            for r, opt in enumerate(inners):
                opt.load_state_dict(copy.deepcopy(old[r % len(old)].state_dict()))
        for rank, (r, opt) in enumerate(zip(replicas, inners)):
            opt.zero_grad()
            loss_of(r, *batch(i, rank)).backward()
            opt.step()
        if (i + 1) % every == 0:
            with torch.no_grad():
                for k, p in enumerate(glob.parameters()):
                    locals_ = [list(r.parameters())[k] for r in replicas]
                    p.grad = sum(p - q for q in locals_) / size
            outer.step()
            with torch.no_grad():
                for r in replicas:
                    for q, p in zip(r.parameters(), glob.parameters()):
                        q.copy_(p)
    # Between syncs each rank holds its own weights: rank 0's are compared.
    return weights(replicas[0]), weights(glob)


def assert_close(got, want, tol=1e-12):
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=tol, atol=tol, err_msg=n)


def assert_same_everywhere(comm, got):
    everyone = comm.allgather(got)
    for other in everyone[1:]:
        for n in got:
            assert (other[n] == everyone[0][n]).all(), n


# -- every=1, outer_lr=1, no outer momentum: synchronous SGD averaging ---------------------

def sync_sgd_reference(size, steps, args):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), **args)
    for i in range(steps):
        opt.zero_grad()
        # the mean over the ranks of each rank's mean loss (equal batches)
        loss = sum(loss_of(net, *batch(i, r)) for r in range(size)) / size
        loss.backward()
        opt.step()
    return weights(net)


@pytest.mark.parametrize("args", [{"lr": 0.1}, {"lr": 0.05, "momentum": 0.9,
                                                "weight_decay": 0.01}])
@pytest.mark.parametrize("how", ["trainer", "optimizer", "allreduce"])
def test_every_1_equals_synchronous_sgd_averaging(comm, args, how):
    # (SGD's momentum and weight decay are linear: the average of the ranks'
    # one-step updates is the update of the averaged gradient)
    steps = 5
    got = train(comm.rank, comm.size, DiLoCo(every=1, outer_lr=1.0, outer_momentum=0.0),
                steps, inner=(torch.optim.SGD, args), how=how)
    assert_close(got, sync_sgd_reference(comm.size, steps, args))
    assert_same_everywhere(comm, got)


# -- every=4: against the one-process simulation --------------------------------------------

@pytest.mark.parametrize("inner", [(torch.optim.SGD, {"lr": 0.1}),
                                   (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})],
                         ids=["sgd", "adamw"])
@pytest.mark.parametrize("steps", [8, 10])
@pytest.mark.parametrize("how", ["trainer", "optimizer"])
def test_every_4_equals_the_simulated_ranks(comm, inner, steps, how):
    got = train(comm.rank, comm.size, DiLoCo(every=4), steps, inner=inner, how=how)
    local0, synced = diloco_reference(comm.size, 4, 0.7, 0.9, steps, inner=inner)
    if steps % 4 == 0:   # after a sync every rank holds the global weights
        assert_close(got, synced)
        assert_same_everywhere(comm, got)
    elif comm.rank == 0:
        assert_close(got, local0)


def test_a_scheduler_steers_the_inner_optimizer(comm):
    net = make_net()
    trainer = mpikv.torch.Trainer(
        net, torch.optim.SGD, {"lr": 0.1}, sync=DiLoCo(every=2),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    for i in range(3):
        trainer.zero_grad()
        loss_of(net, *batch(i, comm.rank)).backward()
        trainer.step()
        trainer.lr_scheduler.step()
    assert trainer.learning_rate == pytest.approx(0.1 / 8)
    trainer.close()


def test_buffers_come_from_rank_0_at_the_first_forward_after_a_sync(comm):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                              torch.nn.Linear(6, 1)).double()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, sync=DiLoCo(every=2))

    def stats():
        return comm.allgather(net[1].running_mean.clone().numpy())

    run(trainer, net, comm.rank, range(3))   # a sync at step 2, then an inner step
    if comm.size > 1:   # each rank's own statistics between syncs
        assert not all((s == stats()[0]).all() for s in stats()[1:])
    run(trainer, net, comm.rank, range(3, 4))   # the sync of step 4
    net.eval()   # (a training forward would then add this rank's batch)
    with torch.no_grad():
        net(batch(9, comm.rank)[0])   # takes rank 0's buffers first
    everyone = stats()
    assert all((s == everyone[0]).all() for s in everyone[1:])
    trainer.close()


# -- checkpoints: a save holds the last sync ------------------------------------------------

@pytest.mark.parametrize("inner", [(torch.optim.SGD, {"lr": 0.1}),
                                   (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})],
                         ids=["sgd", "adamw"])
@pytest.mark.parametrize("save_after", [6, 8], ids=["mid-window", "at-a-sync"])
def test_a_checkpoint_continues_to_the_uninterrupted_weights(comm, shared_dir, save_after,
                                                             inner):
    # AdamW's moments and step count are each rank's own: in the checkpoint, as of the
    # last sync, so the continuation is exact.
    sync, steps = DiLoCo(every=4), 16
    want = train(comm.rank, comm.size, sync, steps, inner=inner)
    net = make_net()
    trainer = mpikv.torch.Trainer(net, *inner, sync=sync)
    run(trainer, net, comm.rank, range(save_after))
    path = f"{shared_dir}/ckpt"
    trainer.save_checkpoint(path)
    trainer.close()
    # Another start (other weights): the load decides.
    net = make_net(seed=7)
    trainer = mpikv.torch.Trainer(net, *inner, sync=sync)
    trainer.load_checkpoint(path)
    assert trainer.num_update == 4 * (save_after // 4)   # the last sync's
    run(trainer, net, comm.rank, range(trainer.num_update, steps))
    got = weights(net)
    trainer.close()
    assert_close(got, want)
    assert_same_everywhere(comm, got)


def test_a_checkpoint_loads_on_another_number_of_ranks(comm, shared_dir):
    """N -> 1 and 1 -> N: the last sync's weights and outer momentum, on any number
    of ranks, and rank ``r`` the inner state of saved rank ``r % saved``."""
    sync, path = DiLoCo(every=4), f"{shared_dir}/ckpt"
    inner = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5})
    # N ranks save in the middle of the second window; rank 0 alone goes on.
    net = make_net()
    trainer = mpikv.torch.Trainer(net, *inner, sync=sync)
    run(trainer, net, comm.rank, range(6))
    trainer.save_checkpoint(path)
    trainer.close()
    if comm.rank == 0:
        net = make_net(seed=5)
        trainer = mpikv.torch.Trainer(net, *inner, kvstore="local", sync=sync)
        trainer.load_checkpoint(path)
        assert trainer.num_update == 4
        run(trainer, net, 0, range(4, 12))
        got = weights(net)
        trainer.close()
        _, want = diloco_reference(comm.size, 4, 0.7, 0.9, 12, inner=inner, switch=(4, 1))
        assert_close(got, want)
        # Rank 0 alone saves at a sync; every rank goes on from it.
        net = make_net()
        trainer = mpikv.torch.Trainer(net, *inner, kvstore="local", sync=sync)
        run(trainer, net, 0, range(8))
        trainer.save_checkpoint(path)
        trainer.close()
    comm.Barrier()
    net = make_net(seed=5)
    trainer = mpikv.torch.Trainer(net, *inner, sync=sync)
    trainer.load_checkpoint(path)
    assert trainer.num_update == 8
    run(trainer, net, comm.rank, range(8, 12))
    got = weights(net)
    trainer.close()
    _, want = diloco_reference(1, 4, 0.7, 0.9, 12, inner=inner, switch=(8, comm.size))
    assert_close(got, want)
    assert_same_everywhere(comm, got)


def test_a_load_in_the_same_trainer_goes_back_to_the_sync(comm, shared_dir):
    sync = DiLoCo(every=3, outer_lr=0.5, outer_momentum=0.8)
    net = make_net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, sync=sync)
    run(trainer, net, comm.rank, range(4))
    path = f"{shared_dir}/ckpt"
    trainer.save_checkpoint(path)
    run(trainer, net, comm.rank, range(4, 6))
    after_6 = weights(net)
    trainer.load_checkpoint(path)
    assert trainer.num_update == 3
    run(trainer, net, comm.rank, range(3, 6))
    assert_close(weights(net), after_6)
    trainer.close()


@pytest.mark.parametrize("background", [False, True])
def test_resume_continues_to_the_uninterrupted_weights(comm, shared_dir, background):
    sync, steps = DiLoCo(every=2), 9
    want = train(comm.rank, comm.size, sync, steps)
    net = make_net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, sync=sync)
    assert trainer.resume(shared_dir, every=2, background=background) == 0
    run(trainer, net, comm.rank, range(5))   # (a job cut short after step 5)
    trainer.close()
    net = make_net(seed=3)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, sync=sync)
    start = trainer.resume(shared_dir, every=2, background=background)
    assert start == 4
    run(trainer, net, comm.rank, range(start, steps))
    got = weights(net)
    trainer.close()
    if comm.rank == 0:
        assert_close(got, want)


def test_after_close_the_optimizer_steps_alone(comm):
    net = make_net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, sync=DiLoCo(every=1))
    run(trainer, net, comm.rank, range(2))
    optimizer = trainer.optimizer
    trainer.close()
    before = weights(net)
    optimizer.zero_grad()
    loss_of(net, *batch(5, comm.rank)).backward()
    optimizer.step()   # a plain local step: no store, no sync
    grads = {n: p.grad.numpy() for n, p in net.named_parameters()}
    assert_close(weights(net), {n: before[n] - 0.1 * grads[n] for n in before})


# -- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"every": 0}, {"every": 2.0}, {"every": True},
                                    {"every": 2, "outer_lr": 0}, {"every": 2, "outer_lr": -1},
                                    {"every": 2, "outer_lr": float("nan")},
                                    {"every": 2, "outer_momentum": 1.0},
                                    {"every": 2, "outer_momentum": -0.1}])
def test_bad_arguments_raise_everywhere(comm, kwargs):
    raises_everywhere(comm, mpikv.InputError, lambda: DiLoCo(**kwargs))


@pytest.mark.parametrize("kwargs", [{"shard": "parameters"}, {"shard": "optimizer"},
                                    {"compression": {"type": "fp16"}},
                                    {"redundancy": "memory"}, {"multi_precision": True},
                                    {"sync": "diloco"}, {"optimizer": "sgd"}])
def test_options_it_cannot_work_with_raise_everywhere(comm, kwargs):
    kwargs = dict(kwargs)
    optimizer = kwargs.pop("optimizer", torch.optim.SGD)
    sync = kwargs.pop("sync", DiLoCo(every=2))
    params = {"lr": 0.1} if optimizer is torch.optim.SGD else {}
    raises_everywhere(comm, mpikv.InputError, lambda: mpikv.torch.Trainer(
        make_net(), optimizer, params, sync=sync, **kwargs))


def test_sixteen_bit_parameters_raise_everywhere(comm):
    raises_everywhere(comm, mpikv.InputError, lambda: mpikv.torch.Trainer(
        make_net().half(), torch.optim.SGD, {"lr": 0.1}, sync=DiLoCo(every=2)))


@pytest.mark.parametrize("other", ["every", "none"])
def test_different_modes_on_the_ranks_raise_everywhere(comm, other):
    if comm.size == 1:
        pytest.skip("needs 2 ranks")
    sync = (DiLoCo(every=2 + comm.rank) if other == "every" else
            DiLoCo(every=2) if comm.rank == 0 else None)
    raises_everywhere(comm, mpikv.MismatchError, lambda: mpikv.torch.Trainer(
        make_net(), torch.optim.SGD, {"lr": 0.1}, sync=sync))


def test_step_with_batch_size_raises_everywhere(comm):
    net = make_net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, sync=DiLoCo(every=2))
    loss_of(net, *batch(0, comm.rank)).backward()
    raises_everywhere(comm, mpikv.InputError, lambda: trainer.step(BATCH))
    trainer.close()
