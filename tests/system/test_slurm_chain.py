"""A run as a chain of SLURM jobs on the real local cluster: USR1 to the batch script
(as SLURM's --signal=B:USR1 warning before a time limit), a checkpoint, a requeue, and
the requeued run ends with the weights of one run that never stopped."""

import re
import subprocess
import time

import pytest

from .conftest import ROOT, job_env, run

JOB = ROOT / "slurm" / "job-train-chain.sbatch"
MPIRUN = ROOT / "scripts" / "mpirun.sh"
EXAMPLE = ROOT / "examples" / "chain_train.py"
ARGS = "--steps 40 --every 5 --step-seconds 0.3"

pytest.importorskip("torch")


def _state(job):
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         timeout=30).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else None


#: slurm/slurm.conf.in's AuthInfo=cred_expire: how long a job's credential lives
CRED_EXPIRE = 10


def _requeued_or_done(job, submitted):
    """Whether the job is pending again after its requeue (then made eligible as
    soon as it may start) or has completed.

    SLURM holds a requeued job back for the credential's lifetime (its begin
    time): the first run's credential was revoked when it was cancelled, and a
    run started before it expires is killed at once ("Job credential revoked",
    seen when this test made the job eligible 7 s after the submission). Its
    owner may make it eligible once that lifetime has passed, as this test, which
    checks the chain and not SLURM's delay, does."""
    state = _state(job)
    if state == "PENDING" and time.monotonic() - submitted > CRED_EXPIRE + 2:
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                       capture_output=True, timeout=30)
    return state in ("PENDING", "COMPLETED")


def _wait_for(predicate, timeout, every=1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return False


def test_a_signalled_job_checkpoints_requeues_and_ends_with_the_straight_weights(
        slurm_cluster, tmp_path):
    import sys
    rc, out, _ = run([MPIRUN, "-n", "2", sys.executable, EXAMPLE, "--dir", tmp_path / "straight",
                      *ARGS.replace("0.3", "0").split()], timeout=300)
    assert rc == 0, out
    straight = re.search(r"done at step 40, .* weights (\w+)", out).group(1)

    log = tmp_path / "chain.out"
    env = job_env(MPIKV_CHAIN_DIR=str(tmp_path / "chain"), MPIKV_CHAIN_ARGS=ARGS,
                  MPIKV_AUTOTUNE="0")
    submitted = time.monotonic()
    sub = subprocess.run(["sbatch", "--parsable", "-n", "2", f"--output={log}", str(JOB)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        # Under way: a checkpoint after step 5 is in place.
        assert _wait_for(lambda: (tmp_path / "chain" / "step-000000005.trainer.json").exists(),
                         240), log.read_text() if log.exists() else "(no output)"
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
        assert _wait_for(lambda: _requeued_or_done(job, submitted), 300), (
            _state(job), log.read_text())
        assert _wait_for(lambda: _requeued_or_done(job, submitted)
                         and _state(job) == "COMPLETED", 300), (
            _state(job), log.read_text())
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log.read_text().replace("\x00", "")
    stopped = re.search(r"stopped after step (\d+) \(a signal\)", text)
    assert stopped, text
    resumed = re.search(rf"from step {stopped.group(1)} of 40", text)
    assert resumed and "run 1: 2 task(s)" in text, text
    assert "done at step 40, " in text and f"weights {straight}" in text, text
