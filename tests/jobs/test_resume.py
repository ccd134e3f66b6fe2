"""A run saved on N ranks resumes on M ranks exactly; a killed save leaves the old one."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from .conftest import MPIRUN, ROOT, read_npz, run_job

SCRIPT = "tests/jobs/scripts/resume.py"
STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "w.npz"
    rc, log, _ = run_job(2, SCRIPT, "run", "0", str(STEPS), "--out", str(out))
    assert rc == 0, log
    return read_npz(out)


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2), (1, 4)])
def test_resume_on_another_number_of_ranks(tmp_path, uninterrupted, before, after):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "w.npz")
    rc, log, _ = run_job(before, SCRIPT, "run", "0", "3", "--save", ckpt)
    assert rc == 0, log
    rc, log, _ = run_job(after, SCRIPT, "run", "3", str(STEPS), "--load", ckpt, "--out", out)
    assert rc == 0, log
    got = read_npz(out)
    for key, want in uninterrupted.items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)


def _kill_matching(text, timeout=10):
    """SIGKILLs every process whose command line contains ``text``; waits for them."""
    def matching():
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if text.encode() in f.read():
                            pids.append(int(entry))
                except OSError:
                    pass
        return pids
    deadline = time.monotonic() + timeout
    while (pids := matching()) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    assert not matching(), f"processes of {text!r} survived SIGKILL"


def test_job_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    ckpt, first = str(tmp_path / "ckpt"), str(tmp_path / "first.npz")
    cmd = [str(MPIRUN), "-n", "2", sys.executable, SCRIPT, "killsave", ckpt, first]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen = []
    deadline = time.monotonic() + 60
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("IN_SAVE") or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The ranks are not in mpiexec's process group: kill them too, by the
        # checkpoint path only they have on their command line.
        _kill_matching(ckpt)
    assert any(line.startswith("IN_SAVE") for line in seen), "".join(seen)
    # The second save wrote parts but never committed: the first one loads whole.
    out = str(tmp_path / "loaded.npz")
    rc, log, _ = run_job(2, SCRIPT, "run", "1", "1", "--load", ckpt, "--out", out)
    assert rc == 0, log
    got, want = read_npz(out), read_npz(first)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
