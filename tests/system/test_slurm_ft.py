"""A fault-tolerant launch inside a SLURM job: ``MPIKV_FT=1`` (docs/fault-tolerance.md).

The job script runs slurm/check_job.py through ``scripts/mpirun.sh --ft`` with
``MPIKV_FAULT_TOLERANT=1``, so its store is created only if the launch really
is a ULFM one; srun cannot keep a step alive when a task dies, so asking it is
an error.
"""

import os
import subprocess
import time

import pytest

from .conftest import ROOT, assert_check_passed, job_env, sections

JOB = ROOT / "slurm" / "job-single-node.sbatch"
TIMEOUT = 180


def submit(tmp_path, name, options, extra):
    tag = f"mpikv-test-{os.getpid()}-{name}"
    out = tmp_path / f"{name}.out"
    cmd = ["timeout", "-k", "10", str(TIMEOUT), "sbatch", "--wait", f"--job-name={tag}",
           f"--output={out}", *options, str(JOB)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=job_env(**extra), text=True,
                              capture_output=True)
    finally:
        subprocess.run(["scancel", f"--name={tag}"], capture_output=True, timeout=30)
    text = out.read_text().replace("\x00", "") if out.exists() else "(no output file)"
    return proc.returncode, proc.stdout + proc.stderr + text, time.monotonic() - start


def test_fault_tolerant_job_with_mpiexec(slurm_cluster, tmp_path):
    rc, out, seconds = submit(tmp_path, "ft", ["-n", "3"],
                              {"MPIKV_FT": "1", "MPIKV_LAUNCHERS": "mpiexec"})
    assert rc == 0, f"sbatch --wait rc={rc} after {seconds:.1f} s:\n{out}"
    parts = sections(out)
    assert set(parts) == {"mpiexec"}, out
    assert "scripts/mpirun.sh --ft --bind-to none" in out, out
    assert_check_passed(parts["mpiexec"], 3, [slurm_cluster] * 3)
    assert " fault_tolerant" in parts["mpiexec"].split("mpikv-check PASSED", 1)[1], out


def test_fault_tolerant_job_refuses_srun(slurm_cluster, tmp_path):
    rc, out, _ = submit(tmp_path, "ft_srun", ["-n", "2"],
                        {"MPIKV_FT": "1", "MPIKV_LAUNCHERS": "srun"})
    assert rc != 0, out
    assert ("mpikv job: MPIKV_FT=1: srun has no ULFM (a task's death ends the step); "
            "use MPIKV_LAUNCHERS=mpiexec") in out, out
    assert "PASSED" not in out, out
