"""A process that ends with bucket calls still queued on its Trainer's launcher
(issue 26, item 7) neither hangs nor deadlocks: the launcher makes them before
the store's exit call, under the default settings (a 600 s timeout)."""

import os
import subprocess
import sys
import time
import uuid

import pytest

from .conftest import LAUNCH_FAILED, MPIRUN, ROOT
from .test_uneven_calls import BOUND, _left

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/queued_at_exit.py"


def run(n, case, odd):
    """Runs the script on ``n`` ranks; returns (returncode, stdout, stderr, seconds)."""
    tag = f"mpikv-queued-{uuid.uuid4().hex}"
    cmd = ["timeout", "-k", "5", "120", str(MPIRUN), "-n", str(n), sys.executable, SCRIPT,
           case, str(odd), tag]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MPIKV_") or k == "MPIKV_VENV"}   # the defaults
    env["PYTHONUNBUFFERED"] = "1"
    for attempt in (1, 2):
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        seconds = time.monotonic() - start
        out, err = proc.stdout.replace("\x00", ""), proc.stderr.replace("\x00", "")
        if proc.returncode == 0 or LAUNCH_FAILED not in out + err or attempt == 2:
            break
    assert not _left(tag), f"processes left: {_left(tag)}\n{err}"
    return proc.returncode, out, err, seconds


@pytest.mark.parametrize("n", [3])
def test_ranks_that_end_with_calls_queued_end_well(n):
    rc, out, err, seconds = run(n, "even", 0)
    assert rc == 0, err
    assert "mpikv" not in err, err
    assert sorted(out.splitlines()) == [f"rank {r} finished 3 steps, launcher threaded: True"
                                        for r in range(n)]
    assert seconds < BOUND, (seconds, err)


def test_a_rank_that_ends_with_calls_the_others_never_make_ends_the_job():
    rc, out, err, seconds = run(2, "odd", 1)
    assert rc not in (0, 124), err
    assert seconds < BOUND, (seconds, err)
    # Rank 1's launcher pushes at its exit; rank 0's exit call meets that push.
    assert err.lstrip().splitlines()[0] == (
        "mpikv: MismatchError: rank 0 ended its process after step 3 while rank 1 is in "
        "step 4: the ranks ran different numbers of steps; for uneven data use "
        "trainer.join(); nothing was applied"), err
