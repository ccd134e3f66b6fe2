"""``python -m mpikv bench saves`` (issue 24) end to end, tiny, at 2 ranks.

The figures of one block mean nothing; this checks that the three variants
train to the same weights (checkpoints change nothing), that the costs are
computed from the times shown, and that nothing is left in the directory.
"""

import json

import pytest

from .conftest import run_job

pytest.importorskip("torch")


def test_saves_variants_train_alike_and_report_their_cost(tmp_path):
    rc, out, _ = run_job(2, "-m", "mpikv", "bench", "saves", "--every", "2", "--blocks", "1",
                         "--warmup", "1", "--resnet-batch", "2", "--resnet-image", "8",
                         "--dir", str(tmp_path), "--json",
                         env={"MPIKV_AUTOTUNE": "0"}, timeout=300)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    res = json.loads(lines[0])
    assert res["ranks"] == 2 and res["every"] == 2 and res["weights_equal"] is True
    ms = res["ms_per_step"]
    assert set(ms) == {"none", "background", "blocking"} and all(v > 0 for v in ms.values())
    for name in ("background", "blocking"):
        assert res["cost"][name] == pytest.approx(ms[name] / ms["none"] - 1)
    # ResNet-18's weights and momentum in float32: one checkpoint's parts hold both
    assert 2 * 11_181_642 * 4 < res["checkpoint_bytes"] < 2.1 * 11_181_642 * 4
    assert list(tmp_path.iterdir()) == []
