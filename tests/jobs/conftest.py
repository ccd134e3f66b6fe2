"""Helpers for tests that start whole MPI jobs as subprocesses."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = ROOT / "scripts" / "mpirun.sh"


#: Open MPI's launcher, failing now and then before any rank starts (seen here about
#: once in a few thousand launches; lfortran/lfortran#8610 shows the same in CI).
LAUNCH_FAILED = "The PMIx server's listener thread failed to start"


def launch(cmd, env):
    """Runs a launcher command; returns (returncode, output). A launch that failed
    before any rank started is tried once more, and the output says so."""
    note = ""
    for attempt in (1, 2):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        output = (proc.stdout + proc.stderr).replace("\x00", "")
        if proc.returncode == 0 or LAUNCH_FAILED not in output or attempt == 2:
            return proc.returncode, note + output
        note = f"[launch failed before any rank started; tried again]\n{output}\n"


def run_job(n, *args, timeout=120, env=None):
    """Runs ``python ARGS`` on ``n`` ranks; returns (returncode, output, seconds)."""
    cmd = ["timeout", "-k", "5", str(timeout), str(MPIRUN), "-n", str(n), sys.executable, *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    start = time.monotonic()
    rc, output = launch(cmd, full_env)
    return rc, output, time.monotonic() - start
