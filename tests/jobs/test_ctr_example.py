"""The click-through example (issue 23) trains at 2 ranks and beats its dense-only baseline."""

import re

import pytest

from .conftest import run_job

pytest.importorskip("torch")

SCRIPT = "examples/ctr_embedding.py"
TINY = ["--ids", "500", "--train", "6000", "--test", "2000", "--batch", "256",
        "--epochs", "2", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ctr_example_beats_the_dense_only_baseline(tmp_path):
    plot = tmp_path / "ctr.png"
    rc, out, _ = run_job(2, SCRIPT, *TINY, "--plot", str(plot), timeout=180)
    assert rc == 0, out
    loss = re.findall(r"^held-out log-loss: embeddings (\d+\.\d+), dense only (\d+\.\d+)$",
                      out, flags=re.M)
    auc = re.findall(r"^held-out AUC: embeddings (\d+\.\d+), dense only (\d+\.\d+)$",
                     out, flags=re.M)
    assert len(loss) == 1 and len(auc) == 1, out   # printed by rank 0 only
    (emb_loss, base_loss), (emb_auc, base_auc) = map(float, loss[0]), map(float, auc[0])
    assert emb_loss < base_loss and emb_auc > base_auc + 0.05, out
    assert 0.5 < emb_auc <= 1.0
    assert re.findall(r"^embeddings beat the dense-only baseline: True$", out, flags=re.M), out
    assert len(re.findall(r"^epoch \d: held-out", out, flags=re.M)) == 2, out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.read_bytes()[:8] == PNG_MAGIC
