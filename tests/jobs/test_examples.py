"""The examples run as a user would run them, and print the right values."""

import re
import subprocess
import sys

import pytest

from .conftest import ROOT, run_job

TUTORIAL = "examples/seed_tutorial.py"


def _values(out):
    """The first element of every array printed, in order."""
    return [float(m) for m in re.findall(r"^\[\[\s*([0-9.]+)", out, flags=re.M)]


def _expected(n):
    # Per SPEC: 2, 8, 4; updater: 4, then 6, 6; keys 5, 7, 9: 3; four devices: 11 (local);
    # on N ranks every push is summed over the ranks.
    return [2, 8 * n, 4 * n, 4 * n, 6 * n, 6 * n, 1 + 2 * n, 1 + 10 * n]


def test_tutorial_on_local_prints_what_mxnet_printed():
    proc = subprocess.run([sys.executable, TUTORIAL], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _values(proc.stdout) == [2, 8, 4, 4, 6, 6, 3, 11]
    updates = re.findall(r"^update on key: (\d+)$", proc.stdout, flags=re.M)
    assert updates == ["3", "5", "7", "9", "5", "7", "9"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tutorial_on_dist_sync_prints_sums_over_ranks(n):
    rc, out, _ = run_job(n, TUTORIAL, "--type", "dist_sync")
    assert rc == 0, out
    assert f"store dist_sync: {n} worker(s)" in out
    assert _values(out) == _expected(n)
    # Each update line once per push of each key, from its owner.
    updates = sorted(re.findall(r"^update on key: (\d+)$", out, flags=re.M))
    assert updates == sorted(["3", "5", "7", "9", "5", "7", "9"])
