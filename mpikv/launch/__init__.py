"""``mpikv run``: start an MPI job the way ``torchrun`` or ``horovodrun`` would.

    mpikv run -n 4 train.py --epochs 3
    mpikv run -n 4 --ft --hosts h1:2,h2:2 train.py
    mpikv run --launcher srun train.py            # inside a SLURM allocation
    mpikv run [--ft] --mpiexec MPIEXEC-ARGS...    # scripts/mpirun.sh: mpiexec's own arguments

It finds the environment's MPI (the Python environment's Open MPI or MPICH wheel
first, then a system ``mpiexec``, or ``srun`` inside an allocation when there is no
``mpiexec``), adds what this machine needs (oversubscription, running as root,
ULFM and the failure detector for ``--ft``; :mod:`.environment`), refuses what
would start silently wrong (:mod:`.plan`), and supervises Open MPI's ``mpiexec`` so
that a SIGTERM gives the ranks time to save (:mod:`.supervisor`). docs/launching.md.
"""

import argparse
import os
import sys

from . import plan, supervisor

USAGE = "mpikv run [-n N] [--ft] [--hosts H:N,...] [--launcher L] [options] PROGRAM [ARGS]"


def parser():
    """The argument parser of ``mpikv run`` (everything after PROGRAM is its own)."""
    p = argparse.ArgumentParser(
        prog="mpikv run", usage=USAGE,
        description="Start PROGRAM on N MPI ranks (a .py file or -m MODULE runs with this "
                    "Python; anything else is run as it is).")
    p.add_argument("-n", "--np", dest="n", type=int,
                   help="ranks (default: the --hosts counts' sum, else SLURM_NTASKS)")
    p.add_argument("--ft", action="store_true",
                   help="fault tolerant: Open MPI's ULFM and failure detector "
                        "(MPIKV_FT_DETECTOR_TIMEOUT, default 10 s)")
    p.add_argument("--hosts", help="hosts and ranks on each, h1:2,h2:2")
    p.add_argument("--launcher", choices=("auto", "mpiexec", "srun"), default="auto",
                   help="auto (default): mpiexec if there is one, else srun in an allocation")
    p.add_argument("--mpi-args", default="", metavar="'ARGS'",
                   help="more arguments for mpiexec or srun, in one string: "
                        "--mpi-args='--bind-to none' (horovodrun's option)")
    p.add_argument("--grace", type=float,
                   default=float(os.environ.get("MPIKV_TERM_GRACE", "120")),
                   help="seconds after a SIGTERM before ranks still running are killed "
                        "(default MPIKV_TERM_GRACE or 120)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command and the variables it adds; start nothing")
    p.add_argument("-m", dest="module", metavar="MODULE",
                   help="run a module with this Python, as python -m (what follows is its)")
    p.add_argument("--mpiexec", dest="raw", nargs=argparse.REMAINDER,
                   help="everything after it is mpiexec's (options and program)")
    p.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def parse(argv):
    """The options of ``argv``; the program's own options are left to it."""
    argv, module_args = _split_module(list(argv))
    opts = parser().parse_args(argv)
    if opts.module is not None:
        opts.program = [*opts.program, *module_args]
    if opts.raw is not None and opts.program:
        opts.raw, opts.program = opts.raw + opts.program, []
    if opts.program[:1] == ["--"]:
        opts.program = opts.program[1:]
    if opts.module:
        opts.program = ["-m", opts.module, *opts.program]
    import shlex
    opts.mpi_args = shlex.split(opts.mpi_args)
    if opts.raw is not None and not opts.raw:
        raise plan.Refusal("--mpiexec: give mpiexec's arguments after it")
    return opts


#: options of ``mpikv run`` that take a value (the next argument, unless given with =)
VALUED = {"-n", "--np", "--hosts", "--launcher", "--mpi-args", "--grace"}


def _split_module(argv):
    """``(mpikv's arguments up to -m MODULE, MODULE's own arguments)``."""
    i = 0
    while i < len(argv):
        if argv[i] in ("--mpiexec", "--"):
            break
        if argv[i] == "-m":
            return argv[:i + 2], argv[i + 2:]
        if not argv[i].startswith("-"):
            break
        i += 2 if argv[i] in VALUED else 1
    return argv, []


def main(argv=None):
    """Runs ``mpikv run``; returns the job's status (2: refused, nothing started)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        opts = parse(argv)
        job = plan.make_plan(opts, plan.Machine(environ=dict(os.environ), uid=os.getuid()))
    except (plan.Refusal, ValueError) as exc:
        print(f"mpikv run: {exc}", file=sys.stderr)
        return 2
    if opts.dry_run:
        for name, value in sorted(job.added.items()):
            print(f"{name}={value}")
        print(" ".join(_quoted(a) for a in job.cmd))
        return 0
    env = dict(os.environ, **job.added)
    try:
        return supervisor.run(job.cmd, env, opts.grace, block_term=job.block_term)
    except OSError as exc:
        print(f"mpikv run: cannot start {job.cmd[0]}: {exc}", file=sys.stderr)
        return 127


def _quoted(text):
    import shlex
    return shlex.quote(text)


__all__ = ["USAGE", "parser", "parse", "main"]
