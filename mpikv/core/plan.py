"""Who owns what: the ownership plan, pure and free of MPI.

Every rank builds the same plan from the same sequence of ``init`` calls, so
no rank ever has to ask another who owns a key. Keys are placed greedily on
the least-loaded rank (by bytes), largest first within one ``init``; an array
of ``bigarray_bound`` elements or more is cut into near-equal flat shards, one
per rank, the larger shards going to the less-loaded ranks. After every
placement the heaviest and the lightest rank differ by at most the largest
single key (or shard) placed so far.
"""

from dataclasses import dataclass

#: MXNet's MXNET_KVSTORE_BIGARRAY_BOUND default, in elements.
DEFAULT_BIGARRAY_BOUND = 1_000_000


@dataclass(frozen=True)
class Shard:
    """A flat element range ``[start, stop)`` of one key, owned by ``owner``."""

    owner: int
    start: int
    stop: int

    @property
    def size(self):
        return self.stop - self.start


@dataclass(frozen=True)
class Placement:
    """Where one key lives: its shards, in element order."""

    key: object
    size: int
    itemsize: int
    shards: tuple

    @property
    def split(self):
        """True when more than one rank owns a part of the key."""
        return len(self.shards) > 1

    @property
    def owner(self):
        """The owner of an unsplit key."""
        if self.split:
            raise ValueError(f"key {self.key!r} is split over {len(self.shards)} owners")
        return self.shards[0].owner

    def counts_and_displs(self, num_ranks):
        """Per-rank element counts and offsets, as ``Allgatherv`` wants them."""
        counts = [0] * num_ranks
        displs = [0] * num_ranks
        for shard in self.shards:
            counts[shard.owner] = shard.size
            displs[shard.owner] = shard.start
        return counts, displs


def sort_key(key):
    """A total order over int and str keys, the same on every rank."""
    return (isinstance(key, str), key)


def split_bounds(size, parts):
    """Cuts ``size`` elements into ``parts`` near-equal ranges (sizes differ by <= 1)."""
    cuts = [size * i // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class OwnershipPlan:
    """Placement of every key over ``num_ranks`` owners.

    Args:
        num_ranks: number of owners.
        bigarray_bound: arrays with at least this many elements are split
            over all owners.
    """

    def __init__(self, num_ranks, bigarray_bound=DEFAULT_BIGARRAY_BOUND):
        if num_ranks < 1:
            raise ValueError("num_ranks must be at least 1")
        if bigarray_bound < 1:
            raise ValueError("bigarray_bound must be at least 1")
        self.num_ranks = num_ranks
        self.bigarray_bound = bigarray_bound
        self.loads = [0] * num_ranks
        self._placements = {}

    def __contains__(self, key):
        return key in self._placements

    def __getitem__(self, key):
        return self._placements[key]

    def __len__(self):
        return len(self._placements)

    def add(self, entries):
        """Places new keys.

        Args:
            entries: ``(key, size, itemsize)`` tuples, in any order; the result
                does not depend on it.

        Returns:
            dict: key -> Placement, for the new keys.
        """
        entries = sorted(entries, key=lambda e: (-e[1] * e[2], sort_key(e[0])))
        keys = [e[0] for e in entries]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key in one add()")
        clash = [k for k in keys if k in self._placements]
        if clash:
            raise ValueError(f"key {clash[0]!r} is already placed")
        placed = {}
        for key, size, itemsize in entries:
            parts = min(size, self.num_ranks) if size >= self.bigarray_bound else 1
            ranks = sorted(range(self.num_ranks), key=lambda r: (self.loads[r], r))
            bounds = split_bounds(size, max(parts, 1))
            # Larger shards to less-loaded ranks; ties keep element order.
            order = sorted(range(len(bounds)), key=lambda i: -(bounds[i][1] - bounds[i][0]))
            owners = [0] * len(bounds)
            for rank, i in zip(ranks, order):
                owners[i] = rank
                self.loads[rank] += (bounds[i][1] - bounds[i][0]) * itemsize
            shards = tuple(Shard(o, a, b) for o, (a, b) in zip(owners, bounds))
            placed[key] = self._placements[key] = Placement(key, size, itemsize, shards)
        return placed

    def owned_by(self, rank):
        """The shards ``rank`` owns, as ``(key, Shard)`` pairs in key order."""
        return [(p.key, s) for p in sorted(self._placements.values(), key=lambda p: sort_key(p.key))
                for s in p.shards if s.owner == rank]
