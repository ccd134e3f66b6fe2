"""``mpikv run``'s plan on machines described by tests (mpikv/launch): which launcher,
which command, which variables, and each launch mistake refused before anything
starts. Nothing is run here: the machine's answers (``mpiexec --version``, ``srun
--mpi=list``, the ranks' MPI library) are the tests' own."""

import pytest

from mpikv.launch import environment, libraries, parse
from mpikv.launch.plan import AGENT, Machine, Refusal, make_plan, parse_hosts

OPEN_MPI_EXEC = "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/\n"
OPEN_MPI_LIB = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
OPEN_MPI_4_LIB = "Open MPI v4.1.5, package: Debian OpenMPI, ident: 4.1.5, repo rev: v4.1.5"
MPICH_EXEC = "HYDRA build details:\n    Version:                                 4.2.0\n"
MPICH_LIB = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024\n"
SRUN_LIST = "MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n" \
            "specific pmix plugin versions available: pmix_v4\n"
SRUN_NO_PMIX = "MPI plugin types are...\n\tnone\n\tpmi2\n"
PY = "/venv/bin/python"


def machine(programs=("mpiexec",), exec_text=OPEN_MPI_EXEC, lib_text=OPEN_MPI_LIB,
            srun_text=SRUN_LIST, uid=0, **environ):
    """A machine whose PATH holds ``programs`` (in /venv/bin) and which answers so."""
    env = {"PATH": "/venv/bin:/usr/bin", **environ}

    def which(name, path):
        if name.startswith("/"):
            return name
        if name in programs or name == "python":
            return f"/venv/bin/{name}"
        return None

    def ask(cmd, env=None):
        if cmd[-1] == "--version":
            return exec_text
        if cmd[-1] == "--mpi=list":
            return srun_text
        if cmd[1:2] == ["-c"]:
            return lib_text
        raise AssertionError(cmd)

    return Machine(environ=env, uid=uid, python=PY, which=which, ask=ask,
                   driver_loads=lambda: False)


def plan(argv, **kw):
    return make_plan(parse(argv), machine(**kw))


# -- the commands -----------------------------------------------------------------------
def test_a_script_runs_with_this_python_under_open_mpi():
    job = plan(["-n", "4", "train.py", "--epochs", "3"])
    assert job.launcher == "mpiexec" and job.block_term
    assert job.cmd == ["/venv/bin/mpiexec", "--prtemca", "prte_launch_agent",
                       f"{PY} {AGENT}", "-n", "4", PY, "train.py", "--epochs", "3"]
    assert job.added["MPIKV_RUN_NP"] == "4"
    assert job.added["OMPI_ALLOW_RUN_AS_ROOT"] == "1"           # uid 0
    assert job.added["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"


def test_ft_and_hosts():
    job = plan(["--ft", "--hosts", "h1:2,h2:2", "train.py"])
    assert job.cmd[:11] == ["/venv/bin/mpiexec", "--with-ft", "ulfm", "--mca",
                            "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_timeout",
                            "10", "--mca", "mpi_ft_detector_period"]
    assert job.cmd[11] == "2.5"
    assert job.cmd[-5:] == ["4", "--host", "h1:2,h2:2", PY, "train.py"]   # -n: the sum


def test_a_module_and_its_own_options():
    job = plan(["-n", "2", "-m", "pkg.train", "-n", "7", "--ft"])
    assert job.cmd[-6:] == [PY, "-m", "pkg.train", "-n", "7", "--ft"]
    assert "--with-ft" not in job.cmd and job.added["MPIKV_RUN_NP"] == "2"


def test_mpiexec_mode_passes_every_argument_through():
    job = plan(["--ft", "--mpiexec", "-n", "3", "--bind-to", "none", "python", "x.py"])
    assert job.cmd[-6:] == ["-n", "3", "--bind-to", "none", "python", "x.py"]
    assert "--with-ft" in job.cmd and "MPIKV_RUN_NP" not in job.added


def test_mpi_args_and_a_command_that_is_not_python():
    job = plan(["-n", "2", "--mpi-args=--bind-to none", "hostname"])
    assert job.cmd[-5:] == ["-n", "2", "--bind-to", "none", "hostname"]


def test_variables_the_environment_sets_win():
    job = plan(["-n", "2", "x.py"], uid=1000, OMPI_MCA_btl="tcp,self")
    assert "OMPI_MCA_btl" not in job.added and "OMPI_ALLOW_RUN_AS_ROOT" not in job.added


def test_mpich_gets_hydra_options_and_no_agent():
    job = plan(["--hosts", "a:1,b:3", "x.py"], exec_text=MPICH_EXEC, lib_text=MPICH_LIB)
    assert not job.block_term and "--prtemca" not in job.cmd
    assert job.cmd == ["/venv/bin/mpiexec", "-n", "4", "-hosts", "a:1,b:3", PY, "x.py"]
    assert not any(k.startswith("OMPI_") for k in job.added)


def test_srun_inside_an_allocation_without_mpiexec():
    job = plan(["x.py"], programs=("srun",), SLURM_JOB_ID="7", SLURM_NTASKS="6")
    assert job.launcher == "srun" and not job.block_term
    assert job.cmd == ["/venv/bin/srun", "--mpi=pmix", "-n", "6", PY, "x.py"]
    assert job.added["PMIX_MCA_psec"] == "native"


def test_srun_hosts_of_equal_counts():
    job = plan(["--launcher", "srun", "--hosts", "n1:2,n2:2", "x.py"],
               programs=("srun", "mpiexec"), SLURM_JOB_ID="7")
    assert job.cmd[:7] == ["/venv/bin/srun", "--mpi=pmix", "-n", "4", "-w", "n1,n2",
                           "--ntasks-per-node=2"]
    assert job.added["OPAL_PREFIX"] == "/venv"   # the wheel's prefix, which srun bypasses


def test_mpich_under_srun_takes_pmi2_where_there_is_no_pmix():
    job = plan(["-n", "2", "x.py"], programs=("srun",), lib_text=MPICH_LIB,
               srun_text=SRUN_NO_PMIX, SLURM_JOB_ID="7")
    assert job.cmd[1] == "--mpi=pmi2"


# -- the refusals -----------------------------------------------------------------------
REFUSALS = [
    ("libraries differ", ["-n", "2", "x.py"], dict(lib_text=MPICH_LIB),
     "is Open MPI 5.0.11, but the ranks' Python"),
    ("versions differ", ["-n", "2", "x.py"], dict(lib_text=OPEN_MPI_4_LIB),
     "mpi4py on Open MPI 4.1.5"),
    ("srun without PMIx for Open MPI", ["-n", "2", "x.py"],
     dict(programs=("srun",), srun_text=SRUN_NO_PMIX, SLURM_JOB_ID="1"),
     "none of which Open MPI 5.0.11 speaks"),
    ("--ft under srun", ["--ft", "-n", "2", "x.py"],
     dict(programs=("srun",), SLURM_JOB_ID="1"), "--ft needs Open MPI's mpiexec"),
    ("--ft with MPICH", ["--ft", "-n", "2", "x.py"],
     dict(exec_text=MPICH_EXEC, lib_text=MPICH_LIB), "--ft needs Open MPI's ULFM"),
    ("no launcher", ["-n", "2", "x.py"], dict(programs=()), "no mpiexec on PATH"),
    ("srun asked, none there", ["--launcher", "srun", "-n", "2", "x.py"], {},
     "--launcher srun: no srun"),
    ("no count", ["x.py"], {}, "how many ranks?"),
    ("zero ranks", ["-n", "0", "x.py"], {}, "-n 0: give a positive number"),
    ("no program", ["-n", "2"], {}, "no program"),
    ("a bad host count", ["--hosts", "h1:0", "x.py"], {}, "needs a positive count"),
    ("unequal hosts for srun", ["--launcher", "srun", "--hosts", "a:1,b:2", "x.py"],
     dict(programs=("srun",), SLURM_JOB_ID="1"), "the same number of tasks on each node"),
    ("a bad detector timeout", ["--ft", "-n", "2", "x.py"],
     dict(MPIKV_FT_DETECTOR_TIMEOUT="soon"), "MPIKV_FT_DETECTOR_TIMEOUT='soon'"),
]


@pytest.mark.parametrize("argv, kw, said", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_refused(argv, kw, said):
    with pytest.raises((Refusal, ValueError)) as info:
        plan(argv, **kw)
    assert said in str(info.value)


def test_main_refuses_with_status_2_and_starts_nothing(capsys):
    from mpikv import launch
    assert launch.main(["-n", "0", "nowhere.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpikv run: -n 0: give a positive number") and "nowhere" not in err


# -- the parts --------------------------------------------------------------------------
def test_library_parsers():
    assert libraries.launcher_library(OPEN_MPI_EXEC) == libraries.Library("Open MPI", "5.0.11")
    assert libraries.launcher_library(MPICH_EXEC) == libraries.Library("MPICH", "4.2.0")
    assert libraries.python_library(MPICH_LIB) == libraries.Library("MPICH", "4.2.0")
    assert libraries.python_library("") == libraries.Library("unknown")
    assert not libraries.Library("unknown").differs_from(libraries.Library("MPICH", "4"))
    assert libraries.srun_plugins(SRUN_LIST) == ["pmix", "none", "cray_shasta", "pmi2"]
    assert libraries.srun_plugin_for(libraries.Library("Open MPI", "5"), ["pmix_v4"]) == "pmix"
    assert libraries.srun_plugin_for(libraries.Library("Open MPI", "5"), ["pmi2"]) is None


def test_hosts_and_shell_lines():
    assert parse_hosts("a:2, b") == [("a", 2), ("b", 1)]
    lines = environment.shell_lines({"MPIKV_FT_DETECTOR_TIMEOUT": "4"}, 0)
    assert "export OMPI_ALLOW_RUN_AS_ROOT=1" in lines
    assert lines[-1].startswith("ft_args=(--with-ft ulfm") and "timeout 4 " in lines[-1]
    assert "mpi_ft_detector_period 1)" in lines[-1]


def test_a_moved_prefix_comes_first(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "python").mkdir()
    mpiexec = tmp_path / "bin" / "mpiexec"
    mpiexec.write_text("#!/bin/sh\n")
    mpiexec.chmod(0o755)
    added = environment.prefix_variables({"PATH": "/usr/bin"}, str(tmp_path), False)
    assert added["PATH"] == f"{tmp_path}/bin:/usr/bin" and added["OPAL_PREFIX"] == str(tmp_path)
    assert added["PYTHONPATH"] == f"{tmp_path}/python"
    assert added["OMPI_MCA_mca_base_component_show_load_errors"] == environment.CUDA_PLUGINS
    with pytest.raises(Refusal, match="has no bin/mpiexec"):
        plan(["-n", "2", "x.py"], MPIKV_MPI_PREFIX=str(tmp_path / "nowhere"))


# -- torch's env:// for an unchanged dist.init_process_group ------------------------------
def test_torchs_master_is_rank_0s_host():
    local = plan(["-n", "2", "x.py"]).added
    assert local["MASTER_ADDR"] == "127.0.0.1" and 0 < int(local["MASTER_PORT"]) < 65536
    hosts = plan(["--hosts", "h1:2,h2:2", "x.py"]).added
    assert (hosts["MASTER_ADDR"], hosts["MASTER_PORT"]) == ("h1", "29500")
    given = plan(["-n", "2", "x.py"], MASTER_ADDR="a", MASTER_PORT="7").added
    assert "MASTER_ADDR" not in given and "MASTER_PORT" not in given
    assert "MASTER_ADDR" not in plan(["--mpiexec", "-n", "2", "x.py"]).added


def test_the_ranks_variables_come_from_the_launchers():
    from mpikv_torch_backend import rank_variables
    ompi = {"MPIKV_RUN_NP": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert rank_variables(ompi) == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                                    "LOCAL_WORLD_SIZE": "2"}
    srun = {"MPIKV_RUN_NP": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "1"}
    assert rank_variables(srun) == {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"}
    hydra = {"MPIKV_RUN_NP": "2", "PMI_RANK": "1", "PMI_SIZE": "2", "RANK": "9"}
    assert rank_variables(hydra) == {"WORLD_SIZE": "2"}          # what is set stays
    assert rank_variables({"OMPI_COMM_WORLD_RANK": "1"}) == {}   # not mpikv run's
