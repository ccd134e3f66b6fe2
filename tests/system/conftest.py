"""Helpers for system tests: a real SLURM cluster and network-namespace hosts.

These tests need root (they install packages and start daemons). They are
plain pytest: every job is a subprocess under ``timeout -k``.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_CLUSTER = ROOT / "slurm" / "start-cluster.sh"
STOP_CLUSTER = ROOT / "slurm" / "stop-cluster.sh"
NETNS = ROOT / "scripts" / "netns-hosts.sh"
CLUSTER = ROOT / "scripts" / "cluster.sh"


def job_env(**extra):
    """The test's environment for submitting jobs: no SLURM, MPI or PMIx variables
    of an enclosing job, and this interpreter's virtual environment."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").exists():
        env["MPIKV_VENV"] = sys.prefix
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(cmd, timeout, env=None, cwd=ROOT):
    """Runs ``cmd`` under ``timeout -k``; returns (returncode, output, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(["timeout", "-k", "10", str(timeout), *map(str, cmd)], cwd=cwd,
                          env=env or job_env(), capture_output=True, text=True)
    return (proc.returncode, (proc.stdout + proc.stderr).replace("\x00", ""),
            time.monotonic() - start)


def need_root():
    if os.geteuid() != 0:
        pytest.skip("system tests need root (apt-get, daemons, network namespaces)")


def _running(pidfile, name):
    """Whether the daemon ``name`` of ``pidfile`` is alive."""
    try:
        pid = Path(pidfile).read_text().strip()
        return Path(f"/proc/{pid}/comm").read_text().strip() == name
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """Starts (or checks) the local single-node cluster; yields the node name.

    A cluster this session started is stopped at its end (daemons and all); one
    that was already running is left as it was.
    """
    need_root()
    was_running = any(_running(f"/run/{d}/{n}.pid", n) for d, n in
                      (("slurm", "slurmctld"), ("slurm", "slurmd"), ("munge", "munged")))
    rc, out, seconds = run(["bash", START_CLUSTER], timeout=600)
    try:
        if rc == 3:
            pytest.skip("SLURM packages are missing and apt-get could not install them "
                        f"(is apt reachable?):\n{out[-2000:]}")
        assert rc == 0, f"slurm/start-cluster.sh failed (rc={rc}, {seconds:.1f} s):\n{out}"
        yield socket.gethostname().split(".")[0]
    finally:
        if not was_running:
            rc, out, _ = run(["bash", STOP_CLUSTER], timeout=120)
            assert rc == 0, f"slurm/stop-cluster.sh failed (rc={rc}):\n{out}"


def sections(output):
    """Splits a job's output into {launcher: text} at its '== LAUNCHER: cmd' lines."""
    parts, name = {}, None
    for line in output.splitlines():
        if line.startswith("== ") and ":" in line and "exit code" not in line:
            name = line[3:].split(":", 1)[0]
            parts[name] = ""
        elif name is not None:
            parts[name] += line + "\n"
    return parts


def assert_check_passed(text, n, hosts):
    """``text`` is one launch of slurm/check_job.py: n ranks on ``hosts`` (rank -> host)."""
    for r in range(n):
        line = f"mpikv-check rank {r}/{n} host {hosts[r]} sum OK"
        assert text.count(line) == 1, f"{line!r} not exactly once in:\n{text}"
    assert f"mpikv-check PASSED n={n} " in text, text
    assert "FAILED" not in text and "WRONG" not in text, text
