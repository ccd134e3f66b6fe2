"""The DDP drop-in's table (tests/ddp_traps.py), its cases that are whole jobs: the
ported tutorial (examples/ddp_tutorial/ported.py) started by torchrun is the same
clear error in each process that starts before torchrun ends the others, instead of
N one-rank trainings; a script whose job must end (uneven data meeting a
torch.distributed call) ends within the store's timeout, saying what to do."""

import functools
import os
import socket
import sys

import pytest

from .. import ddp_traps as traps
from .conftest import ROOT, launch, run_job, started_together

pytest.importorskip("torch")

PORTED = ROOT / "examples" / "ddp_tutorial" / "ported.py"
TORCHRUN_TRAPS = [t for t in traps.TRAPS if t.launch == "torchrun"]
JOB_TRAPS = [t for t in traps.TRAPS if t.launch == "job"]
SCRIPT = "tests/jobs/scripts/ddp_trap.py"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("trap", TORCHRUN_TRAPS, ids=lambda t: t.name)
def test_a_torchrun_launch_is_one_error_in_every_process(trap, n, tmp_path):
    import re
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cmd = ["timeout", "-k", "5", "180", sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--log-dir", str(tmp_path / "logs"), "--tee", "3", str(PORTED),
           str(tmp_path / "weights.pt")]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    rc, out = launch(cmd, env)
    assert rc not in (0, 124, 137), out   # failed, and not by the timeout
    pattern = re.compile(trap.match.replace("{n}", str(n)))
    said = [line for line in out.splitlines() if f"{trap.error.__name__}:" in line]
    assert said and all(pattern.search(line) for line in said), out
    # Each process raises as soon as it starts; but torchrun ends the others (SIGTERM)
    # once one has failed, and under load a process may still be importing torch then.
    # So: at least one process said it, each that said it said it once, none trained.
    ranks = [m.group(1) for m in re.finditer(
        r"\[default(\d+)\]:[\w.]*" + trap.error.__name__ + ":", out)]
    assert ranks and len(ranks) == len(set(ranks)) <= n, out
    assert set(ranks) <= {str(r) for r in range(n)}, out
    assert "Start running basic DDP example" not in out   # no rank trained alone
    assert not (tmp_path / "weights.pt").exists()


@pytest.fixture(scope="module")
def trap_jobs():
    """Every job trap at 2 and 3 ranks, started together: each waits out its timeout."""
    return started_together({(trap.name, n): functools.partial(
        run_job, n, SCRIPT, trap.name, timeout=300,
        env={"MPIKV_TIMEOUT": str(trap.job_timeout), "OMP_NUM_THREADS": "1",
             "GLOO_SOCKET_IFNAME": "lo"}) for trap in JOB_TRAPS for n in (2, 3)})


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("trap", JOB_TRAPS, ids=lambda t: t.name)
def test_a_job_that_must_end_ends_with_what_to_do(trap_jobs, trap, n):
    import re
    rc, out, _ = trap_jobs[trap.name, n].result()
    assert rc not in (0, 124, 137), out   # ended by mpikv, not by the test's timeout
    assert re.search(trap.match.replace("{n}", str(n)).replace("{last}", str(n - 1)), out), out
    assert "finished" not in out
