"""Trainer calls that ranks reach differently (issue 27, item 4), at 2-4 ranks: the
same MismatchError on every rank that made a call, in the Trainer's terms (who
was in which step, who called what), nothing applied; then the right calls
work. tests/jobs/test_uneven_calls.py runs whole jobs that end on it."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402


pytestmark = pytest.mark.mpi

STEPS = "the ranks ran different numbers of steps; for uneven data use trainer.join()"


@pytest.fixture
def two(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")


def _trainer(make_store):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    kv = make_store()
    return net, mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, kv)


def _step(net, trainer, seed=1):
    torch.manual_seed(seed + trainer.kvstore.rank)
    trainer.zero_grad()
    net(torch.randn(4, 3)).pow(2).sum().backward()
    trainer.step()


def _each(comm, calls):
    """Runs ``calls[rank]`` (or ``calls[None]``); returns the error text, the same on
    every rank (asserted), or None."""
    try:
        calls.get(comm.rank, calls.get(None))()
        got = None
    except mpikv.MPIKVError as e:
        got = f"{type(e).__name__}: {e}"
    everyone = comm.allgather(got)
    assert len(set(everyone)) == 1, everyone
    return everyone[0]


def _but(comm, rank):
    """``"rank 0"``, ``"ranks 1-3"``: every rank but ``rank``."""
    return mpikv.calls.agreement.format_ranks([r for r in range(comm.size) if r != rank])


def _others(comm, rank):
    """``"rank 0 is"``, ``"ranks 1-3 are"``."""
    return f"{_but(comm, rank)} {'is' if comm.size == 2 else 'are'}"


def _same_weights(comm, net):
    mine = [p.detach().numpy().copy() for p in net.parameters()]
    for other in comm.allgather(mine):
        for a, b in zip(mine, other):
            assert np.array_equal(a, b)


def test_save_checkpoint_on_rank_0_only_then_on_every_rank(make_store, comm, two, tmp_path):
    path = comm.bcast(str(tmp_path / "ckpt"))
    net, trainer = _trainer(make_store)
    _step(net, trainer)
    before = [p.detach().clone() for p in net.parameters()]
    message = _each(comm, {0: lambda: trainer.save_checkpoint(path),
                           None: lambda: _step(net, trainer, 2)})
    assert message == (f"MismatchError: rank 0 called save_checkpoint after step 1 while "
                       f"{_others(comm, 0)} in step 2: save_checkpoint is collective: every "
                       f"rank must call it; nothing was applied")
    # Nothing was applied: no step, no file.
    assert trainer.num_update == 1
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    comm.barrier()
    assert not (tmp_path / "ckpt").exists() or comm.rank != 0
    # The right call works, and so do the steps after it.
    trainer.zero_grad()
    trainer.save_checkpoint(path)
    _step(net, trainer, 3)
    assert trainer.num_update == 2
    _same_weights(comm, net)
    trainer.close()


def test_close_on_one_rank_after_fewer_steps_then_on_every_rank(make_store, comm, two):
    net, trainer = _trainer(make_store)
    _step(net, trainer)
    last = comm.size - 1
    message = _each(comm, {last: trainer.close, None: lambda: _step(net, trainer, 2)})
    assert message == (f"MismatchError: rank {last} closed the Trainer after step 1 while "
                       f"{_others(comm, last)} in step 2: {STEPS}; nothing was applied")
    # Nothing was closed: the Trainer still trains on every rank.
    _step(net, trainer, 3)
    assert trainer.num_update == 2
    weight = trainer.kvstore.value_buffers(["0.weight"])[0]
    assert weight.ctypes.data == net[0].weight.data_ptr()
    trainer.close()
    assert weight.ctypes.data != net[0].weight.data_ptr()   # the model's own memory now
    _same_weights(comm, net)
    trainer.kvstore.close()


def test_load_checkpoint_against_save_checkpoint(make_store, comm, two, tmp_path):
    path = comm.bcast(str(tmp_path / "ckpt"))
    net, trainer = _trainer(make_store)
    _step(net, trainer)
    message = _each(comm, {0: lambda: trainer.load_checkpoint(path),
                           None: lambda: trainer.save_checkpoint(path)})
    assert message == (
        f"MismatchError: rank 0 called load_checkpoint after step 1 while {_but(comm, 0)}"
        f" called save_checkpoint after step 1: load_checkpoint is collective: every rank must "
        f"call it; save_checkpoint is collective: every rank must call it; nothing was applied")
    trainer.save_checkpoint(path)
    _step(net, trainer, 2)
    trainer.load_checkpoint(path)
    assert trainer.num_update == 1
    # The step context follows the loaded count: a mismatch now names step 2.
    last = comm.size - 1
    message = _each(comm, {last: trainer.close, None: lambda: _step(net, trainer, 3)})
    assert f"after step 1 while {_others(comm, last)} in step 2" in message
    trainer.close()


def test_a_process_that_ends_while_the_others_train(make_store, comm, two):
    # What the exit hook does at the end of a process (mpikv.store.factory._end_of_process).
    net, trainer = _trainer(make_store)
    _step(net, trainer)
    store = trainer.kvstore
    message = _each(comm, {1: store.exit_process, None: lambda: _step(net, trainer, 2)})
    assert message == (f"MismatchError: rank 1 ended its process after step 1 while "
                       f"{_others(comm, 1)} in step 2: {STEPS}; nothing was applied")
    # Ranks that all end agree (and the store is still usable).
    store.exit_process()
    _step(net, trainer, 3)
    assert trainer.num_update == 2
    trainer.close()


def test_a_call_of_the_others_while_a_rank_has_joined(make_store, comm, two, tmp_path):
    # The joined rank waits; the others get the error, then join too.
    path = comm.bcast(str(tmp_path / "ckpt"))
    net, trainer = _trainer(make_store)
    _step(net, trainer)
    last = comm.size - 1
    if comm.rank == last:
        assert trainer.join() == last - 1   # the others joined after it, together
    else:
        with pytest.raises(mpikv.MismatchError) as raised:
            trainer.save_checkpoint(path)
        assert str(raised.value) == (
            f"{_but(comm, last)} called save_checkpoint after step 1 while rank {last} called "
            f"trainer.join() after step 1: save_checkpoint is collective: every rank must call "
            f"it; after trainer.join() on some ranks, the others may only make training steps "
            f"until they call it too; nothing was applied")
        _step(net, trainer, 2)   # the joined rank takes part
        assert trainer.join() == last - 1
    assert trainer.num_update == 2
    trainer.save_checkpoint(path)
    _same_weights(comm, net)
    trainer.close()


def test_set_context_of_a_plain_store(make_store, comm, two):
    kv = make_store()
    kv.init("w", np.zeros(2))
    # Different contexts, the same call: they agree (contexts are not compared).
    kv.set_context("is evaluating" if comm.rank == 0 else "is in epoch 3")
    kv.pushpull("w", np.ones(2))
    if comm.rank == 0:
        kv.set_context("is evaluating", hint="evaluate on every rank")
    message = _each(comm, {0: kv.barrier, None: lambda: kv.push("w", np.ones(2))})
    assert message == (f"MismatchError: rank 0 is evaluating while {_others(comm, 0)} in "
                       f"epoch 3: evaluate on every rank; nothing was applied")
    kv.set_context(None)
    message = _each(comm, {0: kv.barrier, None: lambda: kv.push("w", np.ones(2))})
    assert message == (f"MismatchError: ranks called different operations: barrier on rank 0; "
                       f"push on {_but(comm, 0)}; nothing was applied")
    kv.close()
