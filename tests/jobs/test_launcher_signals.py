"""A preemption that signals the launcher too (issue 38, class 5): SLURM sends
SIGTERM to every process of the step, ``mpiexec`` included. Through
``scripts/mpirun.sh`` the ranks get the signal and the time to save: every rank
saves the checkpoint of its step and the job ends with status 75, whether the
SIGTERM went to the script alone, to ``mpiexec`` alone, or to every process of
the job at once. (Before, ``prterun`` killed its ranks about 0.5 s after its own
SIGTERM: no checkpoint, status 1.)"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from .conftest import MPIRUN, ROOT, left_running, run_job

pytest.importorskip("torch")

SCRIPT = "tests/jobs/scripts/preempt.py"
#: the longest a job may take to start training, or to end after the signal, before
#: the test calls it a hang (not a timing claim: the machine may be loaded)
BOUND = 300


def _descendants(pid):
    """Every process below ``pid`` (by their parent, read from /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        except (OSError, ValueError, IndexError):
            pass
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _comm(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Job:
    """``scripts/mpirun.sh -n N python preempt.py DIRECTORY ...`` with its output read
    on a thread."""

    def __init__(self, n, directory):
        self.tag = f"mpikv-preempt-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen(
            [str(MPIRUN), "-n", str(n), sys.executable, SCRIPT, str(directory), "1000000",
             self.tag], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.replace("\x00", ""))

    def log(self):
        return "".join(self.lines)

    def wait_for_steps(self, n, steps):
        """Waits until every rank has printed its update ``steps`` (its signal
        handler is in place, and it is training)."""
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline and self.proc.poll() is None:
            done = {int(m.group(1)) for m in re.finditer(r"^rank (\d+) step (\d+)$", self.log(),
                                                         re.M) if int(m.group(2)) >= steps}
            if done == set(range(n)):
                return
            time.sleep(0.1)
        raise AssertionError(f"the job did not start training:\n{self.log()}")

    def end(self):
        """Waits for the job (within BOUND); returns its status and output."""
        try:
            rc = self.proc.wait(timeout=BOUND)
        except subprocess.TimeoutExpired:
            rc = None
        self.kill()
        self.reader.join(timeout=30)
        return rc, self.log()

    def kill(self):
        for pid in [self.proc.pid] + _descendants(self.proc.pid) + left_running(self.tag, 0):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(timeout=30)


def _targets(job, who):
    """The processes a SIGTERM goes to: the script, mpiexec (prterun), or every
    process of the job (as SLURM signals a step)."""
    below = _descendants(job.proc.pid)
    if who == "script":
        return [job.proc.pid]
    if who == "mpiexec":
        launcher = [pid for pid in [job.proc.pid] + below if _comm(pid) == "prterun"]
        assert len(launcher) == 1, [(pid, _comm(pid)) for pid in [job.proc.pid] + below]
        return launcher
    return [job.proc.pid] + below


#: (ranks, who gets the SIGTERM): every route at 2 ranks, SLURM's at 3 too; the
#: checkpoint of SLURM's route is loaded by a job that goes on from it
CASES = [(2, "script"), (2, "mpiexec"), (2, "every-process"), (3, "every-process")]


@pytest.mark.parametrize("n, who", CASES, ids=[f"{n}-{who}" for n, who in CASES])
def test_a_sigterm_to_the_launcher_saves_and_ends_with_75(tmp_path, n, who):
    directory = tmp_path / "ckpt"
    job = Job(n, directory)
    try:
        job.wait_for_steps(n, 3)
        for pid in _targets(job, who):
            os.kill(pid, signal.SIGTERM)
        rc, log = job.end()
    finally:
        job.kill()
    assert rc == 75, log
    stopped = re.findall(r"mpikv: rank (\d+): stopped after step (\d+) \(a signal\), "
                         r"checkpoint \S+ complete", log)
    steps = {int(step) for _, step in stopped}
    assert sorted(int(rank) for rank, _ in stopped) == list(range(n)) and len(steps) == 1, log
    step = steps.pop()
    assert step >= 3, log
    assert not left_running(job.tag), log
    from mpikv.torch import resume
    assert [s for s, _ in resume.newest_first(str(directory))] == [step], log
    if who != "every-process":
        return
    # The checkpoint loads: a job on one rank goes on from it to two steps more.
    rc, out, _ = run_job(1, SCRIPT, str(directory), str(step + 2))
    assert rc == 0, out
    assert f"rank 0/1: from step {step}\n" in out and f"rank 0 step {step + 2}\n" in out, out
