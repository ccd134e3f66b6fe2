"""A Trainer run saved on N ranks resumes on M ranks exactly like a run that never stopped."""

import numpy as np
import pytest

from .conftest import read_npz, run_job

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/trainer_resume.py"
#: (ranks, shard) of each job of the chain: each loads its predecessor's checkpoint,
#: makes one step and saves (the last does not). Every pair of neighbours is a resume on another number of
#: ranks and level; the checkpoint holds the owners' parts whatever the level, and
#: shard="none" (replicas of the owners' state) writes and reads the same format
#: (averaging modes: a power of 2 ranks, see the script). One job per resume, not two.
CHAIN = [(4, "parameters"), (2, "optimizer"), (4, "none"), (2, "gradients"),
         (3, "gradients"), (1, "parameters")]
STEPS = len(CHAIN)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights after each step of a run that never stopped: {step: weights}."""
    each = tmp_path_factory.mktemp("full")
    rc, log, _ = run_job(2, SCRIPT, "0", str(STEPS), "--out-each", str(each))
    assert rc == 0, log
    return {step: read_npz(each / f"{step}.npz") for step in range(1, STEPS + 1)}


def test_trainer_resumes_on_another_number_of_ranks_and_level(tmp_path, uninterrupted):
    """Saved with one level on N ranks, resumed with another on M ranks: bit for bit,
    after every resume of the chain."""
    for step, (ranks, shard) in enumerate(CHAIN):
        load = ["--load", str(tmp_path / f"ck{step - 1}")] if step else []
        save = ["--save", str(tmp_path / f"ck{step}")] if step + 1 < STEPS else []
        out = tmp_path / f"w{step + 1}.npz"
        rc, log, _ = run_job(ranks, SCRIPT, str(step), str(step + 1), *load, *save,
                             "--out", str(out), "--shard", shard)
        was = f"step {step + 1} on {ranks} rank(s), shard={shard!r}" + (
            f", from {CHAIN[step - 1]}" if step else "")
        assert rc == 0, f"{was}\n{log}"
        got, want = read_npz(out), uninterrupted[step + 1]
        assert sorted(got) == sorted(want), was
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key}: {was}")
    assert got["lr"] == 0.01 * 0.5 ** (STEPS // 2)  # the scheduler resumed too
