"""The tuner's decisions on tables recorded by ``mpikv tune`` (no MPI).

tests/unit/data/tuning_recorded.json holds four cache files as written on the
project's 2-core test VM on 2026-11-26 (each entry says where and with which
command): the 2-host x 2-rank cluster of ``scripts/cluster.sh`` at 10 and at
1 Gbit/s (1, 16 and 64 MiB, with ``--compression``), and one node at 2 ranks
(4 KiB-256 MiB) and 4 ranks (4 KiB-64 MiB). The VM is shared and noisy, so
these tests check what the recordings agree on, not every winner.
"""

import json
from pathlib import Path

import pytest

from mpikv import reducers
from mpikv.tuning import table as tuning, compression as tuning_compression
from mpikv.tuning.table import IN_PLACE, TO_OWNERS, Table

MiB = 1 << 20
DATA = json.loads((Path(__file__).parent / "data" / "tuning_recorded.json").read_text())
RECORDED = DATA["tables"]
CLUSTERS = ("cluster-10gbit", "cluster-1gbit")


def table(name):
    return Table.from_json(RECORDED[name]["table"], name)


def best_time(t, mode, size):
    return min(t.times[(mode, size)].values())


def test_the_recordings_are_this_format_and_say_where_they_come_from():
    assert set(RECORDED) == {"cluster-10gbit", "cluster-1gbit", "node-2", "node-4"}
    for name, entry in RECORDED.items():
        assert entry["where"] and entry["command"].count("mpikv tune") == 1
        assert entry["date"].startswith("2026-11-26")
        t = table(name)                       # FORMAT 2, every winner a known strategy
        assert {m for m, _ in t.winners} == set(tuning.MODES)   # no GPU there: no device:
        for name_ in t.winners.values():
            reducers.check_name(name_)
        # the recorded winners are what decide() makes of the recorded times
        assert tuning.decide(t.times, name).winners == t.winners


@pytest.mark.parametrize("name", CLUSTERS)
def test_on_the_cluster_large_pushes_to_the_owners_go_the_owners_way(name):
    """Half an Allreduce's traffic wins on the link: the to-the-owners winner at 16 and
    64 MiB is a strategy that sends each owner only its block (never ``allreduce``,
    which moves every block everywhere), and beats the best every-rank sum."""
    t = table(name)
    owners_way = {"ring", "reduce_scatter", "hierarchical", "reduce_bcast",
                  "reduce_bcast_blocks"}
    for size in (16 * MiB, 64 * MiB):
        assert t.choose(size, True, owners=True) in owners_way
        assert best_time(t, TO_OWNERS, size) < 0.85 * best_time(t, IN_PLACE, size)
    # recorded: the ring of Sendrecv won both; hierarchical to the owners (Reduce in the
    # node, Reduce_scatter between the leaders, Scatterv) beat reduce_scatter at 64 MiB
    assert t.choose(64 * MiB, True, owners=True) == "ring"
    per = t.times[(TO_OWNERS, 64 * MiB)]
    assert per["hierarchical"] < per["reduce_scatter"] and per["hierarchical"] < per["allreduce"]


def test_hierarchical_to_the_owners_beats_its_own_allreduce_where_the_link_limits():
    """At 1 Gbit/s the link is the limit: hierarchical to the owners (half the bytes
    between the leaders) beat hierarchical to everyone at 16 and 64 MiB. At 10 Gbit/s
    the 2 cores are, and at 16 MiB the run's noise was larger than the difference."""
    t = table("cluster-1gbit")
    for size in (16 * MiB, 64 * MiB):
        assert (t.times[(TO_OWNERS, size)]["hierarchical"]
                < 0.6 * t.times[(IN_PLACE, size)]["hierarchical"])
    t = table("cluster-10gbit")
    assert (t.times[(TO_OWNERS, 64 * MiB)]["hierarchical"]
            < 1.2 * t.times[(IN_PLACE, 64 * MiB)]["hierarchical"])


def test_a_one_node_table_is_never_read_for_the_cluster(tmp_path):
    env = {"MPIKV_CACHE_DIR": str(tmp_path)}
    keys = {name: RECORDED[name]["key"] for name in RECORDED}
    paths = {name: tuning.cache_path(key, env) for name, key in keys.items()}
    assert len(set(paths.values())) == 4                  # every layout its own file
    # the two cluster keys differ only in the link's rate
    fast, slow = keys["cluster-10gbit"], keys["cluster-1gbit"]
    assert {k: v for k, v in fast.items() if k != "rate"} == {
        k: v for k, v in slow.items() if k != "rate"}
    for name in RECORDED:
        assert tuning.write_cache(paths[name], keys[name], table(name)) is None
    for name in RECORDED:
        got = tuning.read_cache(paths[name], keys[name])
        assert got.winners == table(name).winners
    # a one-node file put where the cluster's would be: its key is not the cluster's
    one_node = json.loads(Path(paths["node-4"]).read_text())
    Path(paths["cluster-1gbit"]).write_text(json.dumps(one_node))
    assert tuning.read_cache(paths["cluster-1gbit"], keys["cluster-1gbit"]) is None


def test_compression_pays_nowhere_at_1_gbit_nor_on_one_node():
    """Every codec against the best uncompressed strategy, recorded: on this 2-core VM
    the numpy codecs cost more than the bytes they save, even at 1 Gbit/s."""
    for name in ("cluster-1gbit", "node-2", "node-4"):
        rows = tuning_compression.report(table(name))
        assert rows and not any(r["pays"] for r in rows), name
        lines = tuning_compression.summary(rows)
        assert len(lines) == 6 and all("never pays here" in line for line in lines)


def test_compression_at_10_gbit_as_recorded():
    rows = tuning_compression.report(table("cluster-10gbit"))
    by = {(r["size"], r["mode"], r["codec"]): r for r in rows}
    assert len(by) == 3 * 2 * 3
    for (size, _, _), r in by.items():
        if size > MiB:                          # 16 and 64 MiB: the link is not the limit
            assert not r["pays"] and r["speedup"] < 0.6
    # at 1 MiB the uncompressed sums were slow in that run: bf16 to the owners 1.87 x
    assert by[(MiB, TO_OWNERS, "compressed:bf16")]["pays"]
    lines = tuning_compression.summary(rows)
    assert "compressed:bf16, to_owners: pays up to 1 MiB; stops paying above it" in " ".join(
        lines)


def test_compression_summary_says_where_it_stops_paying():
    def rows(speedups):
        return [{"size": s, "mode": IN_PLACE, "codec": "compressed:fp16", "speedup": x,
                 "pays": x >= tuning_compression.MARGIN} for s, x in speedups.items()]
    assert tuning_compression.summary(rows({MiB: 0.5, 16 * MiB: 1.3, 64 * MiB: 2.0})) == [
        "compressed:fp16, in_place: pays from 16 MiB up; stops paying below it "
        "(best 2.00 x at 64 MiB)"]
    assert "pays at every measured size" in tuning_compression.summary(
        rows({MiB: 1.2, 4 * MiB: 1.5}))[0]
    assert "pays at 1 MiB, 64 MiB" in tuning_compression.summary(
        rows({MiB: 1.2, 4 * MiB: 0.9, 64 * MiB: 1.5}))[0]
    # within the noise margin is not "pays"
    assert "never pays" in tuning_compression.summary(rows({MiB: 1.05}))[0]


def test_the_measured_default_to_the_owners_follows_the_one_node_recordings():
    default = tuning.default_table()
    for name in ("node-2", "node-4"):
        t = table(name)
        for size in tuning.SIZES:
            per = t.times.get((TO_OWNERS, size))
            if not per:
                continue
            chosen = default.choose(size, True, owners=True)
            # within 1.4 x of that run's winner, but ring at 64 MiB on 2 ranks (2.2 x)
            assert per[chosen] <= 2.3 * min(per.values()), (name, size, chosen)
