"""``python -m mpikv COMMAND [ARGS]``: tools that come with mpikv."""

import sys
from pathlib import Path

#: The benchmarks live beside the package in a clone (the repository's benchmarks/).
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

USAGE = """\
usage: python -m mpikv COMMAND [ARGS]   (or mpikv --version)

commands:
  run [-n N] [--ft] [--hosts H:N,...] PROGRAM [ARGS]
                     start PROGRAM on N MPI ranks (mpikv run -h; docs/launching.md)
  info [--json]      versions, MPI library, ranks per host, CUDA-aware MPI, settings
  bench WHAT [...]   benchmarks against raw mpi4py, from a clone (python -m mpikv bench -h)
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
    if command in ("-V", "--version", "version"):
        from ._version import __version__
        print(f"mpikv {__version__} ({Path(__file__).resolve().parent})")
        return 0
    if command == "run":
        from .launch import main as run_main
        return run_main(rest)
    if command == "info":
        from .tools.info import main as info_main
        return info_main(rest)
    if command == "tune":
        from .tools.tune import main as tune_main
        return tune_main(rest)
    if command == "trace":
        from .flight import main as trace_main
        return trace_main(rest)
    if command == "bench":
        return _bench(rest)
    print(f"{USAGE}\n\npython -m mpikv: unknown command {command!r}", file=sys.stderr)
    return 2


def _bench(argv):
    """Runs the clone's ``benchmarks/bench.py``; without a clone, says where they live."""
    if not (BENCHMARKS / "bench.py").is_file():
        print(f"python -m mpikv bench: the benchmarks are not part of the installed package "
              f"(no {BENCHMARKS}). They live in the benchmarks/ directory of mpikv's "
              f"repository: clone it, then run python -m mpikv bench from the clone (with "
              f"mpikv installed from it, pip install -e .) or python benchmarks/bench.py there.",
              file=sys.stderr)
        return 2
    # First on the path: this clone's benchmarks, not another package of that name.
    root = str(BENCHMARKS.parent)
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)
    from benchmarks.bench import main as bench_main
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
