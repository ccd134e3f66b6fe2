"""The memory wall: under a per-rank memory cap (a cgroup), DDP + AdamW runs out of
memory and the Trainer's ``shard="parameters"`` trains the same model."""

import os
import pathlib
import re
import sys

import pytest

from .conftest import ROOT, job_env, need_root, run

SCRIPT = ROOT / "tests" / "system" / "scripts" / "memory_wall.py"
MPIRUN = ROOT / "scripts" / "mpirun.sh"

pytest.importorskip("torch")


def _memory_cgroup():
    """This process's cgroup v1 memory directory, or None."""
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found = pathlib.Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return found if (found / "memory.limit_in_bytes").exists() else None
    return None


@pytest.fixture
def wall():
    """A cgroup directory the ranks make their own capped groups in; removed after."""
    need_root()
    base = _memory_cgroup()
    if base is None:
        pytest.skip("no cgroup v1 memory controller to cap the ranks with")
    parent = base / f"mpikv_wall_{os.getpid()}"
    try:
        parent.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    yield parent
    # Deepest first: the ranks' groups (no task left in them once the job ended).
    for child in sorted((p for p in parent.rglob("*") if p.is_dir()),
                        key=lambda p: -len(p.parts)):
        child.rmdir()
    parent.rmdir()


def _oom_kills(parent):
    """The OOM kills in each rank's group (the kernel's count; None where the kernel
    does not say)."""
    kills = []
    for child in sorted(p for p in parent.iterdir() if p.is_dir()):
        text = (child / "memory.oom_control").read_text()
        match = re.search(r"^oom_kill (\d+)$", text, flags=re.M)
        kills.append(int(match.group(1)) if match else None)
    return kills


@pytest.mark.parametrize("ranks", [2])
def test_ddp_runs_out_of_memory_where_sharded_parameters_train(wall, ranks):
    def job(how):
        (wall / how).mkdir()
        return run([MPIRUN, "-n", ranks, sys.executable, SCRIPT, "--cgroup", wall / how,
                    "--how", how], timeout=600, env=job_env(OMP_NUM_THREADS="1"))

    rc, out, _ = job("parameters")
    assert rc == 0, out
    peaks = re.findall(r"^rank (\d+)/\d+ parameters: trained 3 steps, loss [0-9.]+, peak (\d+) "
                       r"MiB of a (\d+) MiB cap", out, flags=re.M)
    assert sorted(int(r) for r, _, _ in peaks) == list(range(ranks)), out
    assert all(int(peak) < int(cap) for _, peak, cap in peaks)
    assert _oom_kills(wall / "parameters") == [0] * ranks

    rc, out, _ = job("ddp")
    assert rc != 0, out
    assert "ddp: trained" not in out   # not every rank trained through
    kills = _oom_kills(wall / "ddp")
    assert len(kills) == ranks and sum(k or 0 for k in kills) >= 1, (kills, out)
