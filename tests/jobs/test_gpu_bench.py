"""``python -m benchmarks gpu`` (as ``python -m mpikv bench gpu``) on the CPU stand-in of cupy.

The stand-in's timings are not GPU figures (the output says so); this checks
that the benchmark runs its cases and reports them, so a GPU session only
has to run it.
"""

import json

from .conftest import run_job

SCRIPT = "tests/jobs/scripts/stand_in.py"


def _bench(n, env=None):
    rc, out, _ = run_job(n, SCRIPT, "benchmarks", "gpu", "--workload", "small1000",
                         "--iterations", "2", "--json", env=env, timeout=180)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("[{")]
    assert len(lines) == 1, out
    return json.loads(lines[0])[0]


def test_staged_on_three_ranks():
    res = _bench(3, env={"MPIKV_CUDA_AWARE": "0"})
    assert res["stand_in"] is True and res["ranks"] == 3 and res["workload"] == "small1000"
    cases = [r["case"] for r in res["rows"]]
    assert cases == ["raw mpi4py Allreduce, staged via pinned host",
                     "mpikv staging Allreduce, whole buffer",
                     "mpikv staging Allreduce, 4096 KiB pieces", "mpikv pushpull(out=...)",
                     "mpikv pushpull in place", "mpikv pushpull, zero-copy",
                     "mpikv pushpull in place, whole-buffer staging"]
    assert all(r["GB/s"] > 0 and r["ms"] > 0 for r in res["rows"])
    assert res["cuda_aware"].startswith("False (MPIKV_CUDA_AWARE=0")
    assert res["nccl"].startswith("not available")


def test_direct_adds_the_device_buffer_baseline():
    res = _bench(2, env={"MPIKV_CUDA_AWARE": "1", "MPIKV_STAGING_PIECE": "65536"})
    assert res["rows"][0]["case"] == "raw mpi4py Allreduce, device buffer"
    cases = [r["case"] for r in res["rows"]]
    # Staging's two ways are timed whatever the store does; the store stages nothing here.
    assert "mpikv staging Allreduce, 64 KiB pieces" in cases
    assert "mpikv pushpull in place, whole-buffer staging" not in cases
    # the store staged beside the store direct, in the same run (issue 41)
    assert cases[-6:] == ["mpikv pushpull(out=...)", "mpikv pushpull in place",
                          "mpikv pushpull, zero-copy", "mpikv pushpull(out=...), staged",
                          "mpikv pushpull in place, staged", "mpikv pushpull, zero-copy, staged"]
    raw = res["rows"][:2]
    fastest = min(raw, key=lambda r: r["ms"])
    assert fastest["vs raw mpi4py"] == 1.0  # ratios are against the fastest raw way
    for r in res["rows"]:
        assert abs(r["vs raw mpi4py"] - fastest["ms"] / r["ms"]) < 1e-9
