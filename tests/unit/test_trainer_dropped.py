"""A Trainer dropped without ``close()``: once collected, its launcher thread ends
and its hooks do nothing; the model trains on as a plain torch model."""

import gc
import threading
import time
import weakref

import pytest

torch = pytest.importorskip("torch")

import mpikv.torch  # noqa: E402
from mpikv.torch import _store  # noqa: E402
from mpikv.torch.launcher import Launcher  # noqa: E402
from tests import torch_pieces  # noqa: E402

#: the name of the launcher's thread (mpikv/torch/launcher.py)
LAUNCHER_THREAD = "mpikv-launcher"


def _launcher_threads():
    return [t for t in threading.enumerate() if t.name == LAUNCHER_THREAD and t.is_alive()]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _plain_sgd_step(model, x, lr=0.1):
    """One plain torch SGD step (no Trainer); returns the gradients it used."""
    model.zero_grad()
    model(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return grads


@pytest.fixture
def threaded_launcher(monkeypatch):
    """A launcher with its thread on a one-process local store: alone, a rank makes
    the calls inline (launcher_for), and there would be no thread to watch end. The
    launcher serialises the store's calls either way, so the local store takes them.
    Gives the list of the Trainers' pieces, as made."""
    monkeypatch.setattr(_store, "launcher_for",
                        lambda kv, on_gpu: Launcher(True, kv.options["abort_on_exception"]))
    return torch_pieces.record(monkeypatch)


def test_a_dropped_trainer_ends_its_launcher_thread_and_leaves_a_plain_model(threaded_launcher):
    before = len(_launcher_threads())
    model = _model()
    trainer = mpikv.torch.Trainer(model, torch.optim.SGD, {"lr": 0.1})
    x = torch.randn(6, 8)
    model(x).square().sum().backward()   # the buckets leave through the launcher's thread
    trainer.step()
    threads = _launcher_threads()
    assert len(threads) == before + 1
    ours = [t for t in threads if t is threaded_launcher[-1].context.launcher.thread]
    assert len(ours) == 1
    threaded_launcher.clear()   # (the pieces this test looked at: dropped too)
    dropped = weakref.ref(trainer)

    del trainer
    gc.collect()

    assert dropped() is None
    ours[0].join(timeout=30)   # the finalizer queued the thread's end: it ends on its own
    assert not ours[0].is_alive()
    assert len(_launcher_threads()) == before

    # The model trains on as a plain one: the hooks left on its parameters do
    # nothing, and a step gives what the same step gives on a copy never trained
    # by a Trainer.
    reference = _model()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(6, 8)
    got = _plain_sgd_step(model, x)
    want = _plain_sgd_step(reference, x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    # A second backward accumulates on the first gradients, as torch's own do.
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_trainer_in_use_keeps_its_hooks_through_a_collection(threaded_launcher):
    """Only a dropped Trainer is let go: one still referenced reduces its buckets
    through its launcher after a collection as before it."""
    model = _model()
    trainer = mpikv.torch.Trainer(model, torch.optim.SGD, {"lr": 0.1})
    pieces = threaded_launcher[-1]
    launched = []
    launch = pieces.reduction.launch

    def traced(b):
        launched.append(b)
        return launch(b)
    pieces.reduction.launch = traced
    gc.collect()
    x = torch.randn(6, 8)
    reference = _model()
    model(x).square().sum().backward()
    trainer.step()
    assert sorted(launched) == list(range(len(pieces.wiring.buckets)))
    launcher = pieces.context.launcher
    assert launcher.thread is not None and launcher.thread.is_alive()
    _plain_sgd_step(reference, x)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    thread = launcher.thread
    trainer.close()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread.is_alive()


def test_a_dropped_trainer_no_longer_counts_as_open_for_sync_batchnorm():
    """torch's SyncBatchNorm is refused only while a Trainer is open: one dropped
    without close() must not keep that refusal on for the rest of the process."""
    from mpikv.torch import syncbn
    before = syncbn._OPEN[0]
    trainer = mpikv.torch.Trainer(torch.nn.Linear(2, 2), torch.optim.SGD, {"lr": 0.1}, "local")
    assert syncbn._OPEN[0] == before + 1
    del trainer
    gc.collect()
    assert syncbn._OPEN[0] == before
    closed = mpikv.torch.Trainer(torch.nn.Linear(2, 2), torch.optim.SGD, {"lr": 0.1}, "local")
    closed.close()
    del closed
    gc.collect()
    assert syncbn._OPEN[0] == before   # close() and the collection count once
