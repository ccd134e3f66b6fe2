"""The digits example trains the same model on any number of ranks, and resumes exactly."""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from .conftest import ROOT, run_job

SCRIPT = "examples/train_digits.py"
TORCH_SCRIPT = "examples/train_digits_torch.py"
EPOCHS = 3
QUIET = ["--no-progress", "--plot", ""]
# Ranks sum their shards' gradients in another order than one process does;
# in float64 that moves the weights by ~1e-15 after 3 epochs.
CLOSE = dict(rtol=1e-9, atol=1e-12)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _accuracy(log):
    found = re.findall(r"^final test accuracy: (\d\.\d{3})$", log, flags=re.M)
    assert len(found) == 1, log  # printed by rank 0 only
    return float(found[0])


def _weights(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_same_weights(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], err_msg=key, **CLOSE)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Weights and accuracy of 3 epochs on one rank of dist_sync."""
    out = tmp_path_factory.mktemp("one_rank") / "w.npz"
    rc, log, _ = run_job(1, SCRIPT, "--epochs", str(EPOCHS), *QUIET, "--save-weights", str(out))
    assert rc == 0, log
    return _weights(out), _accuracy(log)


def test_one_rank_reaches_the_accuracy(one_rank):
    assert one_rank[1] >= 0.9


@pytest.mark.parametrize("n", [2, 3])
def test_more_ranks_train_the_same_weights(tmp_path, one_rank, n):
    out, png = tmp_path / "w.npz", tmp_path / "plots" / "digits.png"
    rc, log, _ = run_job(n, SCRIPT, "--epochs", str(EPOCHS), "--no-progress",
                         "--plot", str(png), "--save-weights", str(out))
    assert rc == 0, log
    assert f"store dist_sync, {n} worker(s), global batch 64" in log
    assert len(re.findall(r"^epoch \d+/3: train loss", log, flags=re.M)) == EPOCHS
    _assert_same_weights(_weights(out), one_rank[0])
    assert _accuracy(log) == one_rank[1]
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and data[12:16] == b"IHDR" and len(data) > 1000


def test_local_store_runs_without_mpiexec(tmp_path, one_rank):
    out = tmp_path / "w.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    proc = subprocess.run([sys.executable, SCRIPT, "--type", "local", "--epochs", str(EPOCHS),
                           *QUIET, "--save-weights", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "store local, 1 worker(s)" in proc.stdout
    _assert_same_weights(_weights(out), one_rank[0])
    assert _accuracy(proc.stdout) >= 0.9


def test_resume_on_three_ranks_equals_an_uninterrupted_run(tmp_path, one_rank):
    ckpt, out = tmp_path / "ckpt", tmp_path / "w.npz"
    rc, log, _ = run_job(2, SCRIPT, "--epochs", str(EPOCHS - 1), *QUIET,
                         "--checkpoint", str(ckpt))
    assert rc == 0, log
    assert f"checkpoint after epoch {EPOCHS - 1}" in log
    rc, log, _ = run_job(3, SCRIPT, "--epochs", str(EPOCHS), *QUIET, "--resume", str(ckpt),
                         "--save-weights", str(out))
    assert rc == 0, log
    assert f"epochs {EPOCHS}..{EPOCHS}" in log  # only the missing epoch was trained
    _assert_same_weights(_weights(out), one_rank[0])


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (pip install torch)")
def test_torch_variant_reaches_the_accuracy_on_two_ranks():
    rc, log, _ = run_job(2, TORCH_SCRIPT, "--epochs", str(EPOCHS), *QUIET)
    assert rc == 0, log
    assert "train_digits_torch: store dist_sync, 2 worker(s)" in log
    assert _accuracy(log) >= 0.9
