"""The default exact rung (``shard="optimizer"`` or ``"none"``) chosen on the link tables
recorded by ``mpikv tune`` (tests/unit/data/tuning_recorded.json; no MPI)."""

import json
from pathlib import Path

import pytest

from mpikv.tuning import rungs
from mpikv.tuning.table import Table

DATA = json.loads((Path(__file__).parent / "data" / "tuning_recorded.json").read_text())
GiB = 1 << 30
#: ResNet-18 (44.7 MB of float32) with SGD and momentum, BERT-base (438 MB) with Adam;
#: torch's update on one thread of the test VM, about 1.5 and 3 ns per element
RESNET18_SGD = dict(model_bytes=44_726_568, update_s_per_element=1.5e-9,
                    state_bytes_per_element=4)
BERT_ADAM = dict(model_bytes=438_000_000, update_s_per_element=3e-9, state_bytes_per_element=8)


def measured(name, model, memory_bytes=6 * GiB):
    entry = DATA["tables"][name]
    key = entry["key"]
    times = Table.from_json(entry["table"], name).times
    return rungs.from_table(times, key["ranks"], len(key["hosts"]), memory_bytes=memory_bytes,
                            **model)


@pytest.mark.parametrize("name", ["cluster-1gbit", "cluster-10gbit"])
@pytest.mark.parametrize("model", [RESNET18_SGD, BERT_ADAM])
def test_across_hosts_the_state_is_replicated_where_the_gather_costs_more(name, model):
    m = measured(name, model)
    assert m.hosts == 2 and m.ranks == 4
    assert m.gather_s() > m.extra_update_s()   # what the recordings say of both links
    shard, why = rungs.choose(m)
    assert shard == "none"
    assert "2 hosts" in why and "MiB a rank" in why


@pytest.mark.parametrize("name", ["node-2", "node-4"])
def test_one_host_keeps_the_state_sharded(name):
    shard, why = rungs.choose(measured(name, RESNET18_SGD))
    assert shard == "optimizer" and "one host" in why


def test_the_state_stays_sharded_where_replicating_it_would_not_fit():
    # BERT-base with Adam at 4 ranks: 3/4 of 876 MB more a rank, over half of 1 GiB.
    m = measured("cluster-1gbit", BERT_ADAM, memory_bytes=1 * GiB)
    assert m.replica_bytes() > rungs.MEMORY_SHARE * GiB
    shard, why = rungs.choose(m)
    assert shard == "optimizer" and "more than half" in why
    # ... and it is replicated where memory is unknown (nothing says it does not fit)
    assert rungs.choose(measured("cluster-1gbit", BERT_ADAM, memory_bytes=None))[0] == "none"


def test_a_fast_link_keeps_the_state_sharded():
    # 100 Gbit/s-class: a 4 MiB allreduce in 0.8 ms; the gather of ResNet-18 (4.3 ms)
    # costs less than updating 3/4 of it with a 5 ns-per-element optimizer (42 ms).
    m = rungs.Measured(ranks=4, hosts=2, probe_bytes=4 << 20, probe_s=0.8e-3,
                       model_bytes=44_726_568, update_s_per_element=5e-9,
                       state_bytes_per_element=8, memory_bytes=8 * GiB)
    assert m.gather_s() == pytest.approx(0.8e-3 * 44_726_568 / (8 << 20))
    assert m.extra_update_s() == pytest.approx(5e-9 * 44_726_568 / 4 * 3 / 4)
    assert rungs.choose(m)[0] == "optimizer"


def test_one_rank_has_nothing_to_choose():
    m = rungs.Measured(ranks=1, hosts=1, probe_bytes=4 << 20, probe_s=0.0, model_bytes=1,
                       update_s_per_element=1e-9, state_bytes_per_element=4)
    assert rungs.choose(m) == ("optimizer", "one rank: nothing to gather or to replicate")


def test_the_probe_is_the_fastest_in_place_sum_nearest_4_mib():
    m = measured("cluster-1gbit", RESNET18_SGD)
    times = Table.from_json(DATA["tables"]["cluster-1gbit"]["table"], "x").times
    assert m.probe_bytes == 1 << 20   # the recording has 1, 16 and 64 MiB
    assert m.probe_s == min(times[("in_place", 1 << 20)].values())


def test_a_timed_gather_replaces_the_probe():
    # At 10 Gb/s on the test VM the probe put the gather at 18 ms (a near tie with the
    # update's 19-21 ms) where a step of shard="optimizer" paid 22-40 ms more than one
    # of "none": the Trainer times the gather itself.
    probe = dict(ranks=2, hosts=2, probe_bytes=4 << 20, probe_s=3.4e-3, model_bytes=44_726_568,
                 update_s_per_element=3.4e-9, state_bytes_per_element=4, memory_bytes=4 * GiB)
    assert rungs.choose(rungs.Measured(**probe))[0] == "optimizer"
    timed = rungs.Measured(**probe, gathered_s=0.045)
    assert timed.gather_s() == 0.045
    shard, why = rungs.choose(timed)
    assert shard == "none" and "(timed)" in why


def test_mpikv_tune_says_what_the_default_would_choose_on_its_layout():
    from mpikv.tools.tune import rung_lines
    for name, want in [("cluster-1gbit", "shard='none'"), ("node-2", "shard='optimizer'")]:
        entry = DATA["tables"][name]
        lines = rung_lines(Table.from_json(entry["table"], name).times, entry["key"])
        assert lines[0].startswith("the Trainer's default")
        assert len(lines) == 3 and all(want in line for line in lines[1:]), lines
    assert rung_lines({}, {"ranks": 2, "hosts": ["a"]}) == []   # no in-place column
