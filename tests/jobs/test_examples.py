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


def test_chain_train_refuses_a_batch_the_ranks_do_not_divide(tmp_path):
    # 64 rows on 3 ranks would train on 63 and drop one, silently: refused on every rank.
    pytest.importorskip("torch")
    rc, out, _ = run_job(3, "examples/chain_train.py", "--dir", str(tmp_path), "--batch", "64",
                         "--steps", "1", timeout=180)
    assert rc == 2, out
    said = re.findall(r"error: --batch 64 does not divide by the 3 ranks: .* give a multiple "
                      r"of 3$", out, flags=re.M)
    assert len(said) == 3, out
    assert not list(tmp_path.iterdir())   # nothing trained, nothing saved


def test_mpikv_version():
    from mpikv import __version__
    proc = subprocess.run([sys.executable, "-m", "mpikv", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"mpikv {__version__} ({ROOT / 'mpikv'})\n"


def test_a_directory_named_mpikv_beside_a_script_does_not_shadow_mpikv(tmp_path):
    # A clone named mpikv/ (no __init__.py at its root) beside the script: Python makes it
    # a namespace package unless the installed mpikv is found on the path first
    # (scripts/setup.sh's editable_mode=compat, or a plain install).
    (tmp_path / "mpikv" / "mpikv").mkdir(parents=True)
    (tmp_path / "mpikv" / "README.md").write_text("a clone\n")
    script = tmp_path / "train.py"
    script.write_text("import mpikv\nprint(mpikv.__file__)\nprint(mpikv.create('local').type)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(ROOT / "mpikv" / "__init__.py"), "local"]
