"""Which exact rung a Trainer runs by default: the optimizer state sharded, or replicated.

Both rungs keep DDP's promise (``.grad`` holds the average when backward returns)
and give the same weights bit for bit; they differ in what a step moves and holds:

- ``"optimizer"`` (ZeRO-1): each owner updates its parts, then every rank gathers
  the weights. A step moves 1.5 x an allreduce's bytes; a rank holds 1/N of the
  optimizer state.
- ``"none"`` (DDP's layout): every rank updates every part, nothing is gathered.
  A step moves an allreduce's bytes; a rank holds the whole state.

:func:`choose` decides from what was measured on the job's own layout, so that a
table recorded on one cluster can be replayed in a test.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """What :func:`choose` reads: a layout and its costs, the same on every rank.

    Attributes:
        ranks: ranks in the job.
        hosts: distinct hosts among them.
        probe_bytes: bytes of the probe ``allreduce_``.
        probe_s: its time over the job's layout (every link it crosses).
        model_bytes: the trained parameters' bytes.
        update_s_per_element: the optimizer's update, seconds per element on one rank.
        state_bytes_per_element: its state, bytes per element.
        memory_bytes: the memory available to one rank (the least of any rank), or
            None when unknown.
        gathered_s: the weights' gather itself, timed (the slowest rank), or None:
            then the probe stands for it.
    """

    ranks: int
    hosts: int
    probe_bytes: int
    probe_s: float
    model_bytes: int
    update_s_per_element: float
    state_bytes_per_element: float
    memory_bytes: int = None
    gathered_s: float = None

    def gather_s(self):
        """The weights' gather of a step: as timed, else from the probe ((N - 1)/N of
        the model to every rank, where the probe's allreduce moves 2 (N - 1)/N of its
        bytes)."""
        if self.gathered_s is not None:
            return self.gathered_s
        return self.probe_s * self.model_bytes / (2.0 * self.probe_bytes)

    def extra_update_s(self, itemsize=4):
        """Updating the parts other ranks own, on every rank."""
        elements = self.model_bytes / itemsize
        return self.update_s_per_element * elements * (self.ranks - 1) / self.ranks

    def replica_bytes(self, itemsize=4):
        """The state a rank holds beyond its own parts when it is replicated."""
        elements = self.model_bytes / itemsize
        return self.state_bytes_per_element * elements * (self.ranks - 1) / self.ranks


#: the share of a rank's available memory that replicated state may take
MEMORY_SHARE = 0.5


def choose(m):
    """The rung for the layout and costs in ``m``: ``(shard, why)``.

    ``"none"`` where the job spans hosts, the replicated state fits in half the
    memory a rank has, and gathering the weights would cost more time than updating
    every part on every rank; else ``"optimizer"``. One host keeps the sharded state:
    there the gather runs through shared memory (and the memory is what sharding
    saves).

    Args:
        m: a :class:`Measured`.
    """
    if m.ranks < 2:
        return "optimizer", "one rank: nothing to gather or to replicate"
    if m.hosts < 2:
        return "optimizer", (f"one host ({m.ranks} ranks): the weights are gathered "
                             f"through shared memory; the optimizer state stays sharded")
    gather, update, extra = m.gather_s(), m.extra_update_s(), m.replica_bytes()
    how = ("timed" if m.gathered_s is not None else
           f"from a {m.probe_bytes >> 20} MiB allreduce in {m.probe_s * 1e3:.1f} ms")
    costs = (f"the weights' gather takes about {gather * 1e3:.0f} ms a step across "
             f"{m.hosts} hosts ({how}), updating the other ranks' parts here about "
             f"{update * 1e3:.0f} ms")
    if m.memory_bytes is not None and extra > MEMORY_SHARE * m.memory_bytes:
        return "optimizer", (f"replicating the optimizer state would take "
                             f"{extra / 2**20:.0f} MiB a rank, more than half of the "
                             f"{m.memory_bytes / 2**20:.0f} MiB available")
    if gather > update:
        return "none", (f"{costs}; the replicated state takes {extra / 2**20:.0f} MiB "
                        f"a rank")
    return "optimizer", costs


def from_table(times, ranks, hosts, model_bytes, update_s_per_element,
               state_bytes_per_element, memory_bytes=None):
    """A :class:`Measured` whose probe is a tuning table's fastest in-place sum (the
    size class nearest 4 MiB): what ``mpikv tune`` measured on the same layout.

    Args:
        times: ``{(mode, size): {strategy: seconds}}`` (:attr:`mpikv.tuning.table.Table.times`).
        ranks / hosts / model_bytes / update_s_per_element / state_bytes_per_element /
            memory_bytes: as :class:`Measured`'s.
    """
    sizes = [size for mode, size in times if mode == "in_place"]
    if not sizes:
        raise ValueError("the table has no in-place column")
    size = min(sizes, key=lambda s: abs(s.bit_length() - (4 << 20).bit_length()))
    finite = [t for t in times[("in_place", size)].values() if t is not None and t == t]
    return Measured(ranks=ranks, hosts=hosts, probe_bytes=size, probe_s=min(finite),
                    model_bytes=model_bytes, update_s_per_element=update_s_per_element,
                    state_bytes_per_element=state_bytes_per_element,
                    memory_bytes=memory_bytes)


__all__ = ["MEMORY_SHARE", "Measured", "choose", "from_table"]
