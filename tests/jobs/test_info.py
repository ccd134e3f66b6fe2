"""``python -m mpikv info`` under mpiexec and alone, and the ``python -m mpikv`` dispatch."""

import json
import os
import subprocess
import sys

from mpikv import __main__ as cli
from mpikv.tuning import table as tuning
from mpikv.tools.info import cuda_aware

from .conftest import ROOT, run_job

KEYS = {"mpikv", "python", "python_executable", "numpy", "mpi4py", "mpi_library",
        "mpi_standard", "thread_level", "size", "hosts", "cuda_aware_mpi",
        "cuda_aware_mpi_source", "cupy", "torch", "settings", "tuning"}
OPEN_MPI = "Open MPI v5.0.11, package: Open MPI"


def _module(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mpikv", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, **(env or {})))


def test_json_on_two_ranks_is_one_object_from_rank_0():
    rc, out, _ = run_job(2, "-m", "mpikv", "info", "--json", env={"MPIKV_TIMEOUT": "30"})
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out  # only rank 0 prints
    info = json.loads(lines[0])
    assert KEYS <= set(info)
    assert info["size"] == 2
    # The strategy table in force, where it came from, one row per size class.
    assert len(info["tuning"]["rows"]) == 9 and info["tuning"]["source"]
    assert all(len(row) == 4 for row in info["tuning"]["rows"])   # size, 3 columns
    assert sorted(r for ranks in info["hosts"].values() for r in ranks) == [0, 1]
    assert "Open MPI" in info["mpi_library"] and not info["mpi_library"].endswith("\x00")
    assert info["mpi_standard"].count(".") == 1
    assert info["thread_level"].startswith("MPI_THREAD_")
    assert info["cuda_aware_mpi"] in (True, False, None)
    assert set(info["torch"]) >= {"importable", "version"}
    settings = info["settings"]
    assert settings["timeout"] == {"value": 30.0, "source": "MPIKV_TIMEOUT"}
    assert settings["bigarray_bound"]["source"] == "default"
    assert settings["log_level"]["value"] == "WARNING"


def _info_json(n, env):
    rc, out, _ = run_job(n, "-m", "mpikv", "info", "--json", env=env)
    assert rc == 0, out
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def test_the_table_in_force_comes_from_the_cache_or_the_default(tmp_path):
    env = {"MPIKV_CACHE_DIR": str(tmp_path), "MPIKV_AUTOTUNE": "0"}
    tune = _info_json(2, env)["tuning"]
    assert tune["source"].startswith(
        "no cache: a store would probe at creation (MPIKV_AUTOTUNE=1) or use the measured default")
    assert "MPIKV_AUTOTUNE=0 here" in tune["source"]
    assert os.path.dirname(tune["cache_path"]) == str(tmp_path)
    assert tune["key"]["ranks"] == 2 and tune["key"]["ranks_per_node"] == [2]
    assert tune["rows"] == [list(r) for r in tuning.default_table().rows()]
    assert os.listdir(tmp_path) == []                     # info never probes nor writes
    # A cache for that key (as `mpikv tune` would write it) is what info then shows.
    table = tuning.Table({("in_place", 4096): "reduce_scatter",
                          ("out_of_place", 4096): "copy+reduce_bcast",
                          ("to_owners", 4096): "hierarchical"}, "hand-made")
    assert tuning.write_cache(tune["cache_path"], tune["key"], table) is None
    again = _info_json(2, env)["tuning"]
    assert again["source"].startswith(f"cache {tune['cache_path']} (hand-made, ")
    assert again["rows"] == [list(r) for r in table.rows()]
    assert again["rows"][-1] == [256 << 20, "reduce_scatter", "copy+reduce_bcast", "hierarchical"]
    rc, out, _ = run_job(2, "-m", "mpikv", "info", env=env)
    assert rc == 0, out
    assert f"strategies:     cache {tune['cache_path']}" in out
    assert f"  cache file:   {tune['cache_path']}" in out and "  cache key:    " in out
    assert "      4 KiB  reduce_scatter         copy+reduce_bcast" in out


def test_a_forced_reducer_or_one_rank_needs_no_table(tmp_path):
    env = {"MPIKV_CACHE_DIR": str(tmp_path), "MPIKV_REDUCER": "copy+reduce_bcast"}
    tune = _info_json(2, env)["tuning"]
    assert tune["source"] == "forced: reducer=copy+reduce_bcast" and tune["cache_path"] is None
    assert {(r[1], r[2]) for r in tune["rows"]} == {("reduce_bcast", "copy+reduce_bcast")}
    proc = _module("info", "--json", env={"MPIKV_CACHE_DIR": str(tmp_path)})   # no mpiexec
    assert proc.returncode == 0, proc.stderr
    tune = json.loads(proc.stdout)["tuning"]
    assert tune["source"] == "one rank: nothing to tune" and tune["key"] is None
    assert {(r[1], r[2]) for r in tune["rows"]} == {("allreduce", "allreduce")}


def test_text_on_two_ranks_names_the_rank_count():
    rc, out, _ = run_job(2, "-m", "mpikv", "info")
    assert rc == 0, out
    assert out.count("mpikv:") == 1, out
    assert "ranks:          2" in out
    assert "MPI library:    Open MPI" in out
    assert "CUDA-aware MPI: " in out


def test_cuda_aware_override_and_ompi_info(tmp_path):
    assert cuda_aware(OPEN_MPI, {"MPIKV_CUDA_AWARE": "1"}) == (True, "MPIKV_CUDA_AWARE=1")
    assert cuda_aware("MPICH 4.2", {"MPIKV_CUDA_AWARE": "0"})[0] is False
    assert cuda_aware("MPICH 4.2", {})[0] is None
    assert cuda_aware(OPEN_MPI, {"MPIKV_CUDA_AWARE": "maybe"}) == (
        None, "MPIKV_CUDA_AWARE='maybe' is not 0, 1 or pull")
    assert cuda_aware(OPEN_MPI, {"MPIKV_CUDA_AWARE": "pull"})[0] is True
    assert cuda_aware("MPI VERSION : CRAY MPICH version 8.1.28", {}) == (
        False, "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1")
    assert cuda_aware("MPICH Version: 4.2.0", {"MPIR_CVAR_ENABLE_GPU": "0"})[0] is False
    fake = tmp_path / "ompi_info"
    line = "mca:mpi:base:param:mpi_built_with_cuda_support:value:true"  # Open MPI 4's name
    fake.write_text(f"#!/bin/sh\necho '{line}'\n")
    fake.chmod(0o755)
    aware, how = cuda_aware(OPEN_MPI, {}, ompi_info=str(fake))
    assert aware is True and str(fake) in how


def test_no_command_prints_usage_and_bench_is_forwarded():
    proc = _module()
    assert proc.returncode == 2 and "usage: python -m mpikv COMMAND" in proc.stderr
    proc = _module("nonsense")
    assert proc.returncode == 2 and "unknown command 'nonsense'" in proc.stderr
    proc = _module("bench", "--help")
    assert proc.returncode == 0 and "python -m mpikv bench" in proc.stdout


def test_bench_finds_the_clone_or_says_where_the_benchmarks_live(monkeypatch, tmp_path, capsys):
    assert cli.BENCHMARKS == ROOT / "benchmarks"  # beside the package: this clone's
    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path / "benchmarks")  # installed, no clone
    assert cli.main(["bench", "--help"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "benchmarks/ directory" in err
