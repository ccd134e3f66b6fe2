"""A preemption's SIGTERM on the real local SLURM cluster (issue 38, class 5):
slurm/job-train-chain.sbatch is signalled as SLURM does, and every rank saves the
checkpoint of its step; the job ends with status 75 and the checkpoint loads.

- mpiexec (scripts/mpirun.sh): SIGTERM to every process of the job at once
  (``scancel --full``: the batch script, mpiexec and the ranks, as a job being
  cancelled or preempted gets it), or to the batch script alone (``--batch``).
  Before, mpiexec killed its ranks about 0.5 s after its own SIGTERM: no
  checkpoint, status 1.
- across two nodes (network-namespace hosts): SIGTERM to the steps' processes, the
  other node's daemon among them.
- srun: SIGTERM to the step's tasks (``scancel --signal=TERM JOB``, as a
  preemption's GraceTime signal). srun itself must not get it: it then kills its
  tasks at once (docs/slurm.md).
"""

import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT, job_env, run

JOB = ROOT / "slurm" / "job-train-chain.sbatch"
MPIRUN = ROOT / "scripts" / "mpirun.sh"
EXAMPLE = ROOT / "examples" / "chain_train.py"
ARGS = "--steps 1000 --every 5 --step-seconds 0.3"
#: how long the test waits for the job to train, or to end after the signal, before
#: calling it a hang (not a timing claim)
BOUND = 300

pytest.importorskip("torch")


def _job(job):
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                          timeout=30).stdout


def _wait_for(predicate, timeout, every=1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return False


@pytest.mark.parametrize("launcher, scancel", [
    ("mpiexec", ["--full"]),
    ("mpiexec", ["--batch"]),
    ("srun", []),
])
def test_a_preempted_job_saves_its_step_and_ends_with_75(slurm_cluster, tmp_path, launcher,
                                                         scancel):
    log, chain = tmp_path / "job.out", tmp_path / "chain"
    env = job_env(MPIKV_CHAIN_DIR=str(chain), MPIKV_CHAIN_ARGS=ARGS, MPIKV_AUTOTUNE="0",
                  MPIKV_CHAIN_REQUEUE="0", MPIKV_LAUNCHER=launcher)
    sub = subprocess.run(["sbatch", "--parsable", "-n", "2", f"--output={log}", str(JOB)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.strip().split(";")[0]

    def text():
        return log.read_text().replace("\x00", "") if log.exists() else "(no output)"

    try:
        # Training: the checkpoint after step 5 is in place (every rank's handlers too).
        assert _wait_for(lambda: (chain / "step-000000005.trainer.json").exists(), BOUND), \
            text()
        subprocess.run(["scancel", "--signal=TERM", *scancel, job], check=True, timeout=30)
        assert _wait_for(lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)",
                                           _job(job)), BOUND), (_job(job), text())
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    out, state = text(), _job(job)
    assert "ExitCode=75:0" in state, (state, out)
    assert re.search(r"mpikv chain job \d+ run 0: exit 75$", out, re.M), out
    stopped = re.findall(r"mpikv: rank (\d): stopped after step (\d+) \(a signal\)", out)
    assert sorted(r for r, _ in stopped) == ["0", "1"], out
    steps = {int(s) for _, s in stopped}
    assert len(steps) == 1, out
    step = steps.pop()
    from mpikv.torch import resume
    assert resume.newest_first(str(chain))[0][0] == step, out
    # The checkpoint loads: one rank goes on from it, one step more.
    rc, more, _ = run([MPIRUN, "-n", "1", sys.executable, EXAMPLE, "--dir", chain, "--steps",
                       str(step + 1)], timeout=BOUND)
    assert rc == 0, more
    assert f"from step {step} of {step + 1}" in more and f"done at step {step + 1}," in more, \
        more


@pytest.fixture
def two_nodes(slurm_cluster):
    """A two-node SLURM cluster on network-namespace hosts (scripts/cluster.sh), torn
    down after the test."""
    from .conftest import CLUSTER, need_root
    need_root()
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    rc, out, _ = run([CLUSTER, "down"], timeout=60)
    assert rc == 0, out
    try:
        rc, out, _ = run([CLUSTER, "up", "--hosts", "2"], timeout=60)
        assert rc == 0, out
        rc, out, _ = run([CLUSTER, "slurm-up"], timeout=120)
        assert rc == 0, out
        yield CLUSTER
    finally:
        rc, out, _ = run([CLUSTER, "down"], timeout=60)
        assert rc == 0, out


def test_across_two_nodes_the_other_nodes_ranks_save_too(two_nodes):
    """mpiexec starts h2's daemon through srun; a SIGTERM to the steps' processes
    (h2's daemon and rank) reaches the rank, whose daemon scripts/mpirun.sh starts
    with SIGTERM blocked (before: the daemon killed its rank, and the job ended
    without a checkpoint)."""
    base = Path("/run/mpikv_slurm") / f"preempt-{uuid.uuid4().hex[:8]}"   # not /tmp: per host
    base.mkdir(parents=True)
    try:
        log, chain = base / "job.out", base / "chain"
        env = job_env(MPIKV_CHAIN_DIR=str(chain), MPIKV_CHAIN_ARGS=ARGS, MPIKV_AUTOTUNE="0",
                      MPIKV_CHAIN_REQUEUE="0")
        sub = subprocess.run([str(two_nodes), "slurm", "sbatch", "--parsable", "-N", "2",
                              "--ntasks-per-node=1", f"--output={log}", str(JOB)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        job = sub.stdout.strip().split(";")[0]

        def text():
            return log.read_text().replace("\x00", "") if log.exists() else "(no output)"

        def show():
            return subprocess.run([str(two_nodes), "slurm", "scontrol", "show", "job", job],
                                  capture_output=True, text=True, timeout=30).stdout

        assert _wait_for(lambda: (chain / "step-000000005.trainer.json").exists(), BOUND), \
            text()
        subprocess.run([str(two_nodes), "slurm", "scancel", "--signal=TERM", job], check=True,
                       timeout=30)
        assert _wait_for(lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)",
                                           show()), BOUND), (show(), text())
        out, state = text(), show()
        assert "ExitCode=75:0" in state, (state, out)
        stopped = re.findall(r"mpikv: rank (\d): stopped after step (\d+) \(a signal\)", out)
        assert sorted(r for r, _ in stopped) == ["0", "1"] and len({s for _, s in stopped}) == 1, \
            out
        from mpikv.torch import resume
        assert resume.newest_first(str(chain))[0][0] == int(stopped[0][1]), out
    finally:
        shutil.rmtree(base, ignore_errors=True)
