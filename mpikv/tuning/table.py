"""Which strategy moves a bucket: a table measured where the store runs.

The table maps a size class (4 KiB to 256 MiB, in steps of 4x) and a mode
(``in_place``: the input is the destination; ``out_of_place``: the input is
the caller's array and the sum goes elsewhere; ``to_owners``: only each
owner's block of the sum is wanted, the push of an updater or optimizer on
the owners) to the fastest strategy of :mod:`mpikv.reducers`. Buffers on a
GPU have columns of their own (``device:MODE``) where ``mpikv tune`` measured
them with cupy; else they use the host's. It comes, in this order, from:

1. the ``reducer`` option (``create(reducer=)`` or ``MPIKV_REDUCER``), if not ``auto``;
2. the cache file that ``mpikv tune`` (or an earlier probe) wrote for this MPI
   library and version, number of ranks, ranks per node and hosts, and the
   link (``MPIKV_CLUSTER_RATE``, ``MPIKV_TUNE_LABEL``, where set);
3. a short probe at the store's creation (a few seconds; ``autotune=False``
   or ``MPIKV_AUTOTUNE=0`` turns it off), written to the cache;
4. the measured default below.

Rank 0 decides and every rank uses its table, so all ranks call the same
collectives. Deciding from timings (:func:`decide`) is pure. Timing is
:mod:`mpikv.tuning.measure`'s; whether compression pays,
:mod:`mpikv.tuning.compression`'s.
"""

import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field

from .. import reducers
from ..logs import get_logger
from .measure import (  # noqa: F401 (the table's names, here as before)
    ALL_MODES, DEVICE, DEVICE_MODES, IN_PLACE, MODES, OUT_OF_PLACE, SIZES, TO_OWNERS, candidates,
    measure, transport_piece)

#: what the probe measures at a store's creation when no cache exists.
PROBE_SIZES = (64 << 10, 1 << 20, 16 << 20)
PROBE_BUDGET_S = 3.0
#: 2: the ``to_owners`` and ``device:`` columns, compression timings. A file of
#: another format is not read (its store probes again and rewrites it).
FORMAT = 2

#: The measured default: ``mpikv tune`` on the project's 2-core test machine
#: (Open MPI 5.0.11 wheel, 2026-11-23, 2 and 4 ranks on one node). In place,
#: ``Allreduce`` in 4 MiB pieces won 17 of the 18 classes (``shared`` won 256 KiB
#: and 1 MiB at 4 ranks, by 3-12 %). Out of place, the winners were within 15 %
#: of each other: ``Allreduce`` up to 1 MiB (timed then with MPI's out-of-place
#: call; it now copies first, see :mod:`mpikv.reducers.allreduce`), then copy-first or
#: ``shared``; ``shared`` needs several ranks per node, so the default takes
#: copy-first there, which runs anywhere. To the owners (the same machine,
#: 2026-11-26, 2 ranks 4 KiB-256 MiB and 4 ranks 4 KiB-64 MiB; the strategy
#: with the least geometric mean of its time over the winner's in the two
#: runs): ``allreduce`` up to 64 KiB (``reduce_scatter`` within 12 %), ``ring``
#: at 256 KiB and 1 MiB, ``reduce_scatter`` at 4 MiB (the default bucket), then
#: ``ring`` (within 1.2-1.5 x of ``reduce_bcast_blocks`` at 16 and 64 MiB, the
#: winner at 256 MiB, and on the 2 x 2 cluster at 16 and 64 MiB at 1 and
#: 10 Gbit/s: tests/unit/data/tuning_recorded.json). Against each run's winner it
#: is 1.0-1.4 x, except ``ring`` at 64 MiB on 2 ranks (2.2 x behind
#: ``reduce_bcast_blocks``, which it beat at 4 ranks): the runs' noise is 10-50 %.
DEFAULT = {IN_PLACE: [(math.inf, "allreduce")],
           OUT_OF_PLACE: [(1 << 20, "allreduce"), (math.inf, "copy+allreduce")],
           TO_OWNERS: [(64 << 10, "allreduce"), (1 << 20, "ring"), (4 << 20, "reduce_scatter"),
                       (math.inf, "ring")]}


def size_class(nbytes):
    """The size class nearest ``nbytes`` on a log scale."""
    n = max(int(nbytes), 1)
    return min(SIZES, key=lambda s: (abs(math.log(n / s)), s))


@dataclass
class Table:
    """Winning strategy per ``(mode, size class)``.

    Attributes:
        winners: ``{(mode, size): name}``; classes that were not measured use
            the nearest measured class of the same mode.
        source: where the table came from, for ``mpikv info`` and logs.
        times: ``{(mode, size): {name: seconds}}`` behind the winners, if measured.
    """

    winners: dict
    source: str
    times: dict = field(default_factory=dict)
    #: ``{(mode, size): {"compressed:TYPE": seconds}}`` (in place and to the owners),
    #: from ``mpikv tune --compression``: reported, never chosen from
    compressed: dict = field(default_factory=dict)

    def choose(self, nbytes, in_place, owners=False, device=False):
        """The strategy for a bucket of ``nbytes``.

        Args:
            in_place: the in-place column, else the out-of-place one.
            owners: only the owners need the sum: the ``to_owners`` column
                (measured in place; every strategy's ``reduce_to_owners``
                takes an out-of-place input too), else the in-place one.
            device: GPU buffers: the ``device:`` column where measured, else the host's.
        """
        mode = TO_OWNERS if owners else IN_PLACE if in_place else OUT_OF_PLACE
        tries = ([DEVICE + mode] if device else []) + [mode] + ([IN_PLACE] if owners else [])
        n = max(int(nbytes), 1)
        for m in tries:
            sizes = [s for (mm, s) in self.winners if mm == m]
            if sizes:
                best = min(sizes, key=lambda s: (abs(math.log(n / s)), s))
                return self.winners[(m, best)]
        return "allreduce"

    def measured_on_device(self):
        """Whether the table has ``device:`` columns (timed on GPU buffers)."""
        return any(m.startswith(DEVICE) for m, _ in self.winners)

    def to_json(self):
        return {"format": FORMAT, "source": self.source,
                "winners": [[m, s, n] for (m, s), n in sorted(self.winners.items())],
                "times": [[m, s, t] for (m, s), t in sorted(self.times.items())],
                "compressed": [[m, s, t] for (m, s), t in sorted(self.compressed.items())]}

    @classmethod
    def from_json(cls, data, source=None):
        """Raises ValueError on anything malformed (a cache file is data, not trusted)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a tuning table of this version")
        winners, times, compressed = {}, {}, {}
        try:
            for m, s, name in data["winners"]:
                if m not in ALL_MODES or s not in SIZES or not isinstance(name, str):
                    raise ValueError(f"bad entry {[m, s, name]!r}")
                reducers.check_name(name)
                winners[(m, s)] = name
            for m, s, t in data.get("times", []):
                times[(m, s)] = {str(k): float(v) for k, v in t.items()}
            for m, s, t in data.get("compressed", []):
                compressed[(m, s)] = {str(k): float(v) for k, v in t.items()}
        except (KeyError, TypeError, AttributeError) as exc:
            # wrong shapes (a number for a list, a missing field) are malformed too
            raise ValueError(f"malformed tuning table: {type(exc).__name__}: {exc}") from None
        return cls(winners, source or str(data.get("source", "?")), times, compressed)

    def rows(self):
        """``[(size, in-place winner, out-of-place winner, to-the-owners winner)]``."""
        return [(s, self.choose(s, True), self.choose(s, False), self.choose(s, True, True))
                for s in SIZES]


def forced(name, source):
    """A table that picks ``name`` everywhere (a ``copy+`` name only out of place)."""
    reducers.check_name(name)
    inplace = name[len(reducers.COPY):] if name.startswith(reducers.COPY) else name
    return Table({**{(IN_PLACE, s): inplace for s in SIZES},
                  **{(OUT_OF_PLACE, s): name for s in SIZES},
                  **{(TO_OWNERS, s): inplace for s in SIZES}}, source)


def default_table():
    """The measured default (see :data:`DEFAULT`)."""
    winners = {}
    for mode, steps in DEFAULT.items():
        for s in SIZES:
            winners[(mode, s)] = next(name for limit, name in steps if s <= limit)
    return Table(winners, "measured default (no cache; probe off or not run)")


def decide(times, source):
    """The table of the fastest strategy per measured ``(mode, size)``.

    Args:
        times: ``{(mode, size): {name: seconds}}``; a missing or non-finite
            time means the strategy did not run there.
        source: recorded in the table.

    Ties go to the strategy listed first in :data:`mpikv.reducers.NAMES`
    (plain before ``copy+``), so a decision does not flip on equal timings.
    """
    order = {n: i for i, n in enumerate(reducers.NAMES)}

    def rank(name):
        copy = name.startswith(reducers.COPY)
        base = name[len(reducers.COPY):] if copy else name
        return (copy, order.get(base, len(order)))
    winners = {}
    for key, per_name in times.items():
        ok = {n: t for n, t in per_name.items() if t is not None and math.isfinite(t)}
        if ok:
            winners[key] = min(ok, key=lambda n: (ok[n], rank(n)))
    return Table(winners, source, {k: dict(v) for k, v in times.items()})


# -- the cache -------------------------------------------------------------
def _placement(hosts):
    """Each rank's host as the index of its first appearance: ``[0, 0, 1, 1]``."""
    first = {}
    return [first.setdefault(h, len(first)) for h in hosts]


def cache_key(transport):
    """What a table depends on; collective (gathers host names).

    Beyond the MPI library, the ranks and the hosts: the link, which host names
    do not tell (a cluster reshaped from 10 to 1 Gbit/s keeps them):
    ``MPIKV_CLUSTER_RATE`` (``scripts/cluster.sh`` sets it) and
    ``MPIKV_TUNE_LABEL`` (any text, e.g. the fabric), each only where set and
    taken from rank 0 so that every rank has the same key.
    """
    mine = (socket.gethostname(), os.environ.get("MPIKV_CLUSTER_RATE"),
            os.environ.get("MPIKV_TUNE_LABEL"))
    records = transport.allgather_records(mine, ("tune", []))
    per_host = {}
    for h, _, _ in records:
        per_host[h] = per_host.get(h, 0) + 1
    key = {"library": transport.library.splitlines()[0] if transport.library else "?",
           "mpi_version": transport.mpi_version, "ranks": transport.size,
           "ranks_per_node": sorted(per_host.values()), "hosts": sorted(per_host),
           # which ranks share a host: by block (h1 h1 h2 h2) or not (h1 h2 h1 h2)
           # puts different hops of a ring on the link
           "placement": _placement([h for h, _, _ in records])}
    # Only where set: a key without them is the one tables were cached under before.
    _, rate, label = records[0]
    if rate:
        key["rate"] = rate
    if label:
        key["label"] = label
    return key


def cache_dir(environ=None):
    """``MPIKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpikv``, else ``~/.cache/mpikv``."""
    env = os.environ if environ is None else environ
    if env.get("MPIKV_CACHE_DIR"):
        return env["MPIKV_CACHE_DIR"]
    # HOME from ``environ`` too, so the answer depends on the environment given
    home = env.get("HOME") or os.path.expanduser("~")
    base = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(base, "mpikv")


def cache_path(key, environ=None):
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return os.path.join(cache_dir(environ), f"tune-{digest}.json")


def read_cache(path, key):
    """The cached table for ``key``, or None (missing, other key, or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("key") != key:
            return None
        if data["table"].get("format") != FORMAT:
            # Another version's table (format 1 had no to_owners column): measured again
            # and rewritten, not misread, and not worth a warning.
            get_logger().info("tuning cache %s has format %r, not %d: measuring again",
                              path, data["table"].get("format"), FORMAT)
            return None
        return Table.from_json(data["table"], f"cache {path} ({data['table'].get('source')}, "
                                              f"{data.get('date', '?')})")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # AttributeError: valid JSON that is not an object (a list, null) has no .get;
        # rank 0 must not raise here while the other ranks wait in its bcast
        get_logger().warning("ignoring tuning cache %s: %s", path, exc)
        return None


def write_cache(path, key, table):
    """Writes the cache file atomically (rank 0 only). Returns an error text or None."""
    data = {"key": key, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "table": table.to_json()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
        return None
    except (OSError, TypeError, ValueError) as exc:
        # a half-written temp file would otherwise stay next to the cache
        try:
            os.remove(tmp)
        except OSError:
            pass
        return f"{type(exc).__name__}: {exc}"


_resolved = {}   # json key -> Table: one probe or cache read per process


def forget():
    """Drops the tables this process resolved: the next store reads its cache (or
    probes) again (tests that write a cache between stores)."""
    _resolved.clear()


def resolve(transport, reducer="auto", autotune=True):
    """The table a store uses; collective over the transport. Rank 0 decides.

    Args:
        transport: the store's transport.
        reducer: "auto", or a strategy name to use everywhere.
        autotune: probe when no cache file exists (else the measured default).
    """
    if reducer != "auto":
        return forced(reducer, f"forced: reducer={reducer}")
    if transport.size == 1:
        return forced("allreduce", "one rank: nothing to tune")
    key = cache_key(transport)
    memo = (json.dumps(key, sort_keys=True), bool(autotune))
    what = ("tune", [])
    path = cache_path(key)
    table = None
    if transport.rank == 0:
        # Only rank 0's memo counts: another rank may not have met this layout yet
        # (a store on a sub-communicator), and the bcast below must run everywhere.
        table = _resolved.get(memo) or read_cache(path, key)
    found = transport.bcast_record(None if table is None else (table.to_json(), table.source),
                                   0, what)
    if found is not None:
        table = Table.from_json(found[0], found[1])
    elif autotune:
        times = measure(transport, PROBE_SIZES, reps=2, budget_s=PROBE_BUDGET_S)
        table = decide(times, "probe at the store's creation")
        if transport.rank == 0:
            problem = write_cache(path, key, table)
            if problem:
                get_logger().warning("could not write the tuning cache %s: %s", path, problem)
            else:
                table.source = f"probe at the store's creation (cached in {path})"
        # rank 0's table for everyone: timings differ a little between ranks
        data = transport.bcast_record((table.to_json(), table.source), 0, what)
        table = Table.from_json(*data)
    else:
        table = default_table()
    _resolved[memo] = table
    return table
