"""One case of tests/ddp_traps.py as a whole job: ``python ddp_trap.py NAME``, the
port's script on the MPI ranks with its own torch process group."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the clone: tests/

import torch.distributed as dist  # noqa: E402

import mpikv.torch  # noqa: E402
from tests import ddp_traps as traps  # noqa: E402


def main(name):
    trap = traps.BY_NAME[name]
    mpikv.torch.init_process_group("gloo")
    traps.script(trap, traps.port_api(trap), mpikv.torch.rank(), mpikv.torch.size(), dist)
    print(f"rank {mpikv.torch.rank()}: finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
