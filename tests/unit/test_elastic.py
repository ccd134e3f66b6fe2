"""trainer.run on one process: the steps it calls, its refusals after a lost rank, and
its recovery (a RankLostError raised by the step function stands in for a loss)."""

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.elastic import loop as elastic  # noqa: E402

HYPER = {"lr": 0.05, "momentum": 0.9}


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(6, 4, generator=g, dtype=torch.float64),
            torch.randn(6, 2, generator=g, dtype=torch.float64))


def _plain(steps):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), **HYPER)
    for i in range(steps):
        opt.zero_grad()
        x, y = _batch(i)
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _lost(survivors=(0,)):
    return mpikv.RankLostError("rank 1 of 2 lost during pushpull: the process died",
                               lost=[1], lost_world=[1], survivors=list(survivors))


def _stepper(trainer, net, calls, lose_at=None):
    def step_fn(i):
        calls.append((i, trainer.num_update, trainer.num_workers))
        if i == lose_at:
            raise _lost()
        x, y = _batch(i)
        trainer.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        trainer.step()
    return step_fn


def _losing_once(step_fn, at):
    """``step_fn`` whose first call of step ``at`` is a lost rank instead."""
    lose = {"at": at}

    def once(i):
        if lose.get("at") == i:
            del lose["at"]
            raise _lost()
        step_fn(i)
    return once


def test_run_calls_the_steps_left_and_returns_the_update_count(tmp_path):
    net = _net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, "local")
    calls = []
    assert trainer.run(_stepper(trainer, net, calls), 3) == 3
    assert [c[0] for c in calls] == [0, 1, 2]
    calls.clear()
    assert trainer.run(_stepper(trainer, net, calls), [1, 2, 3, 4, 5]) == 6
    assert [c[0] for c in calls] == [3, 4, 5]   # those below num_update are skipped
    for p, want in zip(net.parameters(), _plain(6)):
        assert torch.allclose(p.detach(), want, rtol=0, atol=1e-12)
    trainer.close()


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_a_loss_goes_on_from_the_latest_checkpoint_with_exact_weights(tmp_path, shard,
                                                                     monkeypatch):
    said = []
    monkeypatch.setattr(elastic.log, "warning", lambda msg, *args: said.append(msg % args))
    net = _net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, "local", shard=shard)
    trainer.resume(tmp_path, every=2, background=False)
    calls = []
    first_optimizer = trainer.optimizer
    assert trainer.run(_losing_once(_stepper(trainer, net, calls), 5), 8) == 8
    # The loss in step 5 (4 updates made, the checkpoint of step 4 complete): step 4
    # again on the new store, and the steps after it.
    assert [c[0] for c in calls] == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    assert calls[5][1] == 4
    assert said == ["trainer.run: lost rank 1 of 2; going on from step 4 on 1 rank"]
    assert trainer.optimizer is not first_optimizer   # the Trainer was made again
    for p, want in zip(net.parameters(), _plain(8)):
        assert torch.allclose(p.detach(), want, rtol=0, atol=1e-10)
    trainer.close()


def test_a_store_passed_in_is_made_again_with_its_options(tmp_path):
    net = _net()
    given = mpikv.create("local", timeout=77, bucket_bytes=12345, direct_bytes=999,
                         reducer="allreduce")
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, given)
    trainer.resume(tmp_path, every=2, background=False)
    assert trainer.run(_losing_once(_stepper(trainer, net, []), 3), 4) == 4
    remade = trainer.kvstore
    assert remade is not given and remade.type == "local"
    want = dict(given.options, fault_tolerant=True, autotune=False)
    assert remade.options == want, (remade.options, want)
    for p, want in zip(net.parameters(), _plain(4)):
        assert torch.allclose(p.detach(), want, rtol=0, atol=1e-10)
    trainer.close()
    given.close()


def test_fewer_survivors_than_min_workers_is_one_clear_error(tmp_path):
    net = _net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, "local", min_workers=2)
    trainer.resume(tmp_path, every=2)
    with pytest.raises(mpikv.MPIKVError) as info:
        trainer.run(_stepper(trainer, net, [], lose_at=1), 4)
    assert str(info.value).startswith(
        "trainer.run: 1 rank survives, fewer than min_workers=2 (rank 1 of 2 lost during "
        "pushpull: the process died); the latest complete checkpoint is in ")
    assert isinstance(info.value.__cause__, mpikv.RankLostError)
    trainer.close()


def test_a_loss_without_checkpoints_cannot_be_recovered():
    net = _net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, "local")
    with pytest.raises(mpikv.MPIKVError, match=r"^trainer\.run cannot go on after a lost rank "
                       r"with no checkpoints \(call trainer\.resume\(directory, every=K\) "
                       r"before trainer\.run\): rank 1 of 2 lost"):
        trainer.run(_stepper(trainer, net, [], lose_at=0), 2)
    with pytest.raises(mpikv.MPIKVError, match="min_workers must be a positive int, not 0"):
        trainer.run(lambda i: None, 2, min_workers=0)
    trainer.close()


def test_trainer_takes_fault_tolerant_and_refuses_it_without_ulfm(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    with pytest.raises(mpikv.FaultToleranceUnavailableError, match="the launch has no ULFM"):
        mpikv.torch.Trainer(_net(), torch.optim.SGD, HYPER, fault_tolerant=True)
    with mpikv.torch.Trainer(_net(), torch.optim.SGD, HYPER, fault_tolerant=False) as trainer:
        assert (trainer.rank, trainer.num_workers) == (0, 1)


@pytest.mark.parametrize("redundancy, kwargs, message", [
    ("disk", {}, "redundancy must be 'checkpoint' or 'memory', not 'disk'"),
    (None, {}, "redundancy must be 'checkpoint' or 'memory', not None"),
])
def test_the_trainer_refuses_a_redundancy_it_cannot_keep(redundancy, kwargs, message):
    net = _net()
    with pytest.raises(mpikv.InputError, match=message):
        mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, "local", redundancy=redundancy,
                            **kwargs)


def test_buddy_copies_on_one_rank_hold_each_step_and_change_nothing(tmp_path):
    net = _net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, HYPER, "local", redundancy="memory")
    trainer.resume(tmp_path, every=100)
    calls = []
    trainer.run(_stepper(trainer, net, calls), 4)
    for got, want in zip(net.parameters(), _plain(4)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-15)
    copies = trainer.kvstore.copies
    assert copies.steps() == ([3, 4], [3, 4])
    kept = copies.own(4).extra
    assert kept["trainer"]["num_update"] == 4 and kept["user"] is None


class _Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=True).double()
        self.out = torch.nn.Linear(4, 2).double()

    def forward(self, ids):
        return self.out(self.emb(ids))


def _ids(i):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randint(0, 10, (6,), generator=g), torch.randn(6, 2, generator=g,
                                                                 dtype=torch.float64)


@pytest.mark.parametrize("redundancy", ["checkpoint", "memory"])
def test_a_loss_recovers_sparse_embedding_weights_exactly(tmp_path, redundancy):
    plain = _Embedded()
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for i in range(7):
        opt.zero_grad()
        ids, y = _ids(i)
        ((plain(ids) - y) ** 2).mean().backward()
        opt.step()
    net = _Embedded()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.05}, "local",
                                  redundancy=redundancy)
    trainer.resume(tmp_path, every=3, background=False)

    def step_fn(i):
        ids, y = _ids(i)
        trainer.zero_grad()
        ((net(ids) - y) ** 2).mean().backward()
        trainer.step()
    assert trainer.run(_losing_once(step_fn, 5), 7) == 7
    for got, want in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=1e-12)
    trainer.close()
