"""``mpikv tune``: measure every reduction strategy where the job runs, cache the winners.

    scripts/mpirun.sh -n 4 python -m mpikv tune              # every size class, 4 KiB-256 MiB
    scripts/mpirun.sh -n 2 python -m mpikv tune --max-bytes 16777216 --reps 5
    scripts/mpirun.sh -n 2 python -m mpikv tune --sizes 64K,1M --no-write --json
    scripts/cluster.sh run --ranks-per-host 2 -- python -m mpikv tune --sizes 1M,16M --compression

Run it once per cluster layout (MPI library, ranks, ranks per node, hosts, and
the link: ``MPIKV_CLUSTER_RATE``, ``MPIKV_TUNE_LABEL``): stores created later
with that layout read the table from the cache file instead of probing. Three
columns: in place, out of place, and to the owners (the push of an updater or
optimizer); with cupy and a GPU on every rank, the same three on GPU buffers
(``device:``). ``--compression`` also times the compressed sums and says where
compression pays. Rank 0 prints the table and writes the file.
"""

import argparse
import json
import math
import sys

from ..arrays import backends
from ..store import config
from ..tuning import rungs, table as tuning, compression as tuning_compression
from ..transport import make_transport
from ..tuning.compression import fmt_size as _fmt_size


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
    :func:`mpikv.tuning.table.decide`."""
    out = []
    for size in tuning.SIZES:
        for mode in tuning.ALL_MODES:
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
    parser.add_argument("--compression", action="store_true",
                        help="also time 2bit, fp16 and bf16 and say where they pay (longer)")
    parser.add_argument("--device", choices=("auto", "no"), default="auto",
                        help="auto: also time GPU buffers where every rank has cupy and a GPU")
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

    def progress(what):
        def show(size):
            if lead:
                print(f"mpikv tune: {what}{_fmt_size(size)} ...", file=sys.stderr, flush=True)
        return show
    key = tuning.cache_key(transport)
    times = tuning.measure(transport, sizes, reps=args.reps, progress=progress(""))
    if args.device == "auto" and _every_rank_has_a_gpu(transport):
        times.update(_measure_device(transport, sizes, args.reps, progress("GPU buffers, ")))
    table = tuning.decide(times, f"mpikv tune ({transport.size} ranks, {args.reps} reps)")
    if args.compression:
        table.compressed = tuning_compression.measure(transport, sizes, args.reps,
                                                      progress("compression, "))
    if not lead:
        return 0
    path = tuning.cache_path(key)
    problem = None if args.no_write else tuning.write_cache(path, key, table)
    found = rows(table)
    paying = tuning_compression.report(table)
    if args.json:
        print(json.dumps({"key": key, "path": None if args.no_write else path,
                          "error": problem, "rows": found, "compression": paying,
                          "compression_summary": tuning_compression.summary(paying)}))
        return 1 if problem else 0
    link = "".join(f", {k} {key[k]}" for k in ("rate", "label") if k in key)
    print(f"{key['library']}; {key['ranks']} ranks, ranks per node {key['ranks_per_node']}, "
          f"hosts {', '.join(key['hosts'])}{link}; median of {args.reps} of the slowest rank")
    print(f"  {'size':>8s}  {'mode':19s}  {'winner':28s} {'ms':>9s}  runner-up")
    for r in found:
        second = "" if r["runner_up"] is None else r["runner_up"]
        if r["slower_pct"] is not None:
            second += f" ({r['slower_pct']:+.1f} %)"
        ms = "?" if r["ms"] is None else f"{r['ms']:.3f}"
        print(f"  {_fmt_size(r['size']):>8s}  {r['mode']:19s}  {r['winner']:28s} "
              f"{ms:>9s}  {second}")
    if paying:
        print("compression (set by set_gradient_compression, not chosen by the table): "
              "against the best uncompressed strategy")
        print(f"  {'size':>8s}  {'mode':12s}  {'codec':18s} {'ms':>9s}  best uncompressed")
        for r in paying:
            ms = "?" if r["ms"] is None else f"{r['ms']:.3f}"
            vs = "" if r["speedup"] is None else (
                f"{r['best']} {r['best_ms']:.3f} ms: {r['speedup']:.2f} x, "
                + ("pays" if r["pays"] else "does not pay"))
            print(f"  {_fmt_size(r['size']):>8s}  {r['mode']:12s}  {r['codec']:18s} "
                  f"{ms:>9s}  {vs}")
        for line in tuning_compression.summary(paying):
            print(f"  {line}")
    for line in rung_lines(table.times, key):
        print(line)
    if args.no_write:
        print("not written (--no-write)")
    elif problem:
        print(f"could not write {path}: {problem}")
        return 1
    else:
        print(f"written to {path}")
    return 0


#: models the rung lines are given for: (name, bytes, optimizer, seconds and state bytes
#: per element of its update on one core of the project's test machine)
RUNG_EXAMPLES = (("ResNet-18, SGD with momentum", 44_726_568, 1.5e-9, 4),
                 ("BERT-base, Adam", 438_000_000, 3e-9, 8))


def rung_lines(times, key):
    """What a Trainer made without ``shard=`` would choose on this layout
    (:func:`mpikv.tuning.rungs.choose`), for two example models."""
    if not any(mode == "in_place" for mode, _ in times):
        return []
    out = ["the Trainer's default (shard=; it measures its own model at creation):"]
    for name, nbytes, update, state in RUNG_EXAMPLES:
        m = rungs.from_table(times, key["ranks"], len(key["hosts"]), nbytes, update, state)
        shard, why = rungs.choose(m)
        out.append(f"  {name} ({nbytes / 1e6:.0f} MB): shard={shard!r}: {why}")
    return out


def _every_rank_has_a_gpu(transport):
    """Whether cupy sees a GPU on every rank (the same answer everywhere)."""
    return all(transport.allgather_records(backends.cupy_available(), ("tune", [])))


def _measure_device(transport, sizes, reps, progress):
    """The ``device:`` columns, on GPU ``node rank % GPUs`` (one per rank where it can)."""
    import cupy
    nodes = getattr(transport, "nodes", None)
    local = nodes.local_rank if nodes is not None else transport.rank
    with cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()):
        return tuning.measure(transport, sizes, reps=reps, progress=progress, device=True)


if __name__ == "__main__":
    sys.exit(main())
