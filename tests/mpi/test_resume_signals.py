"""trainer.resume's signals at 1-4 ranks: ranks that get a signal at different steps
(or one rank only) all stop at the first step boundary after the first signal,
after one complete checkpoint."""

import os
import signal

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.torch import resume  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402


pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("who", ["every-rank-at-its-own-step"])
def test_signals_stop_every_rank_after_one_checkpoint(make_store, comm, tmp_path_factory, who):
    directory = comm.bcast(str(tmp_path_factory.mktemp("chain")) if comm.rank == 0 else None)
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  make_store())
    assert trainer.resume(directory) == 0
    # Rank r is signalled before step 2 + r (or only the last rank, before step 2).
    at = {r: 2 + r for r in range(comm.size)} if who.startswith("every") \
        else {comm.size - 1: 2}
    per = cases.GLOBAL_BATCH // comm.size
    with pytest.raises(SystemExit) as ended:
        for step in range(10):
            if at.get(comm.rank) == step:
                os.kill(os.getpid(), signal.SIGUSR1)
            trainer.zero_grad()
            x, y = cases.data(step, 0)
            torch.nn.functional.mse_loss(net(x[comm.rank * per:(comm.rank + 1) * per], False),
                                         y[comm.rank * per:(comm.rank + 1) * per]).backward()
            trainer.step()
    assert ended.value.code == resume.EXIT_STATUS
    assert trainer.num_update == 3   # the signal before step 2 stops after update 3
    assert comm.allgather(trainer.num_update) == [3] * comm.size
    comm.barrier()
    assert [s for s, _ in resume.newest_first(directory)] == [3]
    trainer.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL   # given back at the stop
    trainer.kvstore.close()
