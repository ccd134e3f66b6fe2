"""``mpikv tune`` writes the cache a store then reads; a store without one probes or
uses the measured default."""

import json
import os

from mpikv import tuning

from .conftest import run_job

SCRIPT = "tests/jobs/scripts/tuned_store.py"


def _env(cache, autotune):
    return {"MPIKV_CACHE_DIR": str(cache), "MPIKV_AUTOTUNE": autotune, "MPIKV_TIMEOUT": "60"}


def _cache_files(cache):
    return sorted(p for p in os.listdir(cache) if p.endswith(".json")) if cache.exists() else []


def test_tune_writes_the_cache_that_stores_then_read(tmp_path):
    cache = tmp_path / "cache"
    rc, out, _ = run_job(2, "-m", "mpikv", "tune", "--max-bytes", "65536", "--reps", "1",
                         env=_env(cache, "0"))
    assert rc == 0, out
    files = _cache_files(cache)
    assert len(files) == 1, out
    data = json.loads((cache / files[0]).read_text())
    assert data["key"]["ranks"] == 2
    table = tuning.Table.from_json(data["table"])
    assert {s for (_, s) in table.winners} == {4096, 16384, 65536}
    for (mode, size), name in table.winners.items():
        assert f"{name}" in out           # the printout names each winner
    assert "written to" in out
    # A store on the same layout uses it (no probe), and still sums right.
    rc, out, _ = run_job(2, SCRIPT, env=_env(cache, "1"))
    assert rc == 0, out
    assert f"SOURCE cache {cache / files[0]}" in out and "OK sums 3.0" in out


def test_store_probes_when_no_cache_and_writes_one(tmp_path):
    cache = tmp_path / "cache"
    rc, out, seconds = run_job(2, SCRIPT, env=_env(cache, "1"))
    assert rc == 0, out
    assert "SOURCE probe at the store's creation (cached in" in out and "OK sums 3.0" in out
    assert len(_cache_files(cache)) == 1
    rc, out, _ = run_job(2, SCRIPT, env=_env(cache, "1"))   # the next job reads it
    assert rc == 0 and "SOURCE cache" in out, out


def test_without_probe_or_cache_the_measured_default_is_used(tmp_path):
    cache = tmp_path / "cache"
    rc, out, _ = run_job(3, SCRIPT, env=_env(cache, "0"))
    assert rc == 0, out
    assert "SOURCE measured default" in out and "OK sums 6.0" in out
    assert _cache_files(cache) == []


def test_forced_reducer_wins_over_the_cache(tmp_path):
    rc, out, _ = run_job(2, SCRIPT, env={**_env(tmp_path, "1"), "MPIKV_REDUCER": "reduce_scatter"})
    assert rc == 0, out
    assert "SOURCE forced: reducer=reduce_scatter" in out and "OK sums 3.0" in out
    assert _cache_files(tmp_path) == []
