"""The tuner's decisions on recorded timings, its table and its cache file (no MPI)."""

import json
import math
import os

import pytest

from mpikv import reducers, tuning
from mpikv.tuning import IN_PLACE, OUT_OF_PLACE, SIZES, Table

MiB = 1 << 20


def test_the_fastest_strategy_wins_per_mode_and_size():
    times = {(IN_PLACE, MiB): {"allreduce": 2.0, "reduce_bcast": 1.5, "shared": 3.0},
             (OUT_OF_PLACE, MiB): {"allreduce": 2.0, "copy+allreduce": 1.9}}
    table = tuning.decide(times, "recorded")
    assert table.winners == {(IN_PLACE, MiB): "reduce_bcast",
                             (OUT_OF_PLACE, MiB): "copy+allreduce"}
    assert table.source == "recorded"
    assert table.times[(IN_PLACE, MiB)]["shared"] == 3.0


def test_ties_go_to_the_first_named_strategy_plain_before_copy():
    times = {(IN_PLACE, 4096): {"shared": 1.0, "reduce_scatter": 1.0, "allreduce": 1.0},
             (OUT_OF_PLACE, 4096): {"copy+allreduce": 1.0, "hierarchical": 1.0}}
    table = tuning.decide(times, "t")
    assert table.winners[(IN_PLACE, 4096)] == "allreduce"
    assert table.winners[(OUT_OF_PLACE, 4096)] == "hierarchical"


def test_missing_and_non_finite_times_do_not_win():
    times = {(IN_PLACE, MiB): {"allreduce": math.nan, "reduce_bcast": math.inf,
                               "shared": None, "reduce_scatter": 5.0},
             (OUT_OF_PLACE, MiB): {"allreduce": math.nan}}
    table = tuning.decide(times, "t")
    assert table.winners == {(IN_PLACE, MiB): "reduce_scatter"}


def test_choose_takes_the_nearest_measured_class_on_a_log_scale():
    table = Table({(IN_PLACE, 64 << 10): "reduce_bcast", (IN_PLACE, 16 * MiB): "shared",
                   (OUT_OF_PLACE, MiB): "copy+allreduce"}, "t")
    assert table.choose(1, True) == "reduce_bcast"
    assert table.choose(512 << 10, True) == "reduce_bcast"      # 8 x up, 32 x down
    assert table.choose(2 * MiB, True) == "shared"              # 32 x up, 8 x down
    assert table.choose(1 << 30, True) == "shared"
    assert table.choose(4096, False) == "copy+allreduce"        # the only out-of-place entry
    assert Table({}, "empty").choose(MiB, True) == "allreduce"


def test_size_class():
    assert tuning.size_class(1) == 4096
    assert tuning.size_class(4096) == 4096
    assert tuning.size_class(5 * MiB) == 4 * MiB
    assert tuning.size_class(1 << 40) == SIZES[-1]
    assert SIZES[0] == 4096 and SIZES[-1] == 256 * MiB and len(SIZES) == 9


def test_forced_and_default_tables_cover_every_class():
    forced = tuning.forced("copy+reduce_scatter", "forced")
    for size in SIZES:
        assert forced.choose(size, True) == "reduce_scatter"
        assert forced.choose(size, False) == "copy+reduce_scatter"
    with pytest.raises(ValueError, match="unknown reduction strategy"):
        tuning.forced("ring", "x")
    default = tuning.default_table()
    assert set(default.winners) == {(m, s) for m in tuning.MODES for s in SIZES}
    for name in default.winners.values():
        reducers.check_name(name)


def test_json_round_trip_and_refusals():
    table = tuning.decide({(IN_PLACE, MiB): {"allreduce": 1e-3, "shared": 2e-3}}, "src")
    back = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert back.winners == table.winners and back.times == table.times
    assert back.source == "src"
    good = table.to_json()
    for bad in ({**good, "format": 99}, {**good, "winners": [["in_place", MiB, "ring"]]},
                {**good, "winners": [["sideways", MiB, "allreduce"]]},
                {**good, "winners": [["in_place", 12345, "allreduce"]]}, ["not", "a", "dict"]):
        with pytest.raises(ValueError):
            Table.from_json(bad)


def test_cache_file_round_trip_other_keys_and_corruption(tmp_path):
    key = {"library": "Open MPI v5", "ranks": 2, "ranks_per_node": [2], "hosts": ["a"]}
    path = tuning.cache_path(key, {"MPIKV_CACHE_DIR": str(tmp_path)})
    assert os.path.dirname(path) == str(tmp_path)
    assert tuning.read_cache(path, key) is None                      # no file yet
    table = tuning.decide({(IN_PLACE, MiB): {"reduce_bcast": 1.0}}, "measured")
    assert tuning.write_cache(path, key, table) is None
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temp file left
    got = tuning.read_cache(path, key)
    assert got.winners == table.winners and "measured" in got.source and path in got.source
    assert tuning.read_cache(path, {**key, "ranks": 4}) is None      # another layout
    with open(path, "w") as f:
        f.write("{not json")
    assert tuning.read_cache(path, key) is None                      # corrupt: ignored
    other = tuning.cache_path({**key, "hosts": ["b"]}, {"MPIKV_CACHE_DIR": str(tmp_path)})
    assert other != path


def test_write_cache_reports_an_unwritable_place(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    problem = tuning.write_cache(str(blocker / "sub" / "t.json"), {}, Table({}, "t"))
    assert problem is not None and "Error" in problem


def test_cache_dir_precedence(monkeypatch):
    assert tuning.cache_dir({"MPIKV_CACHE_DIR": "/c", "XDG_CACHE_HOME": "/x"}) == "/c"
    assert tuning.cache_dir({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "mpikv")
    monkeypatch.setenv("HOME", "/home/u")
    assert tuning.cache_dir({}) == os.path.join("/home/u", ".cache", "mpikv")


def test_candidates_include_copy_forms_only_out_of_place():
    class Stub:
        size = 2
    names_in = tuning.candidates(IN_PLACE, Stub())
    names_out = tuning.candidates(OUT_OF_PLACE, Stub())
    assert "allreduce" in names_in and not any(n.startswith("copy+") for n in names_in)
    assert "copy+allreduce" in names_out and "allreduce" in names_out
    assert "shared" not in names_in   # a transport without node groups cannot share memory
