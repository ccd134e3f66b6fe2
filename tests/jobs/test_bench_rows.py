"""``python -m mpikv bench rows`` (issue 23) end to end, tiny, at 2 ranks.

The figures of a few iterations mean nothing; this checks that the run verifies
the rows it moves (mpikv's and raw mpi4py's pulls equal the table, a push leaves
both tables alike), that the cases and ratios are consistent, and that the
memory mode reports each rank's peak RSS against its goal.
"""

import json

from .conftest import run_job


def _bench(*args):
    rc, out, _ = run_job(2, "-m", "mpikv", "bench", "rows", *args, "--json",
                         env={"MPIKV_AUTOTUNE": "0"}, timeout=180)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_rows_pull_and_push_against_raw():
    res = _bench("--rows", "5000", "--dim", "8", "--k", "1024", "--iterations", "3")
    assert res["ranks"] == 2 and res["iterations"] == 3 and res["library"]
    assert res["verified"] is True
    assert res["rows"] == 5000 and res["dim"] == 8 and res["k"] == 1024
    assert 0 < res["unique_ids_per_rank_max"] <= 1024
    assert res["bytes_per_step_per_rank"] == res["unique_ids_per_rank_max"] * (8 * 4 + 8)
    assert set(res["ms"]) == {"raw pull", "mpikv row_sparse_pull",
                              "raw push, two Alltoallv (ids, rows)",
                              "raw push, one Alltoallv (bytes)",
                              "raw push, two Alltoallv, numpy only (reduceat)",
                              "mpikv push(RowSparse)"}
    assert all(ms > 0 for ms in res["ms"].values())
    pull, push = res["results"]
    assert pull["op"] == "pull" and pull["raw"] == "raw pull"
    raws = [k for k in res["ms"] if k.startswith("raw push")]
    assert push["op"] == "push" and push["raw"] == min(raws, key=res["ms"].get)
    for r in (pull, push):
        assert abs(r["raw/mpikv"] - r["raw_ms"] / r["ms"]) < 1e-9
        assert abs(r["mpikv/raw"] * r["raw/mpikv"] - 1) < 1e-9
        assert r["goal_met"] == (r["raw/mpikv"] >= 0.8)
    assert len(res["peak_MiB_per_rank"]) == 2


def test_rows_memory_mode():
    res = _bench("--memory", "--rows", "20000", "--dim", "16", "--k", "512")
    assert res["ranks"] == 2 and res["verified"] is True and res["steps"] == 3
    assert abs(res["table_MB"] - 20000 * 16 * 4 / 1e6) < 1e-9
    assert abs(res["goal_MB_per_rank"] - (res["table_MB"] / 2 + 400)) < 1e-9
    assert len(res["peak_MB_per_rank"]) == 2 and min(res["peak_MB_per_rank"]) > 0
    assert res["goal_met"] == (max(res["peak_MB_per_rank"]) <= res["goal_MB_per_rank"])
