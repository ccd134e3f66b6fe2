"""The link between hosts, as MPI sees it: one transfer between the first ranks of two hosts.

``python -m mpikv bench link`` (under ``scripts/cluster.sh run``, say) times a
point-to-point transfer of ``--mib`` MiB (default 64) from rank 0 to the first
rank on another host and back, and prints the bytes, the seconds and the rate in
Gb/s of each direction (the median of ``--iterations``, default 3). The other
ranks wait. With one host, the peer is rank 1 (shared memory).
"""

import time

import numpy as np


def peer_of(hosts):
    """The first rank on another host than rank 0's, else rank 1, else None.

    Args:
        hosts: each rank's host name, by rank.
    """
    for r, h in enumerate(hosts):
        if h != hosts[0]:
            return r
    return 1 if len(hosts) > 1 else None


def bench_link(iterations, mib, comm):
    """Returns ``{"peer", "hosts", "bytes", "there_s", "back_s", "there_gbps", "back_gbps"}``
    on every rank (the rates from the medians)."""
    from mpi4py import MPI
    hosts = comm.allgather(MPI.Get_processor_name())
    peer = peer_of(hosts)
    out = {"peer": peer, "hosts": sorted(set(hosts)), "bytes": mib << 20, "ranks": comm.size}
    if peer is None:
        return out
    buf = np.ones(mib << 20, np.uint8)
    times = {"there": [], "back": []}
    for i in range(1 + iterations):  # the first round opens the connection: not timed
        for way, src, dst in (("there", 0, peer), ("back", peer, 0)):
            comm.Barrier()
            if comm.rank in (src, dst):
                t = time.perf_counter()
                if comm.rank == src:
                    comm.Send(buf, dest=dst, tag=i)
                    comm.Recv(buf[:1], source=dst, tag=i)  # the receiver has it all
                else:
                    comm.Recv(buf, source=src, tag=i)
                    comm.Send(buf[:1], dest=src, tag=i)
                dt = time.perf_counter() - t
                if i and comm.rank == src:
                    times[way].append(dt)
    for way, src in (("there", 0), ("back", peer)):
        median = comm.bcast(float(np.median(times[way])) if comm.rank == src else None, root=src)
        out[f"{way}_s"] = median
        out[f"{way}_gbps"] = out["bytes"] * 8 / median / 1e9
    return out


def show_link(out, comm):
    if out["peer"] is None:
        print("bench link: one rank, no link to measure")
        return
    print(f"link: rank 0 <-> rank {out['peer']} ({len(out['hosts'])} hosts: "
          f"{', '.join(out['hosts'])}), {out['bytes'] >> 20} MiB each way")
    for way in ("there", "back"):
        print(f"  {way:5s}: {out[f'{way}_s'] * 1e3:8.1f} ms  {out[f'{way}_gbps']:6.2f} Gb/s")
