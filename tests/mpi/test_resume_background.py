"""trainer.resume's background checkpoints at 1-4 ranks: each holds the weights of
its step although training went on while it was written, and becomes complete only
at the first step boundary after every rank's part is on disk (issue 24)."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv import statefile  # noqa: E402
from mpikv.torch import resume  # noqa: E402
from tests import torch_pieces  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402

from .conftest import TEST_TIMEOUT  # noqa: E402

pytestmark = pytest.mark.mpi


def _trainer(make_store):
    net = cases.Net()
    return net, mpikv.torch.Trainer(net, torch.optim.Adam, {"lr": 0.01},
                                    make_store())


def _train_step(net, trainer, comm, step):
    per = cases.GLOBAL_BATCH // comm.size
    trainer.zero_grad()
    x, y = cases.data(step, 0)
    torch.nn.functional.mse_loss(net(x[comm.rank * per:(comm.rank + 1) * per], False),
                                 y[comm.rank * per:(comm.rank + 1) * per]).backward()
    trainer.step()


def _written(pieces):
    """Waits until this rank's part of the checkpoint being written is on disk."""
    deadline = time.monotonic() + TEST_TIMEOUT
    while not pieces.update.resumer.written():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_background_checkpoints_hold_their_step_and_commit_once_every_rank_wrote(make_store,
        comm, tmp_path_factory, monkeypatch):
    directory = comm.bcast(str(tmp_path_factory.mktemp("bg")) if comm.rank == 0 else None)
    gate = threading.Event()
    if comm.rank == comm.size - 1:   # this rank's first write waits for the gate
        write_part = statefile.write_part

        def held(*args):
            assert gate.wait(TEST_TIMEOUT)
            return write_part(*args)
        monkeypatch.setattr(statefile, "write_part", held)
    made = torch_pieces.record(monkeypatch)
    net, trainer = _trainer(make_store)
    assert trainer.resume(directory, every=3, keep=5) == 0
    weights = {}
    for step in range(10):
        if step == 5:   # step 3's checkpoint was held for two steps
            assert resume.newest_first(directory) == []
            gate.set()
            _written(made[-1])
        _train_step(net, trainer, comm, step)
        weights[trainer.num_update] = [p.detach().clone() for p in net.parameters()]
        complete = [s for s, _ in resume.newest_first(directory)]
        # committed at the start of step 6: the status of step 5 said "all written"
        assert complete == ([] if step < 6 else [3] if step < 7 else complete)
    trainer.close()   # commits the last one (step 9)
    assert [s for s, _ in resume.newest_first(directory)] == [9, 6, 3]
    trainer.kvstore.close()
    for step in (3, 6, 9):
        fresh_net, fresh = _trainer(make_store)
        fresh.load_checkpoint(f"{directory}/{resume.name_of(step)}")
        assert fresh.num_update == step
        for got, want in zip(fresh_net.parameters(), weights[step]):
            assert torch.equal(got.detach(), want)
        fresh.close()
        fresh.kvstore.close()


def test_a_signal_while_a_checkpoint_is_written_commits_it_then_saves_its_own(make_store,
        comm, tmp_path_factory):
    import os
    import signal
    directory = comm.bcast(str(tmp_path_factory.mktemp("bgsig")) if comm.rank == 0 else None)
    net, trainer = _trainer(make_store)
    trainer.resume(directory, every=2, keep=5)
    with pytest.raises(SystemExit) as ended:
        for step in range(10):
            if step == 2 and comm.rank == 0:   # step 2's checkpoint is being written
                os.kill(os.getpid(), signal.SIGUSR1)
            _train_step(net, trainer, comm, step)
    assert ended.value.code == resume.EXIT_STATUS
    assert comm.allgather(trainer.num_update) == [3] * comm.size
    comm.barrier()
    assert [s for s, _ in resume.newest_first(directory)] == [3, 2]
    trainer.close()
    trainer.kvstore.close()
