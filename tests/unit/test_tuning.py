"""The tuner's decisions on recorded timings, its table and its cache file (no MPI)."""

import json
import math
import os

import pytest

from mpikv import reducers
from mpikv.tuning import table as tuning
from mpikv.tuning.table import DEVICE, IN_PLACE, OUT_OF_PLACE, SIZES, TO_OWNERS, Table

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
        tuning.forced("spiral", "x")
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
    for bad in ({**good, "format": 99}, {**good, "winners": [["in_place", MiB, "spiral"]]},
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


def test_ties_between_a_strategy_and_its_copy_form_and_classes_without_a_finite_time():
    times = {(OUT_OF_PLACE, 4096): {"copy+allreduce": 1.0, "allreduce": 1.0},
             (OUT_OF_PLACE, 16384): {"copy+reduce_bcast": 1.0, "copy+allreduce": 1.0},
             (IN_PLACE, 4096): {},
             (IN_PLACE, 16384): {"allreduce": None, "shared": -math.inf}}
    table = tuning.decide(times, "t")
    assert table.winners == {(OUT_OF_PLACE, 4096): "allreduce",
                             (OUT_OF_PLACE, 16384): "copy+allreduce"}
    assert table.times[(IN_PLACE, 16384)] == {"allreduce": None, "shared": -math.inf}
    # the in-place classes have no winner, so in place falls back to allreduce
    assert table.choose(4096, True) == "allreduce"


def test_choose_is_per_mode_and_equal_distances_take_the_smaller_class():
    table = Table({(IN_PLACE, 4096): "reduce_bcast", (IN_PLACE, 16384): "shared"}, "t")
    assert table.choose(8192, True) == "reduce_bcast"      # 2 x from both: the smaller
    assert table.choose(8193, True) == "shared"
    assert table.choose(4096, False) == "allreduce"        # no out-of-place entry
    assert [r[0] for r in table.rows()] == list(SIZES)
    assert table.rows()[-1] == (SIZES[-1], "shared", "allreduce", "shared")  # owners: in place


def test_size_class_rounds_on_a_log_scale():
    assert tuning.size_class(0) == 4096                     # empty buckets count as 1 byte
    assert tuning.size_class(8192) == 4096                  # the midpoint goes down
    assert tuning.size_class(8193) == 16384
    assert tuning.size_class(3 * MiB) == 4 * MiB
    assert tuning.size_class(2 * MiB) == MiB


def test_default_table_values_follow_DEFAULT():
    default = tuning.default_table()
    assert "measured default" in default.source
    assert {default.choose(s, True) for s in SIZES} == {"allreduce"}
    assert [default.choose(s, False) for s in SIZES] == (
        ["allreduce"] * 5 + ["copy+allreduce"] * 4)        # 4 KiB..1 MiB, then 4..256 MiB
    forced = tuning.forced("shared", "f")
    assert {forced.choose(s, m) for s in SIZES for m in (True, False)} == {"shared"}
    assert forced.source == "f" and len(forced.winners) == 3 * len(SIZES)


def test_json_round_trip_of_a_whole_table_and_more_refusals():
    table = tuning.default_table()
    table.times = {(OUT_OF_PLACE, 4096): {"allreduce": 1e-5, "copy+allreduce": 2e-5}}
    back = Table.from_json(json.loads(json.dumps(table.to_json())), source="given")
    assert back.winners == table.winners and back.times == table.times
    assert back.source == "given" and back.rows() == table.rows()
    good = {"format": tuning.FORMAT, "winners": [["in_place", 4096, "allreduce"]]}
    assert Table.from_json(good).winners == {(IN_PLACE, 4096): "allreduce"}
    for bad in ({"format": tuning.FORMAT},                                  # no winners
                {**good, "format": 0}, {**good, "winners": 5},
                {**good, "winners": [["in_place", 4096]]},                  # short entry
                {**good, "winners": [["in_place", 4096, 7]]},               # name not text
                {**good, "winners": [["in_place", "4096", "allreduce"]]},
                {**good, "winners": [["in_place", 4096, "copy+copy+allreduce"]]},
                {**good, "times": [["in_place", 4096, 3.0]]},               # times not a dict
                {**good, "times": [["in_place", 4096, {"allreduce": "fast"}]]}, None):
        with pytest.raises(ValueError):
            Table.from_json(bad)


@pytest.mark.parametrize("content", [
    b"[]", b"null", b'"text"', b'{"key": 1}', b"\xff\xfe not utf-8",
    b'{"key": {"ranks": 2}, "table": []}',
    b'{"key": {"ranks": 2}, "table": {"format": 1, "winners": 5}}',
    b'{"key": {"ranks": 2}, "table": {"format": 1, "winners": [],'
    b' "times": [["in_place", 4096, 3]]}}',
])
def test_read_cache_returns_none_for_any_corrupt_file(tmp_path, content):
    path = tmp_path / "tune.json"
    path.write_bytes(content)
    assert tuning.read_cache(str(path), {"ranks": 2}) is None


def test_read_cache_of_a_directory_or_a_missing_file_is_none(tmp_path):
    assert tuning.read_cache(str(tmp_path), {}) is None
    assert tuning.read_cache(str(tmp_path / "none" / "t.json"), {}) is None


def test_write_cache_replaces_and_leaves_no_temp_file_on_failure(tmp_path):
    path = str(tmp_path / "sub" / "t.json")                 # the folder is made
    key = {"ranks": 2}
    assert tuning.write_cache(path, key, tuning.forced("reduce_bcast", "first")) is None
    assert tuning.write_cache(path, key, tuning.forced("shared", "second")) is None
    assert tuning.read_cache(path, key).choose(MiB, True) == "shared"
    assert os.listdir(tmp_path / "sub") == ["t.json"]
    problem = tuning.write_cache(str(tmp_path / "x.json"), {"bad": object()}, Table({}, "t"))
    assert problem.startswith("TypeError")                  # reported, not raised
    assert sorted(os.listdir(tmp_path)) == ["sub"]          # neither file nor temp file
    data = json.loads((tmp_path / "sub" / "t.json").read_text())
    assert data["key"] == key and data["table"]["format"] == tuning.FORMAT and data["date"]


def test_cache_dir_reads_home_from_the_given_environment():
    assert tuning.cache_dir({"HOME": "/h"}) == os.path.join("/h", ".cache", "mpikv")
    assert tuning.cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "mpikv")
    assert tuning.cache_dir({"MPIKV_CACHE_DIR": "", "XDG_CACHE_HOME": "/x"}) == "/x/mpikv"
    path = tuning.cache_path({"ranks": 2}, {"MPIKV_CACHE_DIR": "/c"})
    assert path == tuning.cache_path({"ranks": 2}, {"MPIKV_CACHE_DIR": "/c"})   # stable
    assert os.path.basename(path).startswith("tune-") and path.endswith(".json")


def test_tune_rows_print_the_tables_winner_and_the_runner_up():
    from mpikv.tools import tune
    times = {(IN_PLACE, 4096): {"shared": 1e-3, "allreduce": 1e-3, "reduce_bcast": 1.5e-3},
             (OUT_OF_PLACE, 4096): {"allreduce": 2e-3, "copy+allreduce": math.nan},
             (OUT_OF_PLACE, MiB): {"allreduce": math.inf}}
    rows = tune.rows(tuning.decide(times, "t"))
    assert [(r["size"], r["mode"]) for r in rows] == [(4096, IN_PLACE), (4096, OUT_OF_PLACE)]
    first, second = rows
    assert first["winner"] == "allreduce" and first["ms"] == pytest.approx(1.0)  # the tie
    assert first["runner_up"] == "shared" and first["slower_pct"] == pytest.approx(0.0)
    assert second["winner"] == "allreduce" and second["runner_up"] is None       # NaN left out
    assert second["slower_pct"] is None


def test_tune_parse_sizes():
    from mpikv.tools import tune
    assert tune.parse_sizes("4K, 1m,16777216,4KiB") == [4096, MiB, 16 * MiB]
    for bad in ("3K", "1G", "", "x", "4K,,1M"):
        with pytest.raises(ValueError):
            tune.parse_sizes(bad)


# -- the to-the-owners and device columns, the link in the key -------------------
def test_owners_take_their_column_else_the_in_place_one():
    table = Table({(IN_PLACE, MiB): "allreduce", (OUT_OF_PLACE, MiB): "copy+shared",
                   (TO_OWNERS, MiB): "reduce_scatter"}, "t")
    assert table.choose(MiB, True, owners=True) == "reduce_scatter"
    assert table.choose(MiB, False, owners=True) == "reduce_scatter"   # measured in place
    assert table.choose(MiB, False) == "copy+shared"
    older = Table({(IN_PLACE, MiB): "hierarchical", (OUT_OF_PLACE, MiB): "copy+shared"}, "t")
    assert older.choose(MiB, False, owners=True) == "hierarchical"     # no column: in place
    assert tuning.forced("copy+ring", "f").choose(MiB, False, owners=True) == "ring"
    assert tuning.default_table().choose(MiB, True, owners=True) in reducers.NAMES


def test_device_buckets_take_the_device_columns_where_measured_else_the_hosts():
    host = {(IN_PLACE, MiB): "allreduce", (TO_OWNERS, MiB): "reduce_scatter"}
    table = Table({**host, (DEVICE + IN_PLACE, MiB): "hierarchical"}, "t")
    assert table.choose(MiB, True, device=True) == "hierarchical"
    assert table.choose(MiB, True) == "allreduce"
    # no device:to_owners column: the host's to_owners, not the device in-place one
    assert table.choose(MiB, True, owners=True, device=True) == "reduce_scatter"
    assert Table(host, "t").choose(MiB, True, device=True) == "allreduce"
    back = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert back.winners == table.winners


def test_decide_keeps_device_columns_apart():
    times = {(IN_PLACE, MiB): {"allreduce": 1.0, "shared": 2.0},
             (DEVICE + IN_PLACE, MiB): {"allreduce": 2.0, "shared": 1.0}}
    table = tuning.decide(times, "t")
    assert table.choose(MiB, True) == "allreduce"
    assert table.choose(MiB, True, device=True) == "shared"


def test_a_format_1_cache_is_measured_again_not_misread(tmp_path, caplog):
    key = {"library": "Open MPI v5", "ranks": 2, "ranks_per_node": [2], "hosts": ["vm"]}
    path = tuning.cache_path(key, {"MPIKV_CACHE_DIR": str(tmp_path)})
    old = {"format": 1, "source": "mpikv tune (2 ranks, 3 reps)",
           "winners": [["in_place", MiB, "shared"], ["out_of_place", MiB, "copy+shared"]],
           "times": []}
    with open(path, "w") as f:
        json.dump({"key": key, "date": "2026-11-23 10:00:00", "table": old}, f)
    with caplog.at_level("INFO", logger="mpikv"):
        assert tuning.read_cache(path, key) is None
    assert "format 1" in caplog.text and "measuring again" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert tuning.FORMAT == 2
    with pytest.raises(ValueError, match="not a tuning table of this version"):
        Table.from_json(old)


class _Ranks:
    """What cache_key reads of a transport, each rank's environment given."""

    library, mpi_version = "Open MPI v5.0.11\nmore", "3.1"

    def __init__(self, records):
        self.records, self.size = records, len(records)

    def allgather_records(self, record, what):
        return list(self.records)


def test_the_cache_key_names_the_link_from_rank_0(monkeypatch):
    plain = tuning.cache_key(_Ranks([("h1", None, None), ("h2", None, None)]))
    assert plain == {"library": "Open MPI v5.0.11", "mpi_version": "3.1", "ranks": 2,
                     "ranks_per_node": [1, 1], "hosts": ["h1", "h2"],
                     "placement": [0, 1]}                                 # no rate
    fast = tuning.cache_key(_Ranks([("h1", "10Gbit", None), ("h2", "10Gbit", None)]))
    slow = tuning.cache_key(_Ranks([("h1", "1Gbit", "ib"), ("h2", "other", "x")]))
    assert fast == {**plain, "rate": "10Gbit"}
    assert slow == {**plain, "rate": "1Gbit", "label": "ib"}            # rank 0's
    env = {"MPIKV_CACHE_DIR": "/c"}
    assert len({tuning.cache_path(k, env) for k in (plain, fast, slow)}) == 3


def test_the_cache_key_tells_placements_apart():
    """Ranks by block and ranks taking turns between hosts: other hops on the link."""
    block = tuning.cache_key(_Ranks([(h, None, None) for h in ("h1", "h1", "h2", "h2")]))
    turns = tuning.cache_key(_Ranks([(h, None, None) for h in ("h1", "h2", "h1", "h2")]))
    assert block["placement"] == [0, 0, 1, 1] and turns["placement"] == [0, 1, 0, 1]
    env = {"MPIKV_CACHE_DIR": "/c"}
    assert tuning.cache_path(block, env) != tuning.cache_path(turns, env)


def test_cache_key_reads_this_ranks_environment(monkeypatch):
    class One(_Ranks):
        def allgather_records(self, record, what):
            return [record]
    monkeypatch.setenv("MPIKV_CLUSTER_RATE", "1Gbit")
    monkeypatch.setenv("MPIKV_TUNE_LABEL", "roce-25g")
    key = tuning.cache_key(One([None]))
    assert key["rate"] == "1Gbit" and key["label"] == "roce-25g"
    monkeypatch.delenv("MPIKV_CLUSTER_RATE")
    monkeypatch.setenv("MPIKV_TUNE_LABEL", "")
    assert "rate" not in tuning.cache_key(One([None])) and "label" not in tuning.cache_key(
        One([None]))


def test_rows_have_the_to_owners_column_and_candidates_it():
    table = Table({(TO_OWNERS, MiB): "ring", (IN_PLACE, MiB): "allreduce"}, "t")
    assert table.rows()[4] == (MiB, "allreduce", "allreduce", "ring")

    class Stub:
        size = 2
    assert tuning.candidates(TO_OWNERS, Stub()) == tuning.candidates(IN_PLACE, Stub())
    assert tuning.candidates(DEVICE + OUT_OF_PLACE, Stub()) == tuning.candidates(
        OUT_OF_PLACE, Stub())


def test_a_host_only_winner_is_not_used_for_gpu_buffers_mpi_takes_directly():
    """No GPU column measured: a host column's ``ring`` (numpy adds, so every GPU buffer
    staged) gives way to ``allreduce`` where MPI takes device buffers as they are."""
    from types import SimpleNamespace

    from mpikv import reducers

    def chosen(direct, table):
        transport = SimpleNamespace(size=2, rank=0, comm=object(),
                                    staging=SimpleNamespace(direct=direct))
        red = reducers.Chooser(transport, table, 1 << 20)._strategy(16 << 20, True, True,
                                                                    owners=True)
        return red.inner.name
    ring = tuning.forced("ring", "test")
    assert chosen(True, ring) == "allreduce"
    assert chosen(False, ring) == "ring"          # staged anyway: the host's winner
    measured = Table({**ring.winners, ("device:to_owners", 16 << 20): "ring"}, "gpu")
    assert measured.measured_on_device() and not ring.measured_on_device()
    assert chosen(True, measured) == "ring"       # timed on the GPU: trusted
