"""No hang, ever: a job with a failing or stuck rank ends, non-zero, within a bound."""

import subprocess
import sys

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


def test_a_stuck_rank_every_rank_shows_its_last_calls():
    out = ended_early(3, "stuck", "2")
    # Every rank printed its ring, the ranks still in a call and the stuck one.
    for rank in range(3):
        calls = "1 call" if rank == 2 else "2 calls"
        assert f"[rank {rank}] mpikv flight recorder: last {calls}, oldest first" in out, out
        assert f"[rank {rank}]   store 0 call 1: init (keys 'b', 'w'; 2 keys, 48 B)" in out
    assert "[rank 2]   store 0 call 2" not in out
    # The ending rank names each rank's last call.
    assert "mpikv: the last call of each rank (flight recorders printed" in out
    for rank in (0, 1):
        assert (f"  rank {rank}: store 0 call 2: push (keys 'b', 'w'; 2 keys, 48 B), "
                f"waiting for the other ranks to agree for") in out, out
    assert "  rank 2: store 0 call 1: init (keys 'b', 'w'; 2 keys, 48 B), done; " \
           "in no mpikv call since, for" in out, out


def test_a_rank_in_another_call_is_named_and_mpikv_trace_merges_the_rings(tmp_path):
    trace = tmp_path / "trace"
    rc, out, seconds = run_job(3, SCRIPT, "other_store", "2", env={"MPIKV_TRACE_DIR": str(trace)})
    assert rc not in (0, 124) and seconds < BOUND, out
    for rank in range(3):
        assert f"[rank {rank}] mpikv: flight recorder written to {trace}/rank-{rank}.json" in out
    assert "  rank 1: store 1 call 1: barrier (no keys), waiting for the other ranks" in out, out
    assert "  rank 0: store 0 call 3: push (keys 'b', 'w'; 2 keys, 48 B), waiting" in out, out
    assert sorted(p.name for p in trace.iterdir()) == ["rank-0.json", "rank-1.json",
                                                      "rank-2.json"]
    merged = subprocess.run([sys.executable, "-m", "mpikv", "trace", str(trace)],
                            capture_output=True, text=True, check=True).stdout
    assert "mpikv trace: 3 rank(s): 0, 1, 2" in merged
    assert "first call the ranks differ on: store 0 call 3" in merged
    block = merged.split("store 0 call 3   <-- ranks differ\n", 1)[1].split("\nstore", 1)[0]
    assert block.splitlines() == [
        "  rank 0: push (keys 'b', 'w'; 2 keys, 48 B), "
        + block.splitlines()[0].split("48 B), ", 1)[1],
        "  rank 1: -- (not made)",
        "  rank 2: push (keys 'b', 'w'; 2 keys, 48 B), "
        + block.splitlines()[2].split("48 B), ", 1)[1]]
    assert "waiting for the other ranks to agree" in block
    assert "store 1 call 1   <-- ranks differ\n  rank 0: -- (not made)\n" \
           "  rank 1: barrier (no keys), waiting for the other ranks to agree" in merged


def test_an_uncaught_exception_shows_every_ranks_ring():
    out = ended_early(2, "exception", "60")
    assert "[rank 0] mpikv flight recorder: last 2 calls, oldest first" in out, out
    assert "[rank 1] mpikv flight recorder: last 1 call, oldest first" in out, out
    assert "  rank 0: store 0 call 2: push (keys 'b', 'w'; 2 keys, 48 B), waiting for the " \
           "other ranks to agree" in out
    assert "  rank 1: store 0 call 1: init (keys 'b', 'w'; 2 keys, 48 B), done; in no mpikv " \
           "call since" in out
