"""``mpikv tune``: measure every reduction strategy where the job runs, cache the winners.

    scripts/mpirun.sh -n 4 python -m mpikv tune              # every size class, 4 KiB-256 MiB
    scripts/mpirun.sh -n 2 python -m mpikv tune --max-bytes 16777216 --reps 5
    scripts/mpirun.sh -n 2 python -m mpikv tune --sizes 64K,1M --no-write --json

Run it once per cluster layout (MPI library, ranks, ranks per node, hosts):
stores created later with that layout read the table from the cache file
instead of probing. Rank 0 prints the table and writes the file.
"""

import argparse
import json
import math
import sys

from . import config, tuning
from .transport import make_transport


def _fmt_size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def parse_sizes(text):
    """``"4K,1M,16777216"`` -> sorted size classes; ValueError for a size not in the table."""
    units = {"": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20}
    out = set()
    for item in text.split(","):
        item = item.strip().upper()
        digits = item.rstrip("KMIB")
        if not digits.isdigit() or item[len(digits):] not in units:
            raise ValueError(f"not a size: {item!r}")
        size = int(digits) * units[item[len(digits):]]
        if size not in tuning.SIZES:
            raise ValueError(f"{item} is not a size class (4K, 16K, ..., 256M)")
        out.add(size)
    return sorted(out)


def rows(table):
    """Per measured size class and mode: the table's winner, its ms, the runner-up and
    how much slower it is (``slower_pct``); non-finite times are left out, as in
    :func:`mpikv.tuning.decide`."""
    out = []
    for size in tuning.SIZES:
        for mode in tuning.MODES:
            best = table.winners.get((mode, size))
            if best is None:
                continue
            times = table.times.get((mode, size), {})
            # the winner is the table's, so a tie prints what decide picked
            others = sorted((t, n) for n, t in times.items()
                            if n != best and t is not None and math.isfinite(t))
            best_t = times.get(best)
            second_t, second = others[0] if others else (None, None)
            slower = (None if second_t is None or not best_t
                      else 100.0 * (second_t / best_t - 1.0))
            out.append({"size": size, "mode": mode, "winner": best,
                        "ms": None if best_t is None else best_t * 1e3,
                        "runner_up": second, "slower_pct": slower})
    return out


def main(argv=None):
    """Measures, decides, writes the cache (rank 0) and prints; returns the exit code."""
    parser = argparse.ArgumentParser(prog="mpikv tune", description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=tuning.SIZES[-1],
                        help="largest size class to measure (default 256 MiB)")
    parser.add_argument("--sizes", metavar="LIST",
                        help="only these size classes, e.g. 4K,1M,16M (with --max-bytes: both)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument("--no-write", action="store_true", help="do not write the cache file")
    parser.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    sizes = tuning.SIZES
    if args.sizes:
        try:
            sizes = parse_sizes(args.sizes)
        except ValueError as exc:
            parser.error(f"--sizes: {exc}")
    sizes = [s for s in sizes if s <= args.max_bytes]
    if not sizes:
        parser.error("no size class left to measure (see --sizes and --max-bytes)")
    # the transport a store builds; autotune=False since this is the tuner itself
    transport = make_transport("mpi", None, config.resolve(autotune=False))
    lead = transport.rank == 0

    def progress(size):
        if lead:
            print(f"mpikv tune: {_fmt_size(size)} ...", file=sys.stderr, flush=True)
    key = tuning.cache_key(transport)
    times = tuning.measure(transport, sizes, reps=args.reps, progress=progress)
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
        second = "" if r["runner_up"] is None else r["runner_up"]
        if r["slower_pct"] is not None:
            second += f" ({r['slower_pct']:+.1f} %)"
        ms = "?" if r["ms"] is None else f"{r['ms']:.3f}"
        print(f"  {_fmt_size(r['size']):>8s}  {r['mode']:12s}  {r['winner']:28s} "
              f"{ms:>9s}  {second}")
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
