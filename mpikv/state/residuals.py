"""Error feedback's residuals in a checkpoint, so that a resume sends what was owed.

With 16-bit (error feedback) or 2-bit compression, each rank keeps a float32
residual per key: what its roundings have not yet sent. An owner of a 16-bit
gather keeps one more, of its block's sums. Dropping them at a resume loses a
rounding; keeping them makes the resume exact.

Each rank writes its own residuals into its part of the checkpoint, as
``residual.R`` (whole keys) and ``residual.sum.R`` (the elements of its gather
blocks), ``R`` its rank: with compression on, a checkpoint holds the float32
model once more per rank. A load on the same number of ranks gives each rank
its own, and the resumed run equals the uninterrupted one bit for bit. On
another number, what every rank owed of an element is summed onto the
element's owner now (every other rank starts from zero): the owners receive the
same sums over the next pushes, one rounding apart.

A store without compression at the load leaves the file's residuals unread; a
file without residuals leaves the store's as they are.
"""

import numpy as np

PREFIX = "residual."
SUMS = PREFIX + "sum."


def _sender(rank):
    return f"{PREFIX}{rank}"


def _sums(rank):
    return f"{SUMS}{rank}"


def part_entries(engine, take):
    """This rank's residuals as a part file's entries (local).

    Args:
        engine: the store's :class:`~mpikv.core.engine.Engine`.
        take: the host array to keep of each array (a copy, or the array itself).
    """
    comp = engine.compression
    if comp is None:
        return []
    rank = engine.transport.rank
    senders, sums = comp.owed()
    entries = [(key, _sender(rank), 0, flat.size, engine.entries[key].array.shape, take(flat))
               for key, flat in senders.items() if key in engine.entries]
    # One range per key: a key's gather residuals of stale bucket layouts add up.
    merged = {}
    for key, lo, hi, values in sums:
        if key in engine.entries:
            merged.setdefault(key, []).append((lo, hi, values))
    for key, pieces in merged.items():
        lo, hi = min(p[0] for p in pieces), max(p[1] for p in pieces)
        total = np.zeros(hi - lo, np.float32)
        for a, b, values in pieces:
            total[a - lo:b - lo] += values
        entries.append((key, _sums(rank), lo, hi, engine.entries[key].array.shape, take(total)))
    return entries


def _held(man, key, name, start, stop):
    """The ranges of ``[start, stop)`` that the file holds of ``key``'s ``name``."""
    info = man.array(key, name)
    if info is None:
        return []
    return [(max(s, start), min(e, stop)) for s, e, _, _ in info.spans
            if max(s, start) < min(e, stop)]


class Loaded:
    """What a load reads of the residuals, then installs (:meth:`install`).

    Args:
        engine: the store's engine.
        man: the checkpoint's manifest.
        plan: the placement the load installs.
    """

    def __init__(self, engine, man, plan):
        self.engine, self.plan = engine, plan
        self.saved_ranks = man.meta.get("num_workers")
        held = any(name.startswith(PREFIX) for _, name in man.arrays())
        self.active = held and engine.compression is not None
        self.wanted = self._wanted(man) if self.active else []

    def _wanted(self, man):
        t, saved = self.engine.transport, man.arrays()
        self.same = self.saved_ranks == t.size
        wanted = []
        if self.same:
            for key, name in saved:
                if name in (_sender(t.rank), _sums(t.rank)):
                    info = man.array(key, name)
                    wanted += [(key, name, a, b) for a, b in _held(man, key, name, 0, info.size)]
            return wanted
        names = [f(r) for r in range(self.saved_ranks) for f in (_sender, _sums)]
        for key, shard in self.plan.owned_by(t.rank):
            for name in names:
                wanted += [(key, name, a, b)
                           for a, b in _held(man, key, name, shard.start, shard.stop)]
        return wanted

    def install(self, got):
        """Replaces the store's residuals with what was read (after the ranks agreed)."""
        if not self.active:
            return
        senders, sums = {}, []
        for key, name, a, b in self.wanted:
            values = got[(key, name, a, b)]
            if self.same and name.startswith(SUMS):
                sums.append((key, a, b, values))
                continue
            flat = senders.get(key)
            if flat is None:
                flat = senders[key] = np.zeros(self.engine.entries[key].flat.size, np.float32)
            flat[a:b] += values
        self.engine.compression.restore(senders, sums)
