"""Lost ranks across two hosts (issue 28): network namespaces h1, h2 with 2 ranks each
(scripts/cluster.sh run --ft: TCP between the hosts, shared memory inside each).

SIGKILLed ranks on either host, a host's two ranks at once, rank 0 then a rank of
the other host: the survivors go on with the exact result (the jobs' own checks, as
in tests/jobs/test_elastic_store.py and test_elastic_trainer.py). A lost host
daemon (``prted``) ends the whole job, cleanly: PRRTE in the Open MPI 5.0.11 wheel
does not run through daemon failures (docs/fault-tolerance.md).
"""

import re
import uuid

import pytest

from ..jobs.conftest import KILL_DETECTOR
from ..jobs.test_rank_lost import leftovers
from .conftest import CLUSTER, job_env, run
from .test_cluster import cluster  # noqa: F401 (the fixture: down before and after)

STORE = "tests/jobs/scripts/elastic_store.py"
TRAIN = "tests/jobs/scripts/elastic_train.py"


def job(script, directory, kills, redundancy, **env):
    """One 4-rank job over h1, h2: its output, once it ended (not hung) and left nothing.

    The ranks die by SIGKILL, which their daemon reports at once: the failure
    detector's timeout is the jobs' long one, so that a live rank of a loaded
    machine is not taken for dead (at 2 s one was, during ``set_optimizer``).
    """
    env = {"MPIKV_FT_DETECTOR_TIMEOUT": str(KILL_DETECTOR), **env}
    token = f"mpikv-ft-{uuid.uuid4().hex[:12]}"
    rc, out, seconds = run([CLUSTER, "run", "--ranks-per-host", "2", "--timeout", "90", "--ft",
                            "--", "python", script, directory, kills, "1", token, redundancy],
                           timeout=120, env=job_env(MPIKV_AUTOTUNE="0", **env))
    assert rc != 124, f"the job hung ({seconds:.0f} s):\n{out}"
    assert leftovers(token) == [], out
    assert "Traceback" not in out, out
    return rc, out


def finished(out, pattern, ranks):
    """The survivors (their first ranks) that say they finished exactly."""
    done = re.findall(pattern, out)
    assert sorted(int(d[0]) for d in done) == ranks, out
    assert all(float(d[-1]) <= 1e-10 for d in done), out


@pytest.mark.parametrize("dead, redundancy, step", [
    (2, "memory", 7),        # a rank of h2: no step lost
    (1, "checkpoint", 6),    # a rank of h1 (rank 0's host): back to the checkpoint of 6
])
def test_kv_run_goes_on_after_a_rank_of_either_host_is_killed(cluster, tmp_path,  # noqa: F811
                                                              dead, redundancy, step):
    cluster("up", "--hosts", "2")
    _, out = job(STORE, tmp_path / "ckpt", f"{dead}@7", redundancy)
    assert len(re.findall(rf"kv.run: lost rank {dead} of 4; going on from step {step} on "
                          rf"3 ranks", out)) == 3, out
    finished(out, r"rank (\d): finished on 3 workers as rank \d; max difference ([\d.e+-]+)",
             [r for r in range(4) if r != dead])


def test_trainer_run_survives_rank_0_then_a_rank_of_the_other_host(cluster,  # noqa: F811
                                                                     tmp_path):
    cluster("up", "--hosts", "2")
    _, out = job(TRAIN, tmp_path / "ckpt", "0@3,2@10", "memory")
    assert len(re.findall(r"trainer.run: lost rank 0 of 4; going on from step 3 on 3 ranks",
                          out)) == 3, out
    assert len(re.findall(r"trainer.run: lost rank 1 \(world 2\) of 3; going on from step 10 "
                          r"on 2 ranks", out)) == 2, out
    finished(out, r"rank (\d): finished 14 updates on 2 workers as rank \d; "
                  r"max difference ([\d.e+-]+)", [1, 3])


def test_trainer_run_survives_both_ranks_of_a_host(cluster, tmp_path):  # noqa: F811
    # Ranks 2 and 3 (all of h2, its daemon left running, as after the OOM killer):
    # rank 2's buddy is rank 3, so the two left go back to the newest checkpoint.
    cluster("up", "--hosts", "2")
    _, out = job(TRAIN, tmp_path / "ckpt", "2@7,3@7", "memory")
    back = re.findall(r"trainer.run: lost ranks? [\d, ]+ of [34]; going on from step (\d+) "
                      r"on 2 ranks", out)
    assert len(back) == 2 and back[0] == back[1] and back[0] in ("3", "6"), out
    finished(out, r"rank (\d): finished 14 updates on 2 workers as rank \d; "
                  r"max difference ([\d.e+-]+)", [0, 1])


def test_a_lost_host_daemon_ends_the_job_cleanly(cluster, tmp_path):  # noqa: F811
    # Rank 2 kills its host's daemon (prted on h2) and itself: PRRTE ends the job.
    cluster("up", "--hosts", "2")
    _, out = job(TRAIN, tmp_path / "ckpt", "2@7", "memory", KILL_PARENT="1")
    # PRRTE names the lost daemon one of two ways, as its own timing falls (both seen).
    assert ("PRTE has lost communication with a remote daemon" in out
            or "A daemon failed to report back" in out), out
    assert "finished" not in out, out
