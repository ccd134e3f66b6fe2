"""A rank that stops (SIGSTOP) under ``--ft`` (issue 38, class 6): the failure
detector declares it lost, the survivors go on and finish with the exact sum, and
the job ends: a survivor kills the stopped process (on its host), which the
launcher would otherwise wait for forever. (Before, the job hung after the
survivors' last line until ``timeout`` ended it.)

Jobs of ``scripts/mpirun.sh --ft -n 3`` on tests/jobs/scripts/stopped_rank.py,
with the detector's timeout of the other job tests (KILL_DETECTOR), started together."""

import functools
import os
import re
import sys
import uuid

import pytest

from .conftest import KILL_DETECTOR, MPIRUN, launch, started_together
from .test_rank_lost import leftovers

SCRIPT = "tests/jobs/scripts/stopped_rank.py"
#: the limit past which the job counts as hung (not a timing claim)
TIMEOUT = 300


CASES = [(1, "checkpoint"), (0, "memory"), (2, "checkpoint")]


def stopped_job(directory, stopped, redundancy):
    """Runs the job; returns (returncode, output, the processes it left, killed since)."""
    token = f"mpikv-stop-{uuid.uuid4().hex[:12]}"
    cmd = ["timeout", "-k", "5", str(TIMEOUT), str(MPIRUN), "--ft", "-n", "3", sys.executable,
           SCRIPT, str(directory / "ckpt"), f"{stopped}@7", token, redundancy]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_FT_DETECTOR_TIMEOUT=str(KILL_DETECTOR))
    try:
        rc, out = launch(cmd, env)
    finally:
        left = leftovers(token)
        for line in left:   # (the old code leaves the stopped rank behind)
            try:
                os.kill(int(line.split()[0]), 9)
            except (OSError, ValueError):
                pass
    return rc, out, left


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every case's job, started together: each waits out the detector's timeout."""
    return started_together({case: functools.partial(
        stopped_job, tmp_path_factory.mktemp(f"stop{case[0]}"), *case) for case in CASES})


@pytest.mark.parametrize("stopped, redundancy", CASES)
def test_a_stopped_rank_is_lost_and_the_job_ends_with_the_survivors(jobs, stopped, redundancy):
    rc, out, left = jobs[stopped, redundancy].result()
    assert rc != 124, f"the job did not end after its survivors:\n{out}"
    # The survivors' normal end (the stopped rank, killed, has no status).
    assert rc == 0, out
    assert f"rank {stopped}: stopping in step 7 at " in out, out
    assert "Traceback" not in out, out
    alive = [r for r in range(3) if r != stopped]
    for new_rank, r in enumerate(alive):
        said = re.search(rf"^rank {r}: finished on 2 workers as rank {new_rank}; "
                         rf"max difference ([\d.e+-]+)$", out, re.M)
        assert said and float(said.group(1)) <= 1e-10, out   # every batch summed once
        assert re.search(rf"mpikv\[rank {r}/3\] WARNING kv.run: lost rank {stopped} of 3; "
                         rf"going on from step \d+ on 2 ranks", out), out
    assert f"rank {stopped}: finished" not in out, out
    assert left == [], out
