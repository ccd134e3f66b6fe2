"""The "mpikv" torch.distributed backend in whole jobs: a rank that never comes to a
collective ends the job with the store's timeout message, not a silent wait."""

import pytest

from .conftest import run_job

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/pg_absent_rank.py"


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_never_comes_ends_the_job_naming_the_collective(n):
    # MPIKV_TIMEOUT=5: the limit the message names; the job's own bound (300 s) only
    # tells an ended job from a hung one.
    rc, out, seconds = run_job(n, SCRIPT, env={"MPIKV_TIMEOUT": "5"})
    assert rc not in (0, 5, 124), out
    assert ("torch.distributed allreduce on the mpikv process group did not complete "
            "within 5 s") in out, out
    # The flight recorder names the call each waiting rank is in.
    assert "call 2: allreduce (no keys), waiting for the other ranks to agree" in out, out
    assert "unreachable" not in out
    assert f"rank {n - 1}: left the loop" in out
