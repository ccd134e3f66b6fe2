"""examples/mxnet_gluon.py, MXNet's Gluon tutorial loop on mpikv_dist_sync, at 1 and 2 ranks."""

import re

import pytest

pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (scripts/setup_mxnet.sh)")

from .jobs import ROOT, run_job  # noqa: E402


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_gluon_example_trains(ranks):
    out = run_job(ranks, ROOT / "examples" / "mxnet_gluon.py", "--epochs", "4")
    assert f"{ranks} worker(s), global batch 64" in out
    found = re.search(r"final test accuracy ([0-9.]+) in [0-9.]+ s; weights equal on all "
                      rf"{ranks} worker\(s\)", out)
    assert found, out
    assert float(found.group(1)) > 0.85
