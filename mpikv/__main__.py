"""``python -m mpikv COMMAND [ARGS]``: tools that come with mpikv."""

import sys

USAGE = """\
usage: python -m mpikv COMMAND [ARGS]

commands:
  info [--json]      versions, MPI library, ranks per host, CUDA-aware MPI, settings
  bench WHAT [...]   benchmarks against raw mpi4py (python -m mpikv bench -h)
  tune [...]         measure every reduction strategy here, cache the table (mpikv tune -h)
  trace DIR          merge the flight recorders a job ended by mpikv wrote to MPIKV_TRACE_DIR

Run under mpiexec for a distributed view, e.g.
  scripts/mpirun.sh -n 2 python -m mpikv info"""


def main(argv=None):
    """Dispatches to a command; returns the exit code (2 for a missing or unknown command)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if command == "info":
        from .info import main as info_main
        return info_main(rest)
    if command == "tune":
        from .tune import main as tune_main
        return tune_main(rest)
    if command == "trace":
        from .flight import main as trace_main
        return trace_main(rest)
    if command == "bench":
        from .bench import main as bench_main
        return bench_main(rest)
    print(f"{USAGE}\n\npython -m mpikv: unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
