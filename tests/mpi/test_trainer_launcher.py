"""The Trainer's launcher (issue 26, item 7): each bucket's ``push_async`` and
``gather_gradients_async``, and their agreements (a blocking collective), run
off the thread that runs autograd's hooks; an agreement that fails there is
the same error on every rank, at the backward or step where it happened,
nothing applied, no hang.

Run: ``scripts/mpirun.sh -n 2 .venv/bin/python -m pytest tests/mpi/test_trainer_launcher.py --with-mpi``
(and ``-n 3``).
"""

import threading

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.transport import cuda  # noqa: E402
from mpikv.transport.mpi import MPITransport  # noqa: E402

from .. import fake_cuda_torch, fakecupy  # noqa: E402
from .. import torch_pieces  # noqa: E402
from .. import trainer_cases as cases  # noqa: E402
from .conftest import TEST_TIMEOUT, raises_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi

#: the store calls a bucket's reduction makes (and the ops of their agreements)
REDUCTIONS = ("push", "gather_gradients")


@pytest.fixture(params=["host", "device"])
def where(request, comm, monkeypatch):
    """``"host"``: CPU parameters on a ``dist_sync`` store; ``"device"``: the same
    tensors as "CUDA" ones (tests/fake_cuda_torch.py) on stand-in GPU ``rank % 2``,
    over a ``dist_sync_device`` store, staged."""
    if request.param == "device":
        monkeypatch.setenv(cuda.ENV, "0")
        monkeypatch.setattr(cuda, "FALLBACK", cuda.Fallback())
        fake_cuda_torch.install(monkeypatch, device=comm.rank % 2)
        yield "dist_sync_device"
        assert fakecupy.races() == []
    else:
        yield "dist_sync"


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _recorded(trainer, pieces, monkeypatch):
    """Records the thread of every hook's launch, of every reduction call and of its
    agreement: ``{"hooks": set, "calls": [(op, thread)], "agreements": [(op, thread, bad)]}``."""
    kv = trainer.kvstore
    seen = {"hooks": set(), "calls": [], "agreements": []}
    launch = pieces.reduction.launch

    def traced_launch(b):
        seen["hooks"].add(threading.get_ident())
        return launch(b)
    monkeypatch.setattr(pieces.reduction, "launch", traced_launch)
    for name, op in (("push_async", "push"), ("gather_gradients_async", "gather_gradients")):
        def traced(*args, _call=getattr(kv, name), _op=op, **kw):
            seen["calls"].append((_op, threading.get_ident()))
            return _call(*args, **kw)
        monkeypatch.setattr(kv, name, traced)
    agree = MPITransport.agree

    def traced_agree(transport, digest, has_error, what):
        if transport.comm is kv.comm:   # this store's agreements, no other's
            seen["agreements"].append((what[0], threading.get_ident(), has_error))
        return agree(transport, digest, has_error, what)
    monkeypatch.setattr(MPITransport, "agree", traced_agree)
    return seen


def _backward(net, step, comm):
    per = cases.GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    x, y = (t.float() for t in cases.data(step, 0))
    ((net(x[rows]) - y[rows]) ** 2).mean().backward()


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_reductions_and_their_agreements_run_off_the_hook_thread(comm, where, monkeypatch, shard):
    if comm.size == 1:
        pytest.skip("one rank: the calls run inline (nothing to wait for)")
    net = _model()
    kv = mpikv.create(where, timeout=TEST_TIMEOUT)
    made = torch_pieces.record(monkeypatch)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, kv, bucket_bytes=64,
                                  shard=shard)
    seen = _recorded(trainer, made[-1], monkeypatch)
    for step in range(2):
        trainer.zero_grad()
        _backward(net, step, comm)
        trainer.step()
    buckets = len(made[-1].wiring.buckets)
    assert buckets > 1
    calls = [op for op, _ in seen["calls"]]
    assert calls.count("push") == 2 * buckets
    assert calls.count("gather_gradients") == (2 * buckets if shard == "optimizer" else 0)
    agreed = [(op, t) for op, t, _ in seen["agreements"] if op in REDUCTIONS]
    assert len(agreed) == len(calls)
    assert seen["hooks"] and threading.get_ident() in seen["hooks"]   # CPU autograd: this thread
    assert not {t for _, t in seen["calls"]} & seen["hooks"], seen
    assert not {t for _, t in agreed} & seen["hooks"], seen
    # The other store calls (the status sum, the pulls) stay on this thread.
    assert {t for op, t, _ in seen["agreements"] if op not in REDUCTIONS} == {threading.get_ident()}
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    everyone = comm.allgather({n: w.numpy() for n, w in weights.items()})
    for other in everyone[1:]:
        for n in weights:
            assert (other[n] == everyone[0][n]).all(), n
    trainer.close()
    kv.close()
    assert made[-1].context.launcher.thread is None   # close() ended it


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_failed_agreement_on_the_launcher_is_raised_on_every_rank(comm, where, monkeypatch,
                                                                     shard):
    if comm.size == 1:
        pytest.skip("one rank: the calls run inline")
    net = _model()
    kv = mpikv.create(where, timeout=TEST_TIMEOUT)
    made = torch_pieces.record(monkeypatch)
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, kv,
                                  bucket_bytes=64, shard=shard)
    trainer.zero_grad()
    _backward(net, 0, comm)
    trainer.step()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    seen = _recorded(trainer, made[-1], monkeypatch)
    trainer.zero_grad()
    if comm.rank == comm.size - 1:
        # This rank's next call fails, on every rank: the first bucket's push.
        kv.fail_next_call(mpikv.GradientError, "a failure here")
    if shard == "optimizer":   # backward ends by averaging .grad: the error comes there
        message = raises_everywhere(comm, mpikv.GradientError, lambda: _backward(net, 1, comm))
    else:                      # the next store call after backward is the step's
        _backward(net, 1, comm)
        message = raises_everywhere(comm, mpikv.GradientError, trainer.step)
    assert "a failure here" in message and "nothing was applied" in message
    if comm.size > 1:
        assert f"rank {comm.size - 1}: a failure here" in message
    failed = [(op, t) for op, t, bad in seen["agreements"] if bad]
    assert [op for op, _ in failed] == (["push"] if comm.rank == comm.size - 1 else [])
    assert not {t for _, t in failed} & seen["hooks"]
    # Nothing applied; the later buckets never left (every rank dropped them).
    assert [op for op, _, _ in seen["agreements"]] == ["push"], seen["agreements"]
    assert trainer.num_update == 1
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    # The Trainer goes on: the next step trains as if the failed one never was.
    trainer.zero_grad()
    _backward(net, 1, comm)
    trainer.step()
    assert trainer.num_update == 2
    got = {n: p.detach().clone() for n, p in net.named_parameters()}
    trainer.close()
    kv.close()
    # The same as two clean steps of the same batches.
    twin = _model()
    kv2 = mpikv.create(where, timeout=TEST_TIMEOUT)
    clean = mpikv.torch.Trainer(twin, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, kv2,
                                bucket_bytes=64, shard=shard)
    for step in range(2):
        clean.zero_grad()
        _backward(twin, step, comm)
        clean.step()
    for n, p in twin.named_parameters():
        assert torch.equal(p.detach(), got[n]), n
    clean.close()
    kv2.close()


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_the_users_own_store_calls_between_backward_and_step_wait_for_the_launcher(
        comm, shard, monkeypatch):
    """A sum of the user's on the store given to the Trainer (a loss to log) while the
    launcher may still be agreeing buckets: it comes after them on every rank, right,
    and the steps equal those of a Trainer without the user's calls."""
    import time

    import numpy as np
    nets = []
    made = torch_pieces.record(monkeypatch)
    for user_calls in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
        kv = mpikv.create("dist_sync", timeout=TEST_TIMEOUT, autotune=False)
        trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.01}, kv,
                                      bucket_bytes=512, shard=shard)
        assert len(made[-1].wiring.buckets) > 4
        for step in range(6):
            trainer.zero_grad()
            if comm.rank == comm.size - 1:
                time.sleep(0.01)   # the last rank late: the others' buckets still agree
            torch.manual_seed(100 * step + comm.rank)
            net(torch.randn(4, 16)).pow(2).mean().backward()
            if user_calls:
                loss = np.array([step + comm.rank], np.float64)
                kv.allreduce_(loss, tag="loss")
                assert loss[0] == comm.size * step + comm.size * (comm.size - 1) // 2
            trainer.step()
        trainer.close()
        kv.close()
        nets.append(net)
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)
