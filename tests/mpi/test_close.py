"""KVStore.close and Trainer.close at 1-4 ranks: what they free, what stays valid,
and the errors after them."""

import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpikv

from .conftest import TEST_TIMEOUT, raises_everywhere

pytestmark = pytest.mark.mpi


def _threads():
    return sorted(t.name for t in threading.enumerate() if t.name in ("mpikv-watchdog",
                                                                        "mpikv-comm"))


def test_closed_stores_leave_no_thread_and_no_communicator(comm):
    before = _threads()
    for _ in range(5):
        kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)
        kv.init("w", np.zeros(4, np.float32))
        kv.wait(kv.pushpull_async("w", np.ones(4, np.float32)))   # starts the worker thread
        mine = kv.comm
        kv.close()
        if comm.size > 1:
            assert mine == MPI.COMM_NULL   # freed
    assert _threads() == before


def test_every_call_after_close_is_an_error_on_every_rank(comm):
    kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)
    kv.init("w", np.zeros(3, np.float32))
    kv.pushpull("w", np.ones(3, np.float32))   # a remembered one-key route
    kv.close()
    kv.close()   # again: nothing
    calls = [lambda: kv.push("w", np.ones(3, np.float32)),
             lambda: kv.pushpull("w", np.ones(3, np.float32)),
             lambda: kv.pull("w", out=np.zeros(3, np.float32)),
             lambda: kv.init("v", np.zeros(2)),
             lambda: kv.barrier()]
    for call in calls:
        message = raises_everywhere(comm, mpikv.InputError, call)
        assert "the store is closed (close() was called)" in message
    assert (kv.rank, kv.num_workers) == (comm.rank, comm.size)


def test_buffers_and_async_results_stay_valid(comm):
    n = comm.size
    kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)
    kv.init(["a", "b"], [np.zeros(5, np.float32), np.zeros(2, np.float64)])
    values = kv.value_buffers(["a", "b"])
    out = [np.zeros(5, np.float32), np.zeros(2, np.float64)]
    kv.pushpull_async(["a", "b"], [np.ones(5, np.float32), np.full(2, 2.0)], out=out)
    kv.close()   # waits for the call first
    assert out[0].tolist() == [n] * 5 and out[1].tolist() == [2 * n] * 2
    kv2 = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)   # reuses nothing of the old one
    kv2.init("a", np.zeros(5, np.float32))
    kv2.pushpull("a", np.full(5, 3, np.float32))
    # The old store's buffers: readable, with its last values, untouched by the new store.
    assert [v.tolist() for v in values] == [[n] * 5, [2 * n] * 2]
    kv2.close()


def test_a_store_closed_by_some_ranks_only_is_an_error_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)
    kv.init("w", np.zeros(3, np.float32))
    call = kv.close if comm.rank == 0 else (lambda: kv.push("w", np.ones(3, np.float32)))
    message = raises_everywhere(comm, mpikv.MismatchError, call)
    assert "close" in message and "push" in message
    kv.pushpull("w", np.ones(3, np.float32))   # nothing was closed, nothing applied
    out = np.zeros(3, np.float32)
    kv.pull("w", out=out)
    assert out.tolist() == [comm.size] * 3
    kv.close()


def test_with_closes_the_store(comm):
    with mpikv.create("dist_sync", timeout=TEST_TIMEOUT) as kv:
        kv.init(1, np.zeros(2))
    message = raises_everywhere(comm, mpikv.InputError, lambda: kv.pull(1, out=np.zeros(2)))
    assert "closed" in message


def test_trainer_close_gives_the_model_its_own_memory(comm):
    torch = pytest.importorskip("torch")
    import mpikv.torch

    before = _threads()
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2, dtype=torch.float64)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1})
    net(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    trainer.step()
    store, weight = trainer.kvstore, net.weight.detach().clone()
    buffer = store.value_buffers(["weight"])[0]
    assert buffer.ctypes.data == net.weight.data_ptr()   # trained in the store's memory
    trainer.close()
    trainer.close()   # again: nothing
    assert torch.equal(net.weight.detach(), weight)
    assert buffer.ctypes.data != net.weight.data_ptr()   # now its own
    message = raises_everywhere(comm, mpikv.InputError,
                                lambda: store.pull("weight", out=np.zeros((2, 3))))
    assert "closed" in message
    # Plain torch from here: the parameters are no longer the store's buffers.
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.zero_grad()
    net(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    assert not torch.equal(net.weight.detach(), weight)
    assert _threads() == before


def test_trainer_close_leaves_a_store_it_was_given_open(comm):
    torch = pytest.importorskip("torch")
    import mpikv.torch

    kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT)
    net = torch.nn.Linear(2, 2, dtype=torch.float64)
    with mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, kv):
        pass
    kv.init("x", np.zeros(2))   # still open
    kv.pushpull("x", np.ones(2))
    kv.close()
