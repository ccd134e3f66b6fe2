"""Helpers for tests that start whole MPI jobs as subprocesses."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = ROOT / "scripts" / "mpirun.sh"


def run_job(n, *args, timeout=120, env=None):
    """Runs ``python ARGS`` on ``n`` ranks; returns (returncode, output, seconds)."""
    cmd = ["timeout", "-k", "5", str(timeout), str(MPIRUN), "-n", str(n), sys.executable, *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=full_env)
    output = (proc.stdout + proc.stderr).replace("\x00", "")
    return proc.returncode, output, time.monotonic() - start
