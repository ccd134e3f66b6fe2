"""Two "hosts" as network namespaces (scripts/netns-hosts.sh, the former name of
scripts/cluster.sh): an mpikv job with one rank on each, over TCP, and a two-node
SLURM cluster on them."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import NETNS, assert_check_passed, need_root, run, sections

NAMESPACES = ("mpikv_h1", "mpikv_h2", "mpikv_sw")


def namespaces():
    return {p.name for p in Path("/run/netns").glob("mpikv_*")} if Path("/run/netns").exists() else set()


@pytest.fixture
def hosts():
    """Clean namespaces before the test; torn down after it, whatever happened."""
    need_root()
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    rc, out, _ = run([NETNS, "down"], timeout=60)
    assert rc == 0, out
    try:
        yield
    finally:
        rc, out, _ = run([NETNS, "down"], timeout=60)
        assert rc == 0, out
        assert not namespaces() & set(NAMESPACES), namespaces()


def test_check_job_across_two_hosts(hosts):
    rc, out, seconds = run([NETNS, "run"], timeout=120)
    assert rc == 0, f"rc={rc} after {seconds:.1f} s:\n{out}"
    assert_check_passed(out, 2, ["h1", "h2"])
    assert "mpikv-check PASSED n=2 hosts=h1,h2" in out


def comm(pid):
    """The command name of a process, or None once it has gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def test_teardown_kills_only_what_runs_in_the_namespaces(hosts):
    outside = subprocess.Popen(["sleep", "60"])
    job = subprocess.Popen(["timeout", "-k", "5", "60", str(NETNS), "run", "sleep", "50"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Wait for the state itself (the rank on h2 running), bounded only by the job's own
        # timeout: under load the launch across the namespaces can take longer than any guess.
        while job.poll() is None:
            pids = run(["ip", "netns", "pids", "mpikv_h2"], timeout=30)[1].split()
            if "sleep" in (comm(p) for p in pids):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the job ended (rc {job.returncode}) before its rank on h2 ran:\n"
                        f"{job.stdout.read()}")
        rc, out, _ = run([NETNS, "down"], timeout=60)
        assert rc == 0, out
        # Killed by the teardown: not sleep's own end (0) nor the job's timeout (124).
        assert job.wait(timeout=30) not in (0, 124)
        assert not namespaces() & set(NAMESPACES)
        assert outside.poll() is None, "a process outside the namespaces was killed"
    finally:
        outside.kill()
        outside.wait()
        if job.poll() is None:
            job.kill()
            job.wait()


def test_two_node_slurm_cluster(hosts, slurm_cluster):
    """slurmctld + slurmd h1 in mpikv_h1, slurmd h2 in mpikv_h2, on shaped links; one
    job, both launchers."""
    rc, out, _ = run([NETNS, "up", "--rate", "10gbit"], timeout=60)
    assert rc == 0, out
    rc, out, _ = run([NETNS, "slurm-up"], timeout=120)
    assert rc == 0, out
    output = Path("/run/mpikv_slurm/multi-node.out")  # not /tmp: each host has its own
    rc, out, seconds = run([NETNS, "slurm", "sbatch", "--wait", f"--output={output}",
                            "slurm/job-multi-node.sbatch"], timeout=180)
    text = output.read_text().replace("\x00", "") if output.exists() else "(no output file)"
    assert rc == 0, f"sbatch --wait rc={rc} after {seconds:.1f} s:\n{out}\n{text}"
    parts = sections(text)
    assert set(parts) == {"mpiexec", "srun"}, text
    for launcher, part in parts.items():
        assert f"== {launcher}: exit code 0" in part, text
        assert_check_passed(part, 2, ["h1", "h2"])
