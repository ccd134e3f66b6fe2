"""What a DDP script does by habit, run through the Trainer and through DDP over gloo.

One script (:func:`_train`) with BatchNorm, SGD with momentum, StepLR and an
eval pass each epoch; each habit of :data:`HABITS` runs between
``backward()`` and ``step()``, or around the forward. The Trainer and DDP
run it on the same ranks, seeds and batches: weights, buffers, the numbers
a script reads (gradient norms, eval losses) are equal within 1e-6 (float64,
so in practice to rounding), on every rank.
"""

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402

from .. import trainer_cases as cases  # noqa: E402
from .conftest import raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)


from ..ddp_traps import BNNet  # noqa: E402  (one model for the habits and the traps)


def _clip(model, seen):
    seen.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))


def _norm_log(model, seen):
    seen.append(float(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters()]))))


def _scale(model, seen):
    del seen
    for p in model.parameters():
        p.grad.mul_(0.5)


def _replace(model, seen):
    del seen
    for p in model.parameters():
        p.grad = p.grad.clone() * 2.0


#: habit -> what the script does between backward() and step() (and what it reads)
HABITS = {
    "plain": None,
    "clip-grad-norm": _clip,
    "log-grad-norm": _norm_log,
    "scale-grad": _scale,
    "replace-grad": _replace,
    "no-sync-accumulation": "accumulate",
}


def _train(model, make_step, habit, comm, steps=4):
    """The DDP script: returns (what the habit read, eval losses)."""
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    zero_grad, step, no_sync = make_step
    seen, evals = [], []
    for s in range(steps):
        model.train()
        zero_grad()
        micro = 2 if habit == "accumulate" else 1
        for m in range(micro):
            x, y = cases.data(s, m)
            context = no_sync() if m < micro - 1 else _nothing()
            with context:
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if callable(habit):
            habit(model, seen)
        step()
        model.eval()   # eval each epoch: no buffer broadcast, this rank's statistics
        with torch.no_grad():
            x, y = cases.data(100 + s, 0)
            evals.append(float(torch.nn.functional.mse_loss(model(x), y)))
    return seen, evals


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", list(HABITS))
def test_a_ddp_habit_gives_ddp_s_weights_buffers_and_numbers(make_store, comm, gloo, name):
    from torch.nn.parallel import DistributedDataParallel
    habit = HABITS[name]
    kw = {"lr": 0.1, "momentum": 0.9}

    ours = BNNet()
    trainer = mpikv.torch.Trainer(ours, torch.optim.SGD, kw, make_store(),
                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))

    def our_step():
        trainer.step()
        trainer.lr_scheduler.step()
    got = _train(ours, (trainer.zero_grad, our_step, trainer.no_sync), habit, comm)

    theirs = BNNet()
    ddp = DistributedDataParallel(theirs)
    opt = torch.optim.SGD(ddp.parameters(), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)

    def their_step():
        opt.step()
        sched.step()
    want = _train(ddp, (opt.zero_grad, their_step, ddp.no_sync), habit, comm)

    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    for (n, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=n)
    # The buffers differ between ranks as DDP's do: each rank's last forward.
    trainer.close()


def test_buffers_are_rank_0_s_before_each_forward_and_switchable_off(make_store, comm):
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    x = torch.full((4, 8), float(comm.rank), dtype=torch.float64)
    net(x).sum().backward()   # each rank's own statistics
    trainer.step()
    everyone = comm.allgather(net.bn.running_mean.clone())
    with torch.no_grad():
        batch_mean = net.fc1(x).mean(0)
    net(x).sum().backward()   # first: rank 0's buffers everywhere, then this batch's update
    trainer.step()
    expected = 0.9 * everyone[0] + 0.1 * batch_mean
    torch.testing.assert_close(net.bn.running_mean, expected, rtol=1e-12, atol=1e-12)
    assert int(net.bn.num_batches_tracked) == 2
    with torch.no_grad():   # shares (the forward before had gradients), then this batch
        net(x)
    after_eval = comm.allgather(net.bn.running_mean.clone())
    with torch.no_grad():
        batch_mean = net.fc1(x).mean(0)
    net(x)   # the forward before ran without gradients: nothing is shared (DDP's rule)
    torch.testing.assert_close(net.bn.running_mean, 0.9 * after_eval[comm.rank] + 0.1 * batch_mean,
                               rtol=1e-12, atol=1e-12)
    trainer.close()

    off = BNNet()
    trainer = mpikv.torch.Trainer(off, torch.optim.SGD, {"lr": 0.1},
                                  make_store(), broadcast_buffers=False)
    off(x).sum().backward()
    trainer.step()
    off(x).sum().backward()
    trainer.step()
    means = comm.allgather(off.bn.running_mean.clone())
    assert comm.size == 1 or not torch.equal(means[0], means[-1])
    trainer.close()


def test_buffers_need_the_module(make_store, comm):
    net = BNNet()
    with pytest.raises(mpikv.ValueTypeError, match="broadcast_buffers=True needs the model"):
        mpikv.torch.Trainer(net.named_parameters(), torch.optim.SGD, {"lr": 0.1},
                            make_store(), broadcast_buffers=True)


def test_buffers_come_back_from_a_checkpoint_exactly(make_store, comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("bn") / "ckpt") if comm.rank == 0 else None)
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(comm.rank))
    for _ in range(3):
        trainer.zero_grad()
        net(x).sum().backward()
        trainer.step()
    saved = comm.bcast({k: v.clone() for k, v in net.named_buffers()})   # rank 0's
    trainer.save_checkpoint(path)
    with torch.no_grad():
        net.bn.running_mean.zero_()
        net.bn.running_var.fill_(7.0)
        net.bn.num_batches_tracked.zero_()
    trainer.load_checkpoint(path)
    for name, b in net.named_buffers():
        assert torch.equal(b, saved[name]), name
    trainer.close()


def test_a_checkpoint_whose_buffers_do_not_fit_is_refused_on_every_rank(
        make_store, comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("bn2") / "ckpt") if comm.rank == 0 else None)
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    trainer.save_checkpoint(path)
    trainer.close()
    other = BNNet()
    other.bn.register_buffer("extra", torch.zeros(2))
    trainer = mpikv.torch.Trainer(other, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    message = raises_everywhere(comm, mpikv.StateFileError, lambda: trainer.load_checkpoint(path))
    assert "not in the checkpoint: bn.extra" in message
    trainer.close()


class ConvBN(torch.nn.Module):
    """float64; BatchNorm2d between convolutions, with and without affine parts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        kw = {"dtype": torch.float64}
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1, **kw)
        self.bn = torch.nn.BatchNorm2d(3, **kw)
        self.bn2 = torch.nn.BatchNorm2d(3, affine=False, momentum=None, **kw)
        self.fc = torch.nn.Linear(3 * 4 * 4, 2, **kw)

    def forward(self, x):
        return self.fc(torch.tanh(self.bn2(self.bn(self.conv(x)))).flatten(1))


def test_sync_batchnorm_trains_as_batchnorm_on_the_global_batch(make_store, comm):
    # convert_sync_batchnorm: the statistics are the global batch's, through the store
    # (torch.distributed is not initialised: torch's own module would use each rank's).
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(ConvBN())
    ref = ConvBN()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9},
                                  make_store())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(cases.GLOBAL_BATCH, 2, 4, 4, generator=g, dtype=torch.float64)
        y = torch.randn(cases.GLOBAL_BATCH, 2, generator=g, dtype=torch.float64)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        trainer.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for (n, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=n)
    net.eval()
    x = torch.randn(4, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref.eval()(x), rtol=1e-9, atol=1e-12)
    trainer.close()
    assert "forward" not in net.bn.__dict__   # torch's own forward again


def test_joined_ranks_take_the_buffers_of_the_first_rank_still_training(make_store, comm):
    # Rank 0 runs out of data first: the buffers then come from rank 1, and rank 0,
    # joined, takes them too; at the end every rank takes the last joiner's. The
    # weights are those of ranks stepping with zero losses (BatchNorm normalises
    # with batch statistics: the buffers do not change them).
    def batches(rank):
        return 1 if rank == 0 else 3

    def run(join):
        net = BNNet()
        trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9},
                                      make_store())
        most = max(batches(r) for r in range(comm.size))
        for step in range(batches(comm.rank) if join else most):
            x, y = cases.data(step, comm.rank)
            trainer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            (loss * 0 if step >= batches(comm.rank) else loss).backward()
            trainer.step()
        if join:
            trainer.join()
        trainer.close()
        return _state(net)

    joined = run(True)
    padded = run(False)
    for name in ("fc1.weight", "fc2.bias", "bn.weight"):
        torch.testing.assert_close(joined[name], padded[name], rtol=1e-12, atol=1e-14, msg=name)
    if comm.size > 1:
        # join ends as DDP's: every rank holds the buffers of the last rank to join
        # (the highest of those that joined last), after its third forward.
        last = comm.bcast(joined if comm.rank == comm.size - 1 else None, root=comm.size - 1)
        assert int(last["bn.num_batches_tracked"]) == 3
        for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            assert torch.equal(joined[name], last[name]), name


def _state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _rows(comm):
    per = cases.GLOBAL_BATCH // comm.size
    return slice(comm.rank * per, (comm.rank + 1) * per)


def test_gradients_set_to_none_after_backward_are_skipped_as_torch_skips_them(make_store, comm):
    # Freezing a layer for one step (its .grad None on every rank): torch's optimizer
    # skips it, momentum and weight decay included; so do the owners.
    kw = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    net, ref = BNNet(), BNNet()
    # (with unused_parameters="error": a gradient set to None is not an unused parameter)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, kw, make_store(),
                                  unused_parameters="error")
    opt = torch.optim.SGD(ref.parameters(), **kw)
    for step in range(3):
        x, y = cases.data(step, 0)
        for model, zero, apply in ((net, trainer.zero_grad, trainer.step),
                                   (ref, opt.zero_grad, opt.step)):
            zero()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step == 1:
                model.fc1.weight.grad = None
                model.fc1.bias.grad = None
            apply()
    for (n, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=n)
    trainer.close()


def test_a_gradient_set_to_none_on_some_ranks_only_is_an_error_on_every_rank(make_store, comm):
    if comm.size == 1:
        pytest.skip("needs ranks that differ")
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    before = _state(net)
    x, y = cases.data(0, 0)
    torch.nn.functional.mse_loss(net(x[_rows(comm)]), y[_rows(comm)]).backward()
    if comm.rank == 0:
        net.fc2.weight.grad = None
    message = raises_everywhere(comm, mpikv.GradientError, trainer.step)
    assert "set to None between backward() and step() on some ranks only (fc2.weight)" in message
    after = _state(net)
    for name in ("fc1.weight", "fc2.weight", "bn.weight"):
        assert torch.equal(after[name], before[name]), name
    trainer.close()


def test_a_gradient_set_by_hand_on_a_parameter_backward_did_not_reach_is_applied(make_store, comm):
    class TwoHeads(BNNet):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(16, 4, dtype=torch.float64)

    net = TwoHeads()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    before = net.head.weight.detach().clone()
    x, y = cases.data(0, 0)
    torch.nn.functional.mse_loss(net(x[_rows(comm)]), y[_rows(comm)]).backward()  # no head
    net.head.weight.grad = torch.ones_like(net.head.weight)
    trainer.step()
    torch.testing.assert_close(net.head.weight.detach(), before - 0.1, rtol=0, atol=1e-15)
    trainer.close()


def test_a_second_backward_with_each_rank_s_data_gives_the_average_of_both(make_store, comm):
    net, ref = BNNet(), BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store(), broadcast_buffers=False)
    (x, y), (x2, y2) = cases.data(0, 0), cases.data(0, 1)
    rows = _rows(comm)
    torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
    torch.nn.functional.mse_loss(net(x2[rows]), y2[rows]).backward()
    per = cases.GLOBAL_BATCH // comm.size
    total = 0
    for r in range(comm.size):   # DDP: the average over ranks of each rank's two passes
        part = slice(r * per, (r + 1) * per)
        total = total + torch.nn.functional.mse_loss(ref(x[part]), y[part]) \
            + torch.nn.functional.mse_loss(ref(x2[part]), y2[part])
    (total / comm.size).backward()
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=n)
    trainer.close()


def test_consolidating_while_a_rank_has_joined_is_an_error_there_and_join_goes_on(make_store, comm):
    if comm.size == 1:
        pytest.skip("needs a joined rank")
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9},
                                  make_store())
    x, y = cases.data(0, 0)
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    trainer.step()
    got = None
    if comm.rank == comm.size - 1:
        trainer.join()
    else:
        try:
            trainer.optimizer.consolidate_state_dict(0)
        except mpikv.MismatchError as exc:
            got = str(exc)
        trainer.join()
    everyone = comm.allgather(got)
    assert all(m is not None and "called trainer.join()" in m and "consolidate_state_dict" in m
               for m in everyone[:-1]), everyone
    trainer.close()


def test_a_consolidation_on_rank_0_only_is_named_in_the_trainer_s_terms(make_store, comm):
    if comm.size == 1:
        pytest.skip("needs ranks that differ")
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store(), broadcast_buffers=False)
    x, y = cases.data(0, 0)

    def rank_0_consolidates():
        if comm.rank == 0:
            trainer.optimizer.consolidate_state_dict(0)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        trainer.step()
    message = raises_everywhere(comm, mpikv.MismatchError, rank_0_consolidates)
    assert "rank 0 called consolidate_state_dict before its first step" in message
    assert "consolidate_state_dict is collective: every rank must call it" in message
    trainer.close()


def test_join_after_eval_forwards_keeps_the_buffer_sharing_agreed(make_store, comm):
    # Uneven data, an eval every two batches, join() each epoch: the next epoch's
    # forwards share the buffers on every rank alike.
    net = BNNet()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    for epoch in range(2):
        for step in range(3 if comm.rank == 0 else 2):
            x, y = cases.data(step, comm.rank)
            trainer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            trainer.step()
            if step % 2 == 1:
                with torch.no_grad():
                    net(x)
        trainer.join()
    weights = comm.allgather(net.fc1.weight.detach().clone())
    assert all(torch.equal(w, weights[0]) for w in weights)
    trainer.close()


def test_a_copy_of_the_model_is_a_plain_model(make_store, comm, tmp_path_factory):
    # The EMA or best-model habit: copy.deepcopy and torch.save of the Trainer's model
    # work, and the copy runs as a plain torch model (no store calls).
    import copy
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(BNNet())
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    x, y = cases.data(0, 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    trainer.step()
    twin = copy.deepcopy(net).eval()
    with torch.no_grad():
        torch.testing.assert_close(twin(x), net.eval()(x), rtol=0, atol=0)
    path = tmp_path_factory.mktemp("copy") / f"model-{comm.rank}.pt"
    torch.save(net, path)
    loaded = torch.load(path, weights_only=False).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), net(x), rtol=0, atol=0)
    trainer.close()



@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weights_loaded_after_the_optimizer_state_are_kept_by_the_masters(make_store, comm, dtype):
    # The usual resume order of a DDP script: optimizer state, then the model's weights.
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3).to(dt)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.0, "momentum": 0.9},
                                  make_store())
    x = torch.randn(6, 4).to(dt)
    net(x).float().sum().backward()
    trainer.step()
    trainer.optimizer.consolidate_state_dict(0)
    state = comm.bcast(trainer.optimizer.state_dict() if comm.rank == 0 else None)
    new = {k: torch.randn(v.shape).to(dt) for k, v in net.state_dict().items()}
    trainer.optimizer.load_state_dict(state)
    net.load_state_dict(new)
    trainer.zero_grad()
    net(x).float().sum().backward()
    trainer.step()   # lr 0: the weights stay what was loaded
    for k, v in net.state_dict().items():
        assert torch.equal(v, new[k]), k
    trainer.close()
