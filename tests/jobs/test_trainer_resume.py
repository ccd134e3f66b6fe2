"""A Trainer run saved on N ranks resumes on M ranks exactly like a run that never stopped."""

import numpy as np
import pytest

from .conftest import run_job

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/trainer_resume.py"
STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "w.npz"
    rc, log, _ = run_job(2, SCRIPT, "0", str(STEPS), "--out", str(out))
    assert rc == 0, log
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("before,after", [
    ((2, "gradients"), (3, "gradients")),
    # The checkpoint holds the owners' parts whatever the level of sharding.
    ((4, "parameters"), (2, "optimizer")),
    ((3, "gradients"), (1, "parameters")),
    # shard="none" (replicas of the owners' state) writes and reads the same format
    ((2, "optimizer"), (4, "none")),   # (averaging modes: a power of 2 ranks, see the script)
    ((4, "none"), (2, "gradients")),
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_trainer_resumes_on_another_number_of_ranks_and_level(tmp_path, uninterrupted, before,
                                                              after):
    """Saved with one level on N ranks, resumed with another on M ranks: bit for bit."""
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "w.npz"
    rc, log, _ = run_job(before[0], SCRIPT, "0", "3", "--save", ckpt, "--shard", before[1])
    assert rc == 0, log
    rc, log, _ = run_job(after[0], SCRIPT, "3", str(STEPS), "--load", ckpt, "--out", str(out),
                         "--shard", after[1])
    assert rc == 0, log
    with np.load(out) as f:
        got = {k: f[k] for k in f.files}
    assert sorted(got) == sorted(uninterrupted)
    for key, want in uninterrupted.items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)
    assert got["lr"] == 0.01 * 0.5 ** (STEPS // 2)  # the scheduler resumed too
