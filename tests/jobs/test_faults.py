"""No hang, ever: a job with a failing or stuck rank ends, non-zero, within a bound."""

import pytest

from .conftest import run_job

SCRIPT = "tests/jobs/scripts/fault.py"
# Start-up is about 1 s a job here; a hang would hit run_job's own timeout (124).
BOUND = 45


def ended_early(n, *args):
    """Runs the fault script on ``n`` ranks; asserts the job failed on its own within BOUND.

    Returns:
        The job's output.
    """
    rc, out, seconds = run_job(n, SCRIPT, *args)
    assert rc not in (0, 124), out
    assert seconds < BOUND, out
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_exception_on_one_rank_aborts_the_job(n):
    out = ended_early(n, "exception", "60")
    last = n - 1
    assert f"uncaught RuntimeError on rank {last} of {n}" in out
    assert f"[rank {last}] RuntimeError: boom on purpose" in out
    assert f'[rank {last}]   File' in out  # the traceback itself
    assert "finished" not in out


def test_stuck_rank_is_named_after_the_timeout():
    out = ended_early(3, "stuck", "2")
    assert "push (keys 'b', 'w') did not start within 2 s; rank(s) 2 did not arrive" in out


def test_stuck_root_is_reported_by_the_others():
    out = ended_early(2, "stuck_root", "2")
    assert "rank 1: push (keys 'b', 'w') did not start within 2 s; rank(s) 0 did not arrive" in out


def test_rank_stuck_inside_a_collective_hits_the_watchdog():
    out = ended_early(2, "stuck_in_data", "2")
    assert "rank 0: push (keys 'b', 'w') did not complete within 2 s" in out


def test_updater_exception_ends_the_job():
    out = ended_early(2, "updater_raises", "60")
    assert "the update of key" in out and "ValueError: bad update of" in out


def test_uncaught_mpikv_error_ends_the_job_with_every_ranks_traceback():
    out = ended_early(2, "mpikv_error", "60")
    assert "ShapeError" in out and "nothing was applied" in out


def test_healthy_job_finishes():
    rc, out, _ = run_job(3, SCRIPT, "none", "60")
    assert rc == 0, out
    assert out.count("finished with [3.0, 3.0, 3.0]") == 3


@pytest.mark.parametrize("n", [2, 3])
def test_exit_with_shared_memory_windows_does_not_hang(n):
    # Freeing a window is collective: every rank must free them in the same order.
    rc, out, seconds = run_job(n, "tests/jobs/scripts/shm_exit.py", timeout=60)
    assert rc == 0, out
    assert out.count("done") == n
