"""The "mpikv" torch.distributed backend in whole jobs: a rank that never comes to a
collective ends the job with the store's timeout message, not a silent wait."""

import functools

import pytest

from .conftest import run_job, started_together

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/pg_absent_rank.py"


RANKS = [2, 3]


@pytest.fixture(scope="module")
def jobs():
    """The jobs at each number of ranks, started together: each waits out the timeout.
    MPIKV_TIMEOUT=5: the limit the message names; the job's own bound (300 s) only
    tells an ended job from a hung one."""
    return started_together({n: functools.partial(run_job, n, SCRIPT,
                                                  env={"MPIKV_TIMEOUT": "5"})
                             for n in RANKS})


@pytest.mark.parametrize("n", RANKS)
def test_a_rank_that_never_comes_ends_the_job_naming_the_collective(jobs, n):
    rc, out, seconds = jobs[n].result()
    assert rc not in (0, 5, 124), out
    assert ("torch.distributed allreduce on the mpikv process group did not complete "
            "within 5 s") in out, out
    # The flight recorder names the call each waiting rank is in.
    assert "call 2: allreduce (no keys), waiting for the other ranks to agree" in out, out
    assert "unreachable" not in out
    assert f"rank {n - 1}: left the loop" in out
