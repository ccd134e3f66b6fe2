"""A Trainer checkpoint is one commit: saved twice to one path, with a rank killed
between any two files of the second save, it loads as all of the first save or
all of the second (weights, buffers, update count, learning rate), never a mix."""

import re

import numpy as np
import pytest

from .conftest import read_npz, run_job

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/trainer_torn_save.py"


def _which(got, a, b):
    """"a" or "b" when ``got`` is all of that save, else what is mixed."""
    assert sorted(got) == sorted(a) == sorted(b)
    for name, want in (("a", a), ("b", b)):
        if all(np.array_equal(got[k], want[k]) for k in want):
            return name
    return {k: [np.array_equal(got[k], a[k]), np.array_equal(got[k], b[k])] for k in got}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_save_killed_between_any_two_files_loads_all_of_one_save(tmp_path, rank):
    runs = []
    for nth in range(1, 20):
        run = tmp_path / f"kill-{nth}"
        run.mkdir()
        rc, log, _ = run_job(2, SCRIPT, "save", str(run / "ck"), str(run), str(rank), str(nth))
        done = re.search(r"renames=(\d+)", log)
        assert (rc == 0) == bool(done), log
        runs.append(run)
        if done:
            break
    else:
        pytest.fail("the save never ended")
    # One job loads every kill's checkpoint, each into a new store, model and Trainer.
    rc, log, _ = run_job(2, SCRIPT, "load",
                         *(str(p) for run in runs for p in (run / "ck", run / "got.npz")))
    assert rc == 0, f"a load failed (the last 'loading' line names it)\n{log}"
    outcomes = []
    for nth, run in enumerate(runs, 1):
        a, b = read_npz(run / "a.npz"), read_npz(run / "b.npz")
        assert a["num_update"] == 2 and b["num_update"] == 4 and a["lr"] != b["lr"]
        outcomes.append(_which(read_npz(run / "got.npz"), a, b))
        assert outcomes[-1] in ("a", "b"), (f"killed before rename {nth} of rank {rank}",
                                            outcomes[-1])
    # The first save until the commit, the second from it on.
    assert outcomes[0] == "a" and outcomes[-1] == "b", outcomes
    assert outcomes == sorted(outcomes), outcomes
    if rank == 0:   # (rank 0 commits: a kill after its commit, before its last file)
        assert outcomes[-2] == "b", outcomes
