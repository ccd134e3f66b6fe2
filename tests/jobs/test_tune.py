"""``mpikv tune`` writes the cache a store then reads; a store without one probes or
uses the measured default."""

import json
import os
import subprocess
import sys

from mpikv.tuning import table as tuning, compression as tuning_compression

from .conftest import ROOT, run_job

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
    # The printout: one row per (size, mode) naming the cached winner, a runner-up.
    for (mode, size), name in table.winners.items():
        label = f"{size >> 10} KiB"
        line = [ln for ln in out.splitlines() if ln.split()[:3] == [*label.split(), mode]]
        assert len(line) == 1, out
        assert line[0].split()[3] == name and " %)" in line[0], line
    assert f"written to {cache / files[0]}" in out
    assert out.count("mpikv tune: 4 KiB ...") == 1       # progress from rank 0 only
    # A store on the same layout uses it (no probe), and still sums right.
    rc, out, _ = run_job(2, SCRIPT, env=_env(cache, "1"))
    assert rc == 0, out
    assert f"SOURCE cache {cache / files[0]}" in out and "OK sums 3.0" in out


def test_store_probes_when_no_cache_and_writes_one(tmp_path):
    cache = tmp_path / "cache"
    rc, out, seconds = run_job(2, SCRIPT, env=_env(cache, "1"))
    assert rc == 0, out
    assert "SOURCE probe at the store's creation (cached in" in out and "OK sums 3.0" in out
    files = _cache_files(cache)
    assert len(files) == 1
    data = json.loads((cache / files[0]).read_text())
    probed = tuning.Table.from_json(data["table"])
    assert {s for (_, s) in probed.winners} <= set(tuning.PROBE_SIZES) and probed.winners
    assert data["key"]["ranks"] == 2
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


def test_tune_json_no_write_and_chosen_sizes(tmp_path):
    rc, out, _ = run_job(2, "-m", "mpikv", "tune", "--sizes", "4K,64K", "--reps", "1",
                         "--json", "--no-write", "--compression",
                         env={**_env(tmp_path, "0"), "MPIKV_TUNE_LABEL": "test-fabric"})
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out                           # rank 0 only
    doc = json.loads(lines[0])
    assert doc["path"] is None and doc["error"] is None and doc["key"]["ranks"] == 2
    assert doc["key"]["label"] == "test-fabric"
    modes = ["in_place", "out_of_place", "to_owners"]
    assert [(r["size"], r["mode"]) for r in doc["rows"]] == [
        (s, m) for s in (4096, 65536) for m in modes]     # no GPU here: no device: rows
    assert all(r["ms"] > 0 and r["runner_up"] for r in doc["rows"])
    assert "16 KiB" not in out and _cache_files(tmp_path) == []
    # compression against the best uncompressed strategy, per size, mode and codec
    assert {(r["size"], r["mode"], r["codec"]) for r in doc["compression"]} == {
        (s, m, "compressed:" + c) for s in (4096, 65536) for m in ("in_place", "to_owners")
        for c in ("2bit", "fp16", "bf16")}
    assert all(r["best"] and r["speedup"] > 0 for r in doc["compression"])
    # one line per codec and mode, each as the summary of the rows printed with it
    assert len(doc["compression_summary"]) == 6
    assert doc["compression_summary"] == tuning_compression.summary(doc["compression"])
    phrases = ("never pays here", "pays at every measured size", "pays from ", "pays up to ",
               "pays at ")
    for line in doc["compression_summary"]:
        codec_mode, _, where = line.partition(": ")
        assert codec_mode.startswith("compressed:") and where.startswith(phrases), line


def test_tune_refuses_bad_arguments_before_starting_mpi():
    for args in (["--reps", "0"], ["--sizes", "3K"], ["--max-bytes", "100", "--sizes", "4K"]):
        proc = subprocess.run([sys.executable, "-m", "mpikv", "tune", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "mpikv tune: error:" in proc.stderr, proc.stderr
