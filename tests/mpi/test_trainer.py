"""mpikv.torch.Trainer on 1-4 ranks: every case of tests/trainer_cases.py against
one process with the global batch, DDP's weights, the errors, no hang."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import torch_pieces  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.torch import optimizer_state  # noqa: E402

from .conftest import cuda_torch, raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_trainer_equals_one_process_with_the_global_batch(comm, name):
    _equals_one_process_everywhere(comm, name, "trainer")


@pytest.mark.parametrize("name", cases.DISTRIBUTED_OPTIMIZER_CASES)
def test_distributed_optimizer_equals_one_process_with_the_global_batch(comm, name):
    _equals_one_process_everywhere(comm, name, "optimizer")


@pytest.mark.parametrize("name,shard", cases.LEVEL_CASES)
def test_every_level_equals_one_process_with_the_global_batch(comm, name, shard):
    _equals_one_process_everywhere(comm, name, "trainer", shard)


def _equals_one_process_everywhere(comm, name, face, shard=None):
    got = cases.train(name, "dist_sync", comm.rank, comm.size, face=face, shard=shard)
    cases.assert_close(got, cases.reference(name, comm.size))
    # Every rank holds the same weights, bit for bit.
    everyone = comm.allgather(got)
    for other in everyone[1:]:
        for n in got:
            assert (other[n] == everyone[0][n]).all(), n


@pytest.mark.parametrize("shard", [None, "none"])
@pytest.mark.parametrize("extra", [1, 2, 3])
@pytest.mark.parametrize("name", cases.JOIN_CASES)
def test_join_with_uneven_data_equals_the_zero_padded_steps(comm, name, extra, shard):
    # shard="none": joined rounds gather the weights and drop the replicas on every
    # rank; the first round with every rank training copies them again.
    if shard == "none" and name in ("mxnet-sgd", "adafactor", "adamw-whole"):
        pytest.skip("shard='none' takes torch's elementwise classes")
    joined = []
    got = cases.train(name, "dist_sync", comm.rank, comm.size, extra=extra, joined=joined,
                      shard=shard)
    cases.assert_close(got, cases.reference(name, comm.size, extra=extra))
    # The rank with the extra batches joined last (at one rank, rank 0 alone).
    assert joined == [extra % comm.size]
    everyone = comm.allgather(got)
    for other in everyone[1:]:
        for n in got:
            assert (other[n] == everyone[0][n]).all(), n


def test_join_ends_even_when_no_rank_has_extra_data(make_store, comm):
    net, trainer = _net_and_trainer(make_store)
    x, y = cases.data(0, 0)
    cases._loss(cases.settings("sgd"), net(x, False), y).backward()
    trainer.step()
    assert trainer.join() == comm.size - 1
    assert trainer.num_update == 1
    # Training goes on after a join.
    trainer.zero_grad()
    cases._loss(cases.settings("sgd"), net(x, False), y).backward()
    trainer.step()
    assert trainer.num_update == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("opt,kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})],
                         ids=["sgd", "adamw"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_16_bit_model_with_float32_masters_equals_one_process(make_store, comm, dtype, opt, kw,
                                                                clip):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dt = getattr(torch, dtype)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4)).to(dt)

    def loss(model, x, y):
        return ((model(x) - y).float() ** 2).mean()

    net = make()
    trainer = mpikv.torch.Trainer(net, opt, kw, make_store(bigarray_bound=40))
    # One process: each rank's 16-bit gradient, summed in float32, averaged, applied by
    # torch's optimizer to float32 masters, rounded once into the 16-bit model.
    ref = make()
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = opt(masters, **kw)
    per = cases.GLOBAL_BATCH // comm.size
    for step in range(3):
        x, y = (t.to(dt) for t in cases.data(step, 0))
        trainer.zero_grad()
        loss(net, x[comm.rank * per:(comm.rank + 1) * per],
             y[comm.rank * per:(comm.rank + 1) * per]).backward()
        if clip:   # the averaged 16-bit gradients, clipped, then the update
            trainer.allreduce_grads()
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            trainer.update()
        else:
            trainer.step()
        sums = [torch.zeros_like(m) for m in masters]
        for r in range(comm.size):
            ref.zero_grad()
            loss(ref, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]).backward()
            for total, p in zip(sums, ref.parameters()):
                total += p.grad.float()
        for m, p, total in zip(masters, ref.parameters(), sums):
            m.grad = total * (1.0 / comm.size)
            p.grad = m.grad.to(dt)
        if clip:   # as the ranks do: on the 16-bit gradients; an element the clip
            # left as it was keeps its float32 average
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            for m, p in zip(masters, ref.parameters()):
                m.grad = torch.where(p.grad == m.grad.to(dt), m.grad, p.grad.float())
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters):
                p.copy_(m)
        for (name, got), want in zip(net.named_parameters(), ref.parameters()):
            assert got.dtype == dt
            if comm.size <= 2:   # a sum of two is the same in any order: bit for bit
                assert torch.equal(got, want), (step, name)
            else:   # the reduction's order may differ from rank order: one 16-bit step
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-3)
    # The masters and float32 moments live on the owners only.
    elements = sum(p.numel() for p in net.parameters())
    moments = 1 if opt is torch.optim.SGD else 2
    total = comm.allreduce(trainer.kvstore.optimizer_state_nbytes())
    assert elements * 4 * (1 + moments) <= total <= elements * 4 * (1 + moments) + 8 * 64


def _batches(rank):
    """Rank 0 has three batches, the others one or two: they join early."""
    return 3 if rank == 0 else 1 + rank % 2


@pytest.mark.parametrize("how", ["step", "clip", "abandoned-backward", "late-gradient"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("opt,kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})],
                         ids=["sgd", "adamw"])
def test_join_equals_a_run_whose_ranks_out_of_data_add_zero_gradients(make_store, comm, how, dtype,
                                                                      opt, kw):
    # Trainer.join is the store's join with the Trainer's part in each step: the same
    # weights, bit for bit, as ranks that go on stepping with zero gradients (which also
    # step their schedulers; a joined rank takes rank 0's rates).
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dt = getattr(torch, dtype)
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)

    def run(join):
        net = cases.small_net(dt)
        trainer = mpikv.torch.Trainer(
            net, opt, kw, make_store(bigarray_bound=40),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
            # (by default a second backward reduces again, as DDP's does)
            shard="gradients" if how == "late-gradient" else None)
        for step in range(_batches(comm.rank) if join else _batches(0)):
            x, y = (t.to(dt) for t in cases.data(step, 0))

            def backward(zero=step >= _batches(comm.rank)):
                loss = ((net(x[rows]) - y[rows]).float() ** 2).mean()
                (loss * 0 if zero else loss).backward()
            trainer.zero_grad()
            backward()
            if how == "abandoned-backward":   # its step never comes: nothing is applied
                trainer.zero_grad()
                backward()
            if how == "late-gradient" and step == 2:   # rank 0 alone, with join
                if comm.rank == 0:
                    backward()
                with pytest.raises(mpikv.GradientError, match=r"on rank\(s\) 0;"):
                    trainer.step()
                trainer.zero_grad()
                backward()
            cases.update(trainer, net, how)
        return cases.finish(trainer, net, join)

    got, updates, last = run(join=True)
    want, want_updates, _ = run(join=False)
    assert last == 0
    assert updates == want_updates == _batches(0)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _net_and_trainer(make_store, **options):
    net = cases.Net()
    named = [(n, p) for n, p in net.named_parameters() if not n.startswith("spare")]
    trainer = mpikv.torch.Trainer(named, torch.optim.SGD, {"lr": 0.1},
                                  make_store(), **options)
    return net, trainer


def _weights(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_a_parameter_no_rank_used_is_skipped_as_torch_skips_it(make_store, comm):
    # Weight decay and momentum do not move it; used later (on one rank only), its first
    # step is a first step: torch's SGD on the same gradient, momentum starting fresh.
    net = cases.Net()
    kw = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, kw, make_store())
    start = _weights(net)
    x, y = cases.data(0, 0)
    for _ in range(3):
        trainer.zero_grad()
        net(x, False).sum().backward()
        trainer.step()
    after = _weights(net)
    for name in ("spare.weight", "spare.bias", "head.weight", "head.bias"):
        assert torch.equal(after[name], start[name]), name
    assert not torch.equal(after["fc1.weight"], start["fc1.weight"])
    trainer.zero_grad()
    if comm.rank == 0:
        net.spare(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
    trainer.step()
    ref = torch.nn.Linear(4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(start["spare.weight"])
        ref.bias.copy_(start["spare.bias"])
    ref_opt = torch.optim.SGD(ref.parameters(), **kw)
    (ref(torch.ones(1, 4, dtype=torch.float64)).sum() / comm.size).backward()
    ref_opt.step()
    torch.testing.assert_close(net.spare.weight.detach(), ref.weight.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(net.spare.bias.detach(), ref.bias.detach(), rtol=1e-12, atol=1e-12)


def test_unused_parameter_is_an_error_on_every_rank_when_asked(make_store, comm):
    net, trainer = _net_and_trainer(make_store, unused_parameters="error")
    before = _weights(net)
    x, y = cases.data(0, 0)
    # The head is used on rank 0 only (on a single rank: nowhere).
    net(x, comm.size > 1 and comm.rank == 0).sum().backward()
    message = raises_everywhere(comm, mpikv.GradientError, trainer.step)
    assert "head.weight, head.bias" in message
    assert f"rank {comm.size - 1}:" in message and "nothing was applied" in message
    for n, w in _weights(net).items():
        assert torch.equal(w, before[n]), n
    # The next step, with every parameter used, trains.
    trainer.zero_grad()
    net(x, True).sum().backward()
    trainer.step()
    assert not torch.equal(net.fc1.weight, before["fc1.weight"])


def test_a_second_backward_without_no_sync_is_an_error_on_every_rank_with_sharded_gradients(
        make_store, comm):
    net, trainer = _net_and_trainer(make_store, shard="gradients")
    before = _weights(net)
    x, y = cases.data(0, 0)
    net(x, True).sum().backward()
    if comm.rank == 0:  # one rank only: the others must still raise
        net(x, True).sum().backward()
    message = raises_everywhere(comm, mpikv.GradientError, trainer.step)
    assert "after their reduction started, on rank(s) 0;" in message
    for n, w in _weights(net).items():
        assert torch.equal(w, before[n]), n


def test_a_second_backward_accumulates_as_ddp_and_on_one_rank_only_is_an_error(make_store, comm):
    # DDP reduces again after each backward: .grad holds the sum of the averages.
    x, y = cases.data(0, 0)
    net, trainer = _net_and_trainer(make_store)
    ref = cases.Net()
    before = _weights(net)
    net(x, True).sum().backward()
    net(2 * x, False).sum().backward()   # the head's gradient: the first pass's only
    (ref(x, True).sum() + ref(2 * x, False).sum()).backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        if not name.startswith("spare"):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    trainer.step()
    torch.testing.assert_close(net.fc1.weight.detach(), before["fc1.weight"] - 0.1 * ref.fc1.weight.grad,
                               rtol=1e-12, atol=1e-12)
    # A second backward on one rank only: an error on every rank, nothing applied.
    before = _weights(net)
    trainer.zero_grad()
    got = None
    try:
        net(x, True).sum().backward()
        if comm.rank == 0:
            net(x, True).sum().backward()
        trainer.step()
    except mpikv.MPIKVError as exc:
        got = (type(exc).__name__, str(exc))
    if comm.size > 1:
        # The message says what rank 0 did, in the Trainer's words.
        for name, message in comm.allgather(got):
            assert name == "MismatchError"
            assert "rank 0 ran backward a second time in step 2" in message, message
            assert "trainer.no_sync()" in message, message
    for n, w in _weights(net).items():
        assert comm.size == 1 or torch.equal(w, before[n]), n


@pytest.mark.parametrize("shard,everywhere", [("optimizer", True), ("gradients", False),
                                               ("gradients", True)])
def test_a_gradient_replaced_after_backward(make_store, comm, shard, everywhere):
    # shard="optimizer": .grad is the averaged gradient, to change or replace before
    # step() (alike on every rank); shard="gradients": an error on every rank.
    net, trainer = _net_and_trainer(make_store, shard=shard)
    before = _weights(net)
    x, y = cases.data(0, 0)
    net(x, True).sum().backward()  # every bucket is sent during this backward
    if everywhere or comm.rank == comm.size - 1:
        net.fc2.weight.grad = torch.ones_like(net.fc2.weight)
    if shard == "gradients":
        message = raises_everywhere(comm, mpikv.GradientError, trainer.step)
        assert f"on rank(s) {comm.size - 1 if not everywhere else 0}" in message
        for n, w in _weights(net).items():
            assert torch.equal(w, before[n]), n
    else:
        trainer.step()
        torch.testing.assert_close(net.fc2.weight.detach(), before["fc2.weight"] - 0.1,
                                   rtol=0, atol=1e-15)
        assert torch.equal(net.fc2.weight.grad, torch.ones_like(net.fc2.weight))


def test_a_gradient_set_by_hand_before_step_is_summed(make_store, comm):
    net, trainer = _net_and_trainer(make_store, unused_parameters="error")
    for p in net.parameters():  # no backward at all: gradients written by hand
        p.grad = torch.full_like(p, comm.rank + 1.0)
    before = net.fc1.bias.detach().clone()
    trainer.step()
    average = sum(r + 1.0 for r in range(comm.size)) / comm.size
    torch.testing.assert_close(net.fc1.bias, before - 0.1 * average, rtol=0, atol=1e-15)


def test_an_unsupported_torch_optimizer_is_refused(make_store):
    net = cases.Net()
    with pytest.raises(mpikv.OptimizerError, match="LBFGS cannot run on the owners"):
        mpikv.torch.Trainer(net, torch.optim.LBFGS, {"lr": 0.1},
                            make_store())


def test_whole_parameters_on_a_store_that_splits_them_is_an_error_on_every_rank(make_store, comm):
    store = make_store(bigarray_bound=10)
    if comm.size == 1:   # one rank splits nothing
        with mpikv.torch.Trainer(cases.Net(), torch.optim.Adafactor, {"lr": 0.01}, store) as t:
            assert t.split_parameters is False
    else:
        with pytest.raises(mpikv.OptimizerError, match="this store splits arrays of 10"):
            mpikv.torch.Trainer(cases.Net(), torch.optim.Adafactor, {"lr": 0.01}, store)
    store.close()


@pytest.mark.parametrize("opt,kw", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
], ids=["sgd", "adamw"])
def test_trainer_equals_ddp(make_store, comm, gloo, opt, kw):
    from torch.nn.parallel import DistributedDataParallel

    def model():
        net = cases.Net()
        del net.spare, net.head  # DDP refuses parameters that get no gradient
        return net

    ours, theirs = model(), model()
    trainer = mpikv.torch.Trainer(ours, opt, kw, make_store())
    ddp = DistributedDataParallel(theirs)
    torch_opt = opt(ddp.parameters(), **kw)
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    for step in range(cases.STEPS):
        x, y = cases.data(step, 0)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(ours(x[rows], False), y[rows]).backward()
        trainer.step()
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[rows], False), y[rows]).backward()
        torch_opt.step()
    # Two addends sum alike in any order; more may be added in another order than gloo's.
    exact = comm.size <= 2
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        if exact:
            assert torch.equal(a, b), n
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not cuda_torch(), reason="needs a GPU with CUDA torch and cupy")
@pytest.mark.parametrize("opt,kw", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
], ids=["sgd", "adamw"])
def test_trainer_on_cuda_parameters_equals_one_process(comm, opt, kw):
    net = cases.Net().cuda()
    del net.spare
    trainer = mpikv.torch.Trainer(net, opt, kw)
    assert "device" in trainer.kvstore.type and net.fc1.weight.is_cuda
    ref = cases.Net()
    del ref.spare
    ref_opt = opt([p for p in ref.parameters() if p.requires_grad], **kw)
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    for step in range(cases.STEPS):
        x, y = cases.data(step, 0)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x[rows].cuda(), True), y[rows].cuda()).backward()
        trainer.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x, True), y).backward()
        ref_opt.step()
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9, msg=n)


def test_a_step_that_raised_counts_no_update(make_store, comm):
    """After an error nothing was applied, Adam's step counts included: the next
    steps equal those of a Trainer that never saw the error."""
    def run(with_error):
        net = cases.Net()
        named = [(n, p) for n, p in net.named_parameters() if not n.startswith("spare")]
        trainer = mpikv.torch.Trainer(named, torch.optim.Adam, {"lr": 0.01},
                                      make_store(),
                                      unused_parameters="error")
        x, y = cases.data(0, 0)
        if with_error:
            net(x, False).sum().backward()  # the head unused: an error on every rank
            with pytest.raises(mpikv.GradientError):
                trainer.step()
        for step in range(2):
            trainer.zero_grad()
            net(x, True).sum().backward()
            trainer.step()
        return _weights(net)
    clean, after_error = run(False), run(True)
    for n, w in clean.items():
        assert torch.equal(w, after_error[n]), n


def test_16_bit_parameters_on_one_rank_only_are_an_error_on_every_rank(make_store, comm):
    pytest.importorskip("ml_dtypes")
    if comm.size == 1:
        pytest.skip("needs ranks that differ")
    net = cases.Net()
    if comm.rank == comm.size - 1:
        net.fc2.to(torch.bfloat16)
    message = raises_everywhere(comm, mpikv.MismatchError, lambda: mpikv.torch.Trainer(
        net, torch.optim.SGD, {"lr": 0.1}, make_store()))
    # Its masters (multi_precision, on with 16-bit parameters) set it apart first.
    assert "set_optimizer: ranks differ in optimizer" in message


def test_a_trainer_save_rank_0_cannot_write_is_an_error_on_every_rank(make_store, comm,
                                                                      tmp_path_factory):
    import os
    base = comm.bcast(str(tmp_path_factory.mktemp("save")) if comm.rank == 0 else None)
    _, trainer = _net_and_trainer(make_store)
    trainer.save_checkpoint(os.path.join(base, "ck"))  # whole on every rank when it returns
    before = sorted(os.listdir(base))
    assert before == ["ck", "ck.parts", "ck.trainer.json"]
    comm.Barrier()
    missing = os.path.join(base, "missing", "ck")  # its directory does not exist
    # The same message on every rank, naming the rank that failed (the store's agreement).
    message = raises_everywhere(comm, mpikv.StateFileError,
                                lambda: trainer.save_checkpoint(missing))
    assert "trainer.json could not be written" in message and "nothing was applied" in message
    if comm.size > 1:
        assert "save_checkpoint: rank 0: " in message
    comm.Barrier()
    assert sorted(os.listdir(base)) == before  # the previous save whole, nothing new


def test_loading_a_checkpoint_without_the_trainer_file_is_an_error_everywhere(make_store,
        comm, tmp_path_factory):
    import os
    base = comm.bcast(str(tmp_path_factory.mktemp("bare")) if comm.rank == 0 else None)
    net, trainer = _net_and_trainer(make_store)
    trainer.kvstore.save_checkpoint(os.path.join(base, "ck"))  # the store's part only
    before = _weights(net)
    message = raises_everywhere(comm, mpikv.StateFileError,
                                lambda: trainer.load_checkpoint(os.path.join(base, "ck")))
    assert "trainer.json cannot be read" in message
    for n, w in _weights(net).items():
        assert torch.equal(w, before[n]), n


def test_a_trainer_file_one_rank_cannot_read_is_the_same_error_everywhere(make_store,
        comm, tmp_path_factory, monkeypatch):
    """A failure seen on one rank reaches every rank through the store's agreement,
    with one message naming that rank; nothing is loaded."""
    import os
    base = comm.bcast(str(tmp_path_factory.mktemp("one")) if comm.rank == 0 else None)
    net, trainer = _net_and_trainer(make_store)
    trainer.save_checkpoint(os.path.join(base, "ck"))
    x, y = cases.data(0, 0)
    net(x, True).sum().backward()
    trainer.step()
    before = _weights(net)
    if comm.rank == comm.size - 1:   # this rank looks for the file elsewhere
        monkeypatch.setattr(mpikv.torch.checkpoint, "meta_path", lambda p: str(p) + ".gone")
    message = raises_everywhere(comm, mpikv.StateFileError,
                                lambda: trainer.load_checkpoint(os.path.join(base, "ck")))
    assert "ck.gone cannot be read" in message and "nothing was applied" in message
    if comm.size > 1:
        assert f"load_checkpoint: rank {comm.size - 1}: " in message
    for n, w in _weights(net).items():
        assert torch.equal(w, before[n]), n
    monkeypatch.undo()
    trainer.load_checkpoint(os.path.join(base, "ck"))   # the store stays usable
    assert trainer.num_update == 0


def test_the_status_sum_is_a_store_call_that_names_ranks_that_differ(make_store, comm):
    kv = make_store()
    a = np.full(3, comm.rank + 1.0)
    kv.allreduce_(a)
    assert a.tolist() == [comm.size * (comm.size + 1) / 2] * 3
    if comm.size > 1:
        message = raises_everywhere(comm, mpikv.MismatchError,
                                    lambda: kv.allreduce_(np.zeros(2 + comm.rank)))
        assert "allreduce_: ranks differ in shape" in message
    if comm.rank == comm.size - 1:
        kv.fail_next_call(mpikv.GradientError, "a failure here")
    message = raises_everywhere(comm, mpikv.GradientError, lambda: kv.allreduce_(a))
    assert "a failure here" in message and "nothing was applied" in message
    if comm.size > 1:
        assert f"rank {comm.size - 1}: a failure here" in message
    kv.close()


def test_optimizer_objects_and_state_dicts_are_refused_on_every_rank(comm):
    """Issue 27's refusals, at every rank count: the same one-line error everywhere,
    and the store still trains after them (no rank left waiting)."""
    net = cases.Net()
    instance = torch.optim.SGD(net.parameters(), lr=0.05)
    msg = raises_everywhere(comm, mpikv.OptimizerError,
                            lambda: mpikv.torch.Trainer(net, instance, None))
    assert "pass the class and its arguments" in msg and "\n" not in msg
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    # Before a consolidation the state is on the owners only.
    msg = raises_everywhere(comm, mpikv.OptimizerError, trainer.optimizer.state_dict)
    assert "consolidate_state_dict(to) on every rank" in msg and "save_checkpoint" in msg
    twin = cases.Net()
    plain = torch.optim.Adam([p for p in twin.parameters() if p.requires_grad], lr=0.1)
    sum(p.sum() for p in twin.parameters()).backward()
    plain.step()
    msg = raises_everywhere(comm, mpikv.OptimizerError,
                            lambda: trainer.optimizer.load_state_dict(plain.state_dict()))
    assert "not a state of torch.optim.SGD" in msg and "\n" not in msg
    before = [p.detach().clone() for p in net.parameters()]
    x, y = cases.data(0, 0)
    torch.nn.functional.mse_loss(net(x, False), y).backward()
    trainer.step()
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, net.parameters()))
    assert all(comm.allgather(changed))
    trainer.close()


# -- trainer.optimizer's state in torch's format (issue 27, item 3) -----------------------
STATE_OPTIMIZERS = cases.STATE_OPTIMIZERS


def _trained(net):
    return [p for p in net.parameters() if p.requires_grad]


def _plain_step(net, opt, step):
    """One step of one process on the global batch (the head stays unused)."""
    x, y = cases.data(step, 0)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(net(x, False), y).backward()
    opt.step()


def _rank_step(comm, net, trainer, step):
    """One Trainer step on this rank's rows of the global batch."""
    x, y = cases.data(step, 0)
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    trainer.zero_grad()
    torch.nn.functional.mse_loss(net(x[rows], False), y[rows]).backward()
    trainer.step()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name", sorted(STATE_OPTIMIZERS))
def test_consolidated_state_equals_one_torch_process_with_the_global_batch(make_store, comm, name,
                                                                           split,
                                                                           monkeypatch):
    """consolidate_state_dict gathers every owner's parts (whole keys, or flat shards
    of split keys) onto rank `to`, in the format of the plain torch optimizer."""
    if split:   # many windows, each cutting arrays and shards anywhere
        monkeypatch.setattr(optimizer_state, "WINDOW_BYTES", 40)
    opt, kw = STATE_OPTIMIZERS[name]
    ref, net = cases.Net(), cases.Net()
    plain = opt(_trained(ref), **kw)
    trainer = mpikv.torch.Trainer(net, opt, kw,
                                  make_store(**({"bigarray_bound": 10} if split else {})))
    for step in range(3):
        _plain_step(ref, plain, step)
        _rank_step(comm, net, trainer, step)
    to = comm.size - 1
    trainer.optimizer.consolidate_state_dict(to=to)
    if comm.rank == to:
        cases.assert_same_state(trainer.optimizer.state_dict(), plain.state_dict(), tol=1e-12)
    else:
        with pytest.raises(mpikv.OptimizerError, match=f"onto rank {to}, not this rank"):
            trainer.optimizer.state_dict()
    trainer.close()
    trainer.kvstore.close()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name", sorted(STATE_OPTIMIZERS))
def test_a_torch_state_loads_on_the_owners_and_training_goes_on_as_torch(make_store, comm, name,
                                                                         split):
    """A one-process torch run's state (as a DDP run saves it, loaded on every rank):
    each owner takes its parts exactly, and the next steps equal torch's."""
    opt, kw = STATE_OPTIMIZERS[name]
    ref = cases.Net()
    plain = opt(_trained(ref), **kw)
    for step in range(3):
        _plain_step(ref, plain, step)
    saved = copy.deepcopy(plain.state_dict())
    net = copy.deepcopy(ref)
    trainer = mpikv.torch.Trainer(net, opt, {**kw, "lr": 0.5},
                                  make_store(**({"bigarray_bound": 10} if split else {})))
    trainer.optimizer.load_state_dict(saved)
    assert trainer.optimizer.param_groups[0]["lr"] == kw["lr"]
    trainer.optimizer.consolidate_state_dict(to=0)
    if comm.rank == 0:
        cases.assert_same_state(trainer.optimizer.state_dict(), saved)   # bit for bit
    for step in range(3, 6):
        _plain_step(ref, plain, step)
        _rank_step(comm, net, trainer, step)
    for (n, a), b in zip(ref.named_parameters(), net.parameters()):
        np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), rtol=1e-10,
                                   atol=1e-10, err_msg=n)
    trainer.close()
    trainer.kvstore.close()


def test_a_state_bad_on_one_rank_is_refused_on_every_rank_with_nothing_changed(make_store, comm):
    opt, kw = STATE_OPTIMIZERS["sgd"]
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, opt, kw, make_store(bigarray_bound=10))
    _rank_step(comm, net, trainer, 0)
    trainer.optimizer.consolidate_state_dict(to=0)
    before = trainer.optimizer.state_dict() if comm.rank == 0 else None
    hyper = [{k: v for k, v in g.items() if k != "params"}
             for g in trainer.optimizer.param_groups]
    ref = cases.Net()
    plain = opt(_trained(ref), **{**kw, "lr": 0.02})
    _plain_step(ref, plain, 0)
    state = copy.deepcopy(plain.state_dict())
    last = comm.size - 1
    if comm.rank == last:   # this rank's file is another model's
        state["state"][2]["momentum_buffer"] = torch.zeros(3, 3, dtype=torch.float64)
    msg = raises_everywhere(comm, mpikv.OptimizerError,
                            lambda: trainer.optimizer.load_state_dict(state))
    where = f"rank {last}: " if comm.size > 1 else ""
    assert msg == (f"OptimizerError: trainer.optimizer.load_state_dict: {where}momentum_buffer "
                   f"of parameter 2 ('fc1.weight') has shape (3, 3), the parameter (16, 8); "
                   f"nothing was applied")
    assert [{k: v for k, v in g.items() if k != "params"}
            for g in trainer.optimizer.param_groups] == hyper
    trainer.optimizer.consolidate_state_dict(to=0)
    if comm.rank == 0:
        cases.assert_same_state(trainer.optimizer.state_dict(), before)
    # Ranks that give different `to` are refused alike; training goes on.
    if comm.size > 1:
        msg = raises_everywhere(comm, mpikv.OptimizerError,
                                lambda: trainer.optimizer.consolidate_state_dict(to=comm.rank))
        assert "ranks gave different `to`: rank 0: 0, rank 1: 1" in msg
    _rank_step(comm, net, trainer, 1)
    assert trainer.num_update == 2
    trainer.close()
    trainer.kvstore.close()


def test_hyperparameters_that_differ_on_one_rank_are_refused_on_every_rank(make_store, comm):
    """Each rank's dict goes into its own param_groups: a learning rate of its own on
    one rank is the same MismatchError on every rank, naming both, nothing loaded
    (it was taken, and the next step refused, before)."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    opt, kw = STATE_OPTIMIZERS["sgd"]
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, opt, kw, make_store())
    _rank_step(comm, net, trainer, 0)
    trainer.optimizer.consolidate_state_dict(to=0)
    before = trainer.optimizer.state_dict() if comm.rank == 0 else None
    ref = cases.Net()
    plain = opt(_trained(ref), **kw)
    _plain_step(ref, plain, 0)
    state = copy.deepcopy(plain.state_dict())
    if comm.rank == comm.size - 1:
        state["param_groups"][0]["lr"] = 7.0
    msg = raises_everywhere(comm, mpikv.MismatchError,
                            lambda: trainer.optimizer.load_state_dict(state))
    assert msg.startswith("MismatchError: trainer.optimizer.load_state_dict: ranks differ in "
                          "hyperparameters"), msg
    assert f'"lr": {kw["lr"]}' in msg and '"lr": 7.0' in msg, msg
    assert trainer.optimizer.param_groups[0]["lr"] == kw["lr"]
    trainer.optimizer.consolidate_state_dict(to=0)
    if comm.rank == 0:
        cases.assert_same_state(trainer.optimizer.state_dict(), before)
    _rank_step(comm, net, trainer, 1)
    assert trainer.num_update == 2
    trainer.close()
    trainer.kvstore.close()


# -- shard="parameters" --------------------------------------------------------------------
def test_sharded_parameters_keep_only_the_owned_parts_between_uses(make_store, comm):
    """Between steps each rank holds the parts it owns; the rest reads zero (its
    memory given back); gathered() gives the whole weights, equal on every rank."""
    net = cases.Net()
    store = make_store(bigarray_bound=10, shared_memory=False)
    trainer = mpikv.torch.Trainer(net, torch.optim.Adam, {"lr": 0.01}, store, shard="parameters")
    for step in range(2):
        _rank_step(comm, net, trainer, step)
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        flat = p.detach().reshape(-1)
        for shard in store.plan[name].shards:
            part = flat[shard.start:shard.stop]
            if shard.owner != comm.rank:
                assert not part.any(), (name, shard)
            grad = p.grad.reshape(-1)[shard.start:shard.stop]
            if shard.owner != comm.rank:
                assert not grad.any(), (name, shard)
    with trainer.gathered():
        whole = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    everyone = comm.allgather(whole)
    for n in whole:
        assert all((other[n] == whole[n]).all() for other in everyone), n
    trainer.close()
    store.close()


def test_ranks_that_run_different_modules_with_sharded_parameters_get_one_error(comm):
    if comm.size == 1:
        pytest.skip("one rank runs what it runs")
    with pytest.raises(mpikv.MismatchError, match="was given on rank"):
        cases.train("head-on-some-ranks", "dist_sync", comm.rank, comm.size, shard="parameters")


def test_join_with_sharded_parameters_is_one_error_on_every_rank(make_store, comm):
    if comm.size == 1:
        pytest.skip("a join needs another rank still training")
    net = cases.Net()
    store = make_store()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, store, shard="parameters")
    steps = 1 if comm.rank == comm.size - 1 else 2

    def run():
        for step in range(steps):
            _rank_step(comm, net, trainer, step)
        trainer.join()
    try:
        run()
        got = None
    except mpikv.MPIKVError as exc:
        got = str(exc)
    everyone = comm.allgather(got)
    assert all(m is not None and "join() is not supported with shard='parameters'" in m
               for m in everyone), everyone


class _Encoder(torch.nn.Module):
    """A transformer layer (MultiheadAttention reads its out_proj's weight itself) and
    a module whose forward reads its child's weight without calling the child."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                      dtype=torch.float64)
        self.odd = torch.nn.Module()
        self.odd.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 2, dtype=torch.float64)

    def forward(self, x):
        h = self.layer(x)
        h = torch.nn.functional.linear(h, self.odd.proj.weight)   # odd.proj never called
        return self.head(h)


def _encoder_steps(comm, net, trainer, steps=3):
    per = cases.GLOBAL_BATCH // comm.size
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(cases.GLOBAL_BATCH, 4, 8, generator=g, dtype=torch.float64),
                torch.randn(cases.GLOBAL_BATCH, 4, 2, generator=g, dtype=torch.float64))
               for _ in range(steps)]
    for x, y in batches:
        rows = slice(comm.rank * per, (comm.rank + 1) * per) if trainer else slice(None)
        net.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        trainer.step() if trainer else None
    return batches


def test_sharded_parameters_train_a_transformer_layer_as_one_process(make_store, comm,
                                                                      monkeypatch):
    """The planner keeps modules with parameters of their own whole (MultiheadAttention)."""
    net, ref = _Encoder(), _Encoder()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store(bigarray_bound=16),
                                  shard="parameters", units=[net.layer.self_attn,
                                                             net.layer.linear1, net.head])
    _encoder_steps(comm, net, trainer)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(cases.GLOBAL_BATCH, 4, 8, generator=g, dtype=torch.float64)
        y = torch.randn(cases.GLOBAL_BATCH, 4, 2, generator=g, dtype=torch.float64)
        plain.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        plain.step()
    with trainer.gathered():
        for (n, a), b in zip(net.named_parameters(), ref.parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-10,
                                       atol=1e-12, err_msg=n)
    made = torch_pieces.record(monkeypatch)
    auto = mpikv.torch.Trainer(_Encoder(), torch.optim.SGD, {"lr": 0.1}, shard="parameters")
    assert any(type(u.module).__name__ == "MultiheadAttention" for u in made[-1].shards.units)
    auto.close()
    trainer.close()


def test_a_weight_read_outside_its_unit_is_an_error_on_every_rank(make_store, comm):
    net = _Encoder()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store(),
                                  shard="parameters", units=[net.odd.proj, net.head])
    try:
        _encoder_steps(comm, net, trainer, steps=1)
        got = None
    except mpikv.InputError as exc:
        got = str(exc)
    everyone = comm.allgather(got)
    assert all(m is not None and "'odd.proj.weight' got a gradient, but its module (Linear) "
               "did not run" in m for m in everyone), everyone
