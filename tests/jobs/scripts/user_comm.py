"""A user's own messages on COMM_WORLD beside the flight-recorder exchange;
tests/jobs/test_flight_comm.py runs it.

Rank 1 sends rank 0 a message with the exchange's tag (32011), then ends the
job with an uncaught exception, which asks every rank for its last call, while
rank 0 has a receive of any source and any tag posted on ``COMM_WORLD``. Each
message rank 0's user code receives is printed: only its own may come.

Usage: user_comm.py
"""

import threading

import numpy as np
from mpi4py import MPI

import mpikv

TAG = 32011   # the flight recorder's request tag


def main():
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    kv = mpikv.create("dist_sync", timeout=120)
    kv.init("w", np.zeros(3))
    if rank == 1:
        world.send(("user", "before the barrier"), dest=0, tag=TAG)
    kv.barrier()
    if rank == 0:
        got = world.recv(source=1, tag=TAG)
        print(f"rank 0: user received {got!r} with tag {TAG}", flush=True)
        status = MPI.Status()
        request = world.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)

        def receive():
            got = request.wait(status=status)
            print(f"rank 0: user received {got!r} with tag {status.Get_tag()}", flush=True)
        threading.Thread(target=receive, daemon=True).start()
    kv.barrier()   # rank 0's receive of any tag is posted
    if rank == 1:
        raise RuntimeError("boom on purpose")
    kv.push("w", np.ones(3))   # waits: rank 1 ends the job


if __name__ == "__main__":
    main()
