"""``python -m mpikv bench embedding`` (issue 23) end to end, tiny, at 2 ranks.

The figures of a few steps mean nothing; this checks that every variant runs and
trains, that the ratio is the one the steps/s give, and that the memory mode
reports a DDP that cannot hold its table under the cap as "does not fit" (not a
crash of the run) while the sharded table trains under the same cap.
"""

import json
import math

import pytest

from .conftest import run_job

pytest.importorskip("torch")

VARIANTS = {"sharded", "ddp-dense", "ddp-sparse"}


def _bench(*args, timeout=120):
    rc, out, _ = run_job(2, "-m", "mpikv", "bench", "embedding", *args, "--json",
                         env={"MPIKV_AUTOTUNE": "0"}, timeout=timeout)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_embedding_steps_against_ddp():
    res = _bench("--ids", "2500", "--dim", "16", "--batch", "256", "--warmup", "1",
                 "--steps", "3", "--test", "512")
    assert res["mode"] == "time" and res["ranks"] == 2 and res["library"]
    assert res["rows"] == 4 * 2500 and res["dim"] == 16 and res["global_batch"] == 256
    rows = {r["variant"]: r for r in res["variants"]}
    assert set(rows) == VARIANTS
    for r in rows.values():
        assert r["ms"] > 0 and math.isclose(r["steps_per_s"], 1e3 / r["ms"])
        assert r["heldout_after"] < r["heldout_before"], r   # every variant trained
    best = max(("ddp-dense", "ddp-sparse"), key=lambda v: rows[v]["steps_per_s"])
    assert res["best_ddp"] == best
    assert res["ratio"] > 0
    assert math.isclose(res["ratio"], rows["sharded"]["steps_per_s"] / rows[best]["steps_per_s"])
    assert res["goal_met"] == (res["ratio"] >= 1.0)
    assert len(res["peak_MiB_per_rank"]) == 2 and min(res["peak_MiB_per_rank"]) > 0


def test_embedding_trains_where_ddp_does_not_fit():
    # A 205 MB table at 2 ranks, each rank capped at 850 MiB of private memory (about
    # 300 MiB of it taken at start-up): the sharded table (102 MB per rank + its Adam
    # state) trains; DDP's whole table, its gradient and Adam's state do not fit.
    res = _bench("--memory", "--memory-limit", "850", "--ids", "200000", "--batch", "256",
                 "--warmup", "0", "--steps", "2", "--test", "512",
                 "--variants", "sharded,ddp-dense", timeout=150)
    assert res["mode"] == "memory" and res["ranks"] == 2 and res["cap_MiB"] == 850
    rows = {r["variant"]: r for r in res["variants"]}
    assert set(rows) == {"sharded", "ddp-dense"}
    sharded, ddp = rows["sharded"], rows["ddp-dense"]
    assert sharded["fits"] is True and sharded["trained"] is True and sharded["steps"] == 2
    assert sharded["heldout_after"] < sharded["heldout_before"]
    assert ddp["fits"] is False and ddp["trained"] is False
    assert ddp["failed_at"] and ddp["error"]
    assert "allocate memory" in ddp["error"] or "MemoryError" in ddp["error"], ddp
    for r in (sharded, ddp):
        assert len(r["peak_MiB_per_rank"]) == 2 and min(r["peak_MiB_per_rank"]) > 0
        assert max(r["start_data_MiB_per_rank"]) < 850
