"""trainer.run with ``sync=DiLoCo(every=2)`` over a killed rank; run by
tests/jobs/test_diloco_lost_rank.py under ``scripts/mpirun.sh --ft -n 3``.

Usage: diloco_train.py DIR TOKEN

``trainer.resume(DIR, every=2)``: a checkpoint at each sync. The rank that was 2
at the start kills itself (SIGKILL) in step 5, in the middle of the window after
the sync of step 4: the survivors go back to that sync, on 2 ranks, and each
compares its final weights with one process that simulates 3 ranks up to the
sync of step 4 and 2 ranks after it. TOKEN is ignored (it marks the processes).
"""

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository: tests.mpi

import mpikv.torch  # noqa: E402
from mpikv.torch import DiLoCo  # noqa: E402
from tests.mpi.test_diloco import (assert_close, batch, diloco_reference,  # noqa: E402
                                   loss_of, make_net, weights)

STEPS, EVERY, KILLED, KILLED_IN = 12, 2, 2, 5


def main():
    directory = sys.argv[1]
    first_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    net = make_net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1},
                                  sync=DiLoCo(every=EVERY), fault_tolerant=True)
    trainer.resume(directory, every=EVERY, background=False)

    def step(i):
        trainer.zero_grad()
        if first_rank == KILLED and i == KILLED_IN:
            print(f"rank {first_rank}: dying in step {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss_of(net, *batch(i, trainer.rank)).backward()
        trainer.step()

    done = trainer.run(step, STEPS)
    got, ranks = weights(net), trainer.num_workers
    trainer.close()
    _, want = diloco_reference(3, EVERY, 0.7, 0.9, STEPS, switch=(4, 2))
    assert_close(got, want)
    print(f"rank {first_rank}: finished {done} updates on {ranks} workers, "
          f"equal to the reference", flush=True)


if __name__ == "__main__":
    main()
