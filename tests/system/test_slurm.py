"""A real single-node SLURM cluster: sbatch jobs with mpiexec and srun --mpi=pmix.

slurm/start-cluster.sh installs SLURM if needed (about 15 s) and starts it; the
jobs are submitted together with ``sbatch --wait`` (which polls every 2 s, then
every 8 s: a job takes about 10 s however short).
"""

import os
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, assert_check_passed, job_env, run, sections

JOB = ROOT / "slurm" / "job-single-node.sbatch"
TIMEOUT = 180
# name -> (sbatch options, extra environment)
JOBS = {
    "n2": (["-n", "2"], {}),
    "n3": (["-n", "3"], {}),
    # The job script with a wrong PMI plugin: its size check must fail the job.
    "srun_none": (["-n", "2"], {"MPIKV_LAUNCHERS": "srun", "MPIKV_SRUN_MPI": "none"}),
    # mpikv run inside the allocation: its size from SLURM_NTASKS, by mpiexec and by srun.
    "mpikv_run": (["-n", "3"], {"MPIKV_LAUNCHERS": "mpikv-run mpikv-srun"}),
}


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Submits every job of JOBS at once; returns name -> wait() giving (rc, output, s)."""
    out_dir = tmp_path_factory.mktemp("slurm")
    tag = f"mpikv-test-{os.getpid()}"
    procs = {}
    start = time.monotonic()
    for name, (options, extra) in JOBS.items():
        out = out_dir / f"{name}.out"
        cmd = ["timeout", "-k", "10", str(TIMEOUT), "sbatch", "--wait", f"--job-name={tag}-{name}",
               f"--output={out}", *options, str(JOB)]
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=job_env(**extra), text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out)
    results = {}

    def wait(name):
        if name not in results:
            proc, out = procs[name]
            submit_output = proc.communicate()[0]
            text = out.read_text().replace("\x00", "") if out.exists() else "(no output file)"
            results[name] = (proc.returncode, submit_output + text, time.monotonic() - start)
        return results[name]

    yield wait
    for name in JOBS:
        wait(name)
    # Anything still queued or running after a timeout.
    for name in JOBS:
        subprocess.run(["scancel", f"--name={tag}-{name}"], capture_output=True, timeout=30)


@pytest.mark.parametrize("n", [2, 3])
def test_single_node_job_passes_with_mpiexec_and_srun(jobs, slurm_cluster, n):
    rc, out, seconds = jobs(f"n{n}")
    assert rc == 0, f"sbatch --wait rc={rc} after {seconds:.1f} s:\n{out}"
    parts = sections(out)
    assert set(parts) == {"mpiexec", "srun"}, out
    for launcher, text in parts.items():
        assert f"== {launcher}: exit code 0" in text, out
        assert_check_passed(text, n, [slurm_cluster] * n)


def test_mpikv_run_in_a_job_by_mpiexec_and_srun(jobs, slurm_cluster):
    rc, out, seconds = jobs("mpikv_run")
    assert rc == 0, f"sbatch --wait rc={rc} after {seconds:.1f} s:\n{out}"
    parts = sections(out)
    assert set(parts) == {"mpikv-run", "mpikv-srun"}, out
    for launcher, text in parts.items():
        assert f"== {launcher}: exit code 0" in text, out
        assert_check_passed(text, 3, [slurm_cluster] * 3)


def test_mpikv_run_refuses_a_lone_rank_under_a_wrong_pmi(slurm_cluster):
    """srun --mpi=none (given after mpikv run's own --mpi=pmix, so it wins) starts two
    singletons: each store's creation is a LaunchError, not two jobs that pass."""
    env = job_env()
    cmd = [sys.executable, "-m", "mpikv", "run", "--launcher", "srun", "-n", "2",
           "--mpi-args=--mpi=none", "tests/system/scripts/make_a_store.py"]
    rc, out, _ = run(cmd, timeout=60, env=env)
    assert rc != 0 and "MADE" not in out, out
    assert out.count("LaunchError: mpikv run -n 2 started this process with srun, but MPI "
                     "sees a job of 1 rank") == 2, out


def test_job_with_srun_mpi_none_fails_the_size_check(jobs):
    rc, out, seconds = jobs("srun_none")
    assert rc != 0, f"the job passed with srun --mpi=none:\n{out}"
    assert out.count("COMM_WORLD has 1 rank(s) but 2 were launched") == 2, out
    assert "PASSED" not in out, out


@pytest.mark.parametrize("plugin", ["none", "pmi2"])
def test_srun_with_a_wrong_pmi_plugin_is_caught(slurm_cluster, plugin):
    """Open MPI 5 has no PMI2: both plugins start 2 singletons that would each pass."""
    env = job_env(OMPI_MCA_btl="^ofi", OPAL_PREFIX=sys.prefix, PMIX_MCA_psec="native")
    cmd = ["srun", "-n", "2", f"--mpi={plugin}", sys.executable, "slurm/check_job.py"]
    rc, out, _ = run(cmd, timeout=60, env=env)
    assert rc == 3 or "exit code 3" in out, f"rc={rc}:\n{out}"
    assert out.count("COMM_WORLD has 1 rank(s) but 2 were launched (SLURM_NTASKS=2)") == 2, out
    assert "--mpi=pmix" in out and "PASSED" not in out


def test_srun_pmix_outside_a_batch_job(slurm_cluster):
    env = job_env(OMPI_MCA_btl="^ofi", OPAL_PREFIX=sys.prefix, PMIX_MCA_psec="native")
    cmd = ["srun", "-n", "2", "--mpi=pmix", sys.executable, "slurm/check_job.py"]
    rc, out, _ = run(cmd, timeout=60, env=env)
    assert rc == 0, out
    assert_check_passed(out, 2, [slurm_cluster] * 2)
