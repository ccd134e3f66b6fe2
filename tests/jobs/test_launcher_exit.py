"""A process that ends with bucket calls still queued on its Trainer's launcher
(issue 26, item 7) neither hangs nor deadlocks: the launcher makes them before
the store's exit call, under the default settings (a 600 s timeout)."""

import pytest

from .conftest import run_with_defaults
from .test_uneven_calls import BOUND

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/queued_at_exit.py"


def run(n, case, odd):
    """Runs the script on ``n`` ranks; returns (returncode, stdout, stderr, seconds)."""
    return run_with_defaults(n, SCRIPT, case, odd, label="queued")


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
