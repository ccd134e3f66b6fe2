"""``mpikv tune``: measure every reduction strategy where the job runs, cache the winners.

    scripts/mpirun.sh -n 4 python -m mpikv tune              # every size class, 4 KiB-256 MiB
    scripts/mpirun.sh -n 2 python -m mpikv tune --max-bytes 16777216 --reps 5

Run it once per cluster layout (MPI library, ranks, ranks per node, hosts):
stores created later with that layout read the table from the cache file
instead of probing. Rank 0 prints the table and writes the file.
"""

import argparse
import json
import sys

from . import config, tuning
from .transport import make_transport


def _fmt_size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def rows(table):
    """Per size class and mode: winner, its ms, runner-up and how much slower it is."""
    out = []
    for size in tuning.SIZES:
        for mode in tuning.MODES:
            times = table.times.get((mode, size))
            if not times:
                continue
            ranked = sorted((t, n) for n, t in times.items())
            best_t, best = ranked[0]
            second = ranked[1] if len(ranked) > 1 else (None, None)
            out.append({"size": size, "mode": mode, "winner": best, "ms": best_t * 1e3,
                        "runner_up": second[1],
                        "slower": None if second[0] is None else second[0] / best_t})
    return out


def main(argv=None):
    """Measures, decides, writes the cache (rank 0) and prints; returns the exit code."""
    parser = argparse.ArgumentParser(prog="mpikv tune", description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=tuning.SIZES[-1],
                        help="largest size class to measure (default 256 MiB)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument("--no-write", action="store_true", help="do not write the cache file")
    parser.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = parser.parse_args(argv)
    transport = make_transport("mpi", None, config.resolve(autotune=False))
    sizes = [s for s in tuning.SIZES if s <= args.max_bytes] or [tuning.SIZES[0]]
    lead = transport.rank == 0

    def progress(size):
        if lead:
            print(f"mpikv tune: {_fmt_size(size)} ...", file=sys.stderr, flush=True)
    key = tuning.cache_key(transport)
    times = tuning.measure(transport, sizes, reps=max(1, args.reps), progress=progress)
    table = tuning.decide(times, f"mpikv tune ({transport.size} ranks, {args.reps} reps)")
    if not lead:
        return 0
    path = tuning.cache_path(key)
    problem = None if args.no_write else tuning.write_cache(path, key, table)
    found = rows(table)
    if args.json:
        print(json.dumps({"key": key, "path": None if args.no_write else path,
                          "error": problem, "rows": found}))
        return 1 if problem else 0
    print(f"{key['library']}; {key['ranks']} ranks, ranks per node {key['ranks_per_node']}, "
          f"hosts {', '.join(key['hosts'])}; median of {args.reps} of the slowest rank")
    print(f"  {'size':>8s}  {'mode':12s}  {'winner':28s} {'ms':>9s}  runner-up")
    for r in found:
        second = ("" if r["runner_up"] is None
                  else f"{r['runner_up']} ({r['slower']:.2f} x slower)")
        print(f"  {_fmt_size(r['size']):>8s}  {r['mode']:12s}  {r['winner']:28s} "
              f"{r['ms']:9.3f}  {second}")
    if args.no_write:
        print("not written (--no-write)")
    elif problem:
        print(f"could not write {path}: {problem}")
        return 1
    else:
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
