"""scripts/gpu-check.sh on a machine without a GPU: its steps, order, summary and
deadline (dry, out of time, and the GPU steps skipped for want of a GPU); and
``MPIKV_TEST_GPU=1`` (tests/conftest.py) against a fake cupy that "sees" a GPU."""

import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu-check.sh"
STEPS = ["probe", "unit-real-cupy", "store-staged-2", "store-direct-2", "trainer-cuda-2",
         "trainer-direct-2", "backend-direct-2", "stream-race-2", "bf16-casts", "bench-gpu-2",
         "bench-gpu-1", "bench-gpu-direct-2", "bench-gpu-smcuda-2", "mpi-device-rest"]


def _run(tmp_path, *args, env=None, timeout=120):
    out = tmp_path / "out"
    full = dict(os.environ, MPIKV_PYTHON=sys.executable,
                MPIKV_GPU_WHEELS_DIR=str(tmp_path / "no-wheels"), **(env or {}))
    full.pop("OUT", None)
    proc = subprocess.run(["bash", str(SCRIPT), str(out), *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)
    lines = (out / "summary.tsv").read_text().splitlines()
    assert lines[0] == "step\trc\tseconds\tnote"
    rows = [line.split("\t") for line in lines[1:]]
    return proc, rows, out


def test_dry_run_lists_every_step_in_order(tmp_path):
    proc, rows, out = _run(tmp_path, "--dry", timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r[0] for r in rows] == STEPS + ["total"]
    assert all(r[1:] == ["-", "0", "dry"] for r in rows[:-1])
    assert rows[-1][1] == "0"
    logs = sorted(p.name for p in out.glob("*.log"))
    assert logs == [f"{i:02d}-{name}.log" for i, name in enumerate(STEPS, 1)]
    stress = (out / "08-stream-race-2.log").read_text()
    assert "MPIKV_CUDA_AWARE=0" in stress and "tests/gpu/test_stream_race.py" in stress
    assert "--with-mpi" in stress and "-n 2" in stress
    # the direct steps leave the path to the detection, and insist it says CUDA-aware
    direct = (out / "04-store-direct-2.log").read_text()
    assert "MPIKV_CUDA_AWARE=0" not in direct and "MPIKV_EXPECT_CUDA_AWARE=1" in direct
    assert "tests/gpu/test_cuda_aware_mpi.py" in direct
    assert "OMPI_MCA_btl=smcuda,self" in (out / "13-bench-gpu-smcuda-2.log").read_text()
    backend = (out / "07-backend-direct-2.log").read_text()
    assert "MPIKV_EXPECT_CUDA_AWARE=1" in backend and "test_process_group.py" in backend


def test_a_prefix_without_mpiexec_is_not_used(tmp_path):
    proc, rows, _ = _run(tmp_path, env={"MPIKV_GPU_CHECK_BUDGET": "0",
                                        "MPIKV_MPI_PREFIX": str(tmp_path / "no-mpi")},
                         timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "has no bin/mpiexec; not used" in proc.stderr
    assert "cuda-aware MPI: none" in proc.stdout


def test_out_of_time_skips_the_rest(tmp_path):
    proc, rows, _ = _run(tmp_path, env={"MPIKV_GPU_CHECK_BUDGET": "0"}, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r[3] for r in rows[:-1]] == ["skipped: out of time"] * len(STEPS)


def test_without_a_gpu_the_probe_runs_and_the_rest_is_skipped(tmp_path):
    if subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0:
        pytest.skip("this machine has a GPU")
    proc, rows, out = _run(tmp_path, env={"OUT": str(tmp_path / "ignored")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows[0][:2] == ["probe", "0"], rows
    assert [r[3] for r in rows[1:-1]] == ["skipped: no GPU"] * (len(STEPS) - 1)
    probe = (out / "01-probe.log").read_text()
    assert "mpi4py" in probe and "detect(): Decision(" in probe and "CUDA-aware MPI:" in probe
    assert int(rows[-1][2]) < 60


# -- MPIKV_TEST_GPU=1: real cupy only, no quiet skips ----------------------------------
FAKE_CUPY = """
STAND_IN = False
class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1
class cuda:
    runtime = _Runtime
"""
CASES = """
import pytest

@pytest.fixture(params=["cupy", "stand-in", "stand-in-direct"])
def way(request):
    return request.param

def test_way(way):
    assert way == "cupy"

def test_needs_a_gpu():
    pytest.skip("cupy not installed / no GPU")

def test_other_skip():
    pytest.skip("needs 2 GPUs")
"""


def _pytest(tmp_path, env):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "cupy.py").write_text(textwrap.dedent(FAKE_CUPY))
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "test_cases.py").write_text(CASES)
    full = dict(os.environ, PYTHONPATH=str(fake), **env)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                           "-p", "no:cacheprovider", str(tests), "-rfs"],
                          cwd=tmp_path, env=full, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def test_gpu_switch_deselects_the_stand_in_and_fails_quiet_skips(tmp_path):
    rc, out = _pytest(tmp_path, {"MPIKV_TEST_GPU": "1"})
    assert rc == 1, out
    assert "1 failed, 1 passed, 1 skipped, 2 deselected" in out, out
    assert "yet skipped for want of a GPU" in out and "no GPU" in out, out


def test_without_the_switch_nothing_changes(tmp_path):
    rc, out = _pytest(tmp_path, {"MPIKV_TEST_GPU": ""})
    assert "2 failed, 1 passed, 2 skipped" in out, out


def test_gpu_switch_stops_without_cupy(tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "cupy.py").write_text("raise ImportError('no cupy here')\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "test_x.py").write_text("def test_x():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests)], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "fake"),
                                   MPIKV_TEST_GPU="1"), timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "MPIKV_TEST_GPU=1 but cupy with a GPU is not there" in proc.stdout + proc.stderr
