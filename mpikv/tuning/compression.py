"""Whether gradient compression pays where the job runs: ``mpikv tune --compression``.

Compression is the store's setting (``set_gradient_compression``), not the
table's choice, so the tuner only reports it: per size class and mode (every
rank gets the sum, ``in_place``; or only the owners, ``to_owners``), each
codec's time against the best uncompressed strategy's. Encoding costs CPU
time on every rank and saves bytes on the wire, so it pays on a slow link and
large buckets and stops paying where the link is faster than the codec.
Timing is collective; deciding (:func:`report`, :func:`summary`) is pure.
"""

import math

import numpy as np

from .measure import IN_PLACE, TO_OWNERS, WHAT, time_calls, tune_bucket

#: the codecs timed, as the chooser names their reducers
TYPES = ("2bit", "fp16", "bf16")
#: compression "pays" only when this many times faster: on the 2-core test machine
#: the same call's median moved by 10-50 % between runs of ``mpikv tune``
MARGIN = 1.1
MODES = (IN_PLACE, TO_OWNERS)


def measure(transport, sizes, reps=3, progress=None):
    """Times each codec's compressed sum per size class and mode; collective.

    Returns:
        ``{(mode, size): {"compressed:TYPE": seconds}}`` (host buffers, the
        16-bit types without error feedback; the casts run in torch if the
        caller imported it, else in numpy, as a store's do; a store stages GPU
        buffers for them).
    """
    from ..arrays.compression import parse_params
    from ..reducers.compressed import Compression, CompressedReducer
    times = {}
    rng = np.random.default_rng(transport.rank)
    for size in sizes:
        if progress is not None:
            progress(size)
        n = size // 4
        src = rng.standard_normal(n).astype(np.float32)
        dst = np.empty_like(src)
        bucket = tune_bucket(n, transport.size)
        reds = {}
        for kind in TYPES:
            comp = Compression(parse_params({"type": kind}), per_device=False)
            red = CompressedReducer(comp, transport, bucket)
            reds[red.name] = red
        for mode in MODES:
            if mode == TO_OWNERS:
                calls = {name: (lambda r=red: r.reduce_to_owners(dst, None, bucket, WHAT))
                         for name, red in reds.items()}
            else:
                calls = {name: (lambda r=red: r.allreduce(dst, None, WHAT))
                         for name, red in reds.items()}
            times[(mode, size)] = time_calls(transport, calls, reps,
                                             lambda: np.copyto(dst, src))
    return times


def report(table):
    """Per measured ``(mode, size)`` and codec: whether it beats the best uncompressed
    strategy of the same column.

    Returns:
        list of dicts: ``size``, ``mode``, ``codec``, ``ms``, ``best`` (the
        uncompressed winner), ``best_ms``, ``speedup`` (best time / codec
        time), ``pays`` (``speedup`` at least :data:`MARGIN`).
    """
    out = []
    for (mode, size), per_codec in sorted(table.compressed.items(),
                                          key=lambda kv: (kv[0][1], kv[0][0])):
        plain = {n: t for n, t in table.times.get((mode, size), {}).items()
                 if t is not None and math.isfinite(t)}
        best = min(plain, key=plain.get) if plain else None
        for codec, t in sorted(per_codec.items()):
            ok = best is not None and t is not None and math.isfinite(t) and t > 0
            speedup = plain[best] / t if ok else None
            out.append({"size": size, "mode": mode, "codec": codec,
                        "ms": None if t is None else t * 1e3, "best": best,
                        "best_ms": None if best is None else plain[best] * 1e3,
                        "speedup": speedup, "pays": bool(ok and speedup >= MARGIN)})
    return out


def summary(rows):
    """One line per codec and mode saying where compression pays and where it stops.

    ``"compressed:fp16, to_owners: pays from 16 MiB up (1.4 x at 64 MiB); not at 1 MiB"``
    """
    lines = []
    groups = {}
    for r in rows:
        groups.setdefault((r["codec"], r["mode"]), []).append(r)
    for (codec, mode), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["size"])
        pays = [r for r in rs if r["pays"]]
        not_ = [r for r in rs if not r["pays"]]
        if not pays:
            where = "never pays here"
        elif not not_:
            where = "pays at every measured size"
        elif max(r["size"] for r in not_) < min(r["size"] for r in pays):
            where = f"pays from {fmt_size(pays[0]['size'])} up; stops paying below it"
        elif max(r["size"] for r in pays) < min(r["size"] for r in not_):
            where = f"pays up to {fmt_size(pays[-1]['size'])}; stops paying above it"
        else:
            where = "pays at " + ", ".join(fmt_size(r["size"]) for r in pays)
        top = max(rs, key=lambda r: r["speedup"] or 0.0)
        best = "" if top["speedup"] is None else (
            f" (best {top['speedup']:.2f} x at {fmt_size(top['size'])})")
        lines.append(f"{codec}, {mode}: {where}{best}")
    return lines


def fmt_size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
