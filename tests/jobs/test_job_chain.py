"""A run as a chain of jobs (``trainer.resume``): stopped by signals on some rank,
resumed on other rank counts, it ends with the weights of a run that never stopped."""

import numpy as np
import pytest

from .conftest import read_npz, run_job

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/chain.py"
LAST = 10


def test_a_chain_of_jobs_ends_with_the_uninterrupted_weights(tmp_path):
    rc, log, _ = run_job(2, SCRIPT, str(tmp_path / "straight"), str(LAST),
                         "--out", str(tmp_path / "straight.npz"))
    assert rc == 0, log
    chain = str(tmp_path / "chain")
    # A warning signal on the last rank of 2 (SLURM's USR1), before step 4.
    rc, log, _ = run_job(2, SCRIPT, chain, str(LAST), "--signal", "SIGUSR1", "--at", "4",
                         "--rank", "1")
    assert rc != 0 and "stopped after step 5 (a signal)" in log, log
    # A preemption's SIGTERM on rank 0 of 3, before step 7 (the job resumed at 5).
    rc, log, _ = run_job(3, SCRIPT, chain, str(LAST), "--signal", "SIGTERM", "--at", "7")
    assert rc != 0 and "from step 5" in log and "stopped after step 8 (a signal)" in log, log
    # The rest on one rank.
    rc, log, _ = run_job(1, SCRIPT, chain, str(LAST), "--out", str(tmp_path / "chain.npz"))
    assert rc == 0 and "from step 8" in log, log
    # Step 9's checkpoint, written in the background, was committed as the job's
    # processes ended (no trainer.close() in the script).
    from mpikv.torch import resume
    assert [s for s, _ in resume.newest_first(chain)] == [9, 8, 6]
    want, got = read_npz(tmp_path / "straight.npz"), read_npz(tmp_path / "chain.npz")
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
