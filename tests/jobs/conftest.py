"""Helpers for tests that start whole MPI jobs as subprocesses."""

import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = ROOT / "scripts" / "mpirun.sh"


#: Open MPI's launcher, failing now and then before any rank starts (seen here about
#: once in a few thousand launches; lfortran/lfortran#8610 shows the same in CI).
LAUNCH_FAILED = "The PMIx server's listener thread failed to start"


#: the failure detector's timeout for jobs whose ranks die by SIGKILL: the launcher's
#: daemon reports such a death at once, whatever the timeout, and a long one keeps a
#: live rank of a loaded machine from being taken for dead (at the default 2 s a rank
#: importing torch beside two other 4-rank jobs was declared lost: its heartbeats
#: starved). Shared memory sees a death only through the detector: within this.
KILL_DETECTOR = 10.0
#: the longest such a death may take to be seen before a test calls it a hang
KILL_SEEN_WITHIN = KILL_DETECTOR + 20


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


def run_with_defaults(n, script, *args, label="job"):
    """Runs ``python SCRIPT ARGS TAG`` on ``n`` ranks with mpikv's default settings (no
    ``MPIKV_*`` variable but ``MPIKV_VENV``; a hang ends at 120 s) and asserts that no
    process whose command line holds TAG is left.

    Returns:
        (returncode, stdout, stderr, seconds)
    """
    tag = f"mpikv-{label}-{uuid.uuid4().hex}"
    cmd = ["timeout", "-k", "5", "120", str(MPIRUN), "-n", str(n), sys.executable, script,
           *map(str, args), tag]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MPIKV_") or k == "MPIKV_VENV"}
    env["PYTHONUNBUFFERED"] = "1"
    for attempt in (1, 2):
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        seconds = time.monotonic() - start
        out, err = proc.stdout.replace("\x00", ""), proc.stderr.replace("\x00", "")
        if proc.returncode == 0 or LAUNCH_FAILED not in out + err or attempt == 2:
            break
    assert not left_running(tag), f"processes left: {left_running(tag)}\n{err}"
    return proc.returncode, out, err, seconds


def left_running(tag, grace=5.0):
    """The processes whose command line holds ``tag``, after a short grace."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and tag.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def read_npz(path):
    """The arrays of an ``.npz`` file: ``{name: array}``."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def run_job(n, *args, timeout=300, env=None):
    """Runs ``python ARGS`` on ``n`` ranks; returns (returncode, output, seconds)."""
    cmd = ["timeout", "-k", "5", str(timeout), str(MPIRUN), "-n", str(n), sys.executable, *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    start = time.monotonic()
    rc, output = launch(cmd, full_env)
    return rc, output, time.monotonic() - start


def started_together(jobs):
    """Starts every job of ``jobs`` ({case: a function of no arguments}) at once, each on a
    thread of its own; returns {case: its future}.

    For jobs that mostly wait (for a timeout, or for the failure detector, while a rank
    sleeps or is stopped): one after another they would leave the cores idle for as
    long. A test takes its case's ``future.result()``; an assertion failed in the job's
    function is raised there, in that test.
    """
    pool = ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="job")
    futures = {case: pool.submit(job) for case, job in jobs.items()}
    pool.shutdown(wait=False)   # the threads end with their jobs (each under a timeout)
    return futures
