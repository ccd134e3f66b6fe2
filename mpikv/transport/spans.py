"""Which runs of a buffer each node's ranks own: the index work of a hierarchical sum
to the owners (:meth:`mpikv.transport.shm.NodeGroup.reduce_scatter_across_`). Pure."""


def node_spans(blocks, members):
    """Per node, the ``(start, count)`` runs its ranks own, merged and in buffer order.

    Args:
        blocks: per rank, ``counts`` and ``displs`` (:class:`mpikv.reducers.Blocks`).
        members: per node, its ranks (:attr:`NodeGroup.members`).
    """
    out = []
    for ranks in members:
        runs = sorted((blocks.displs[r], blocks.counts[r]) for r in ranks if blocks.counts[r])
        merged = []
        for start, count in runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            else:
                merged.append((start, count))
        out.append(merged)
    return out


def copy_runs(out, buf, runs, lo):
    """``out`` gets the elements ``lo, lo + 1, ...`` of ``buf``'s ``runs`` put end to end."""
    at = 0              # where the current run starts among the runs put end to end
    done = 0
    for start, count in runs:
        if done == out.size:
            return
        if lo + done < at + count:
            a = lo + done - at
            take = min(count - a, out.size - done)
            out[done:done + take] = buf[start + a:start + a + take]
            done += take
        at += count
