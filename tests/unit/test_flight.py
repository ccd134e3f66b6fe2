"""The flight recorder's ring, its texts and `mpikv trace`'s merge, without MPI."""

import json

import pytest

from mpikv import flight
from mpikv.__main__ import main


def _ring(calls, capacity=4):
    rec = flight.Recorder(capacity)
    for op, keys in calls:
        entry = rec.begin(0, rec._next + 1, op, keys, 8 * len(keys), 0)
        flight.agreed(entry)
        flight.ended(entry)
    return rec


def test_the_ring_keeps_the_last_calls_oldest_first():
    rec = _ring([("push", [i]) for i in range(10)], capacity=4)
    calls = rec.entries()
    assert [c["seq"] for c in calls] == [7, 8, 9, 10]
    assert [c["keys"] for c in calls] == [[6], [7], [8], [9]]
    assert all(c["end"] >= c["agreed"] >= c["start"] for c in calls)


def test_capacity_zero_records_nothing():
    rec = flight.Recorder(0)
    assert rec.begin(0, 1, "push", [1], 8, 0) is None
    flight.agreed(None)
    flight.ended(None)
    assert rec.entries() == []


def test_a_withdrawn_entry_leaves_the_ring_and_the_others_stay():
    # A store's creation is recorded while it runs, and withdrawn once it is made.
    rec = flight.Recorder(4)
    made = rec.begin(0, 0, "create", [], 0, 0)
    rec.begin(0, 1, "init", ["w"], 8, 0)
    rec.withdraw(made)
    assert [(c["op"], c["seq"]) for c in rec.entries()] == [("init", 1)]


def test_environment_sets_the_capacity():
    assert flight._capacity({"MPIKV_TRACE_CALLS": "5"}) == 5
    assert flight._capacity({}) == flight.DEFAULT_CALLS


def test_a_call_shows_four_keys_its_count_bytes_and_state():
    rec = flight.Recorder(4)
    entry = rec.begin(1, 12, "pushpull", list(range(10)), 3 << 20, [1] * 10)
    (call,) = rec.entries()
    assert flight.describe(call) == \
        "store 1 call 12: pushpull (keys 0, 1, 2, 3, ...; 10 keys, 3.0 MiB)"
    assert call["priority"] == "per key"
    now = call["start"] + 2.0
    assert flight.state(call, now) == "waiting for the other ranks to agree for 2.0 s"
    flight.agreed(entry)
    assert flight.state(rec.entries()[0], rec.entries()[0]["agreed"] + 1.5) == \
        "moving data for 1.5 s"
    flight.failed(entry, "MismatchError")
    assert flight.state(rec.entries()[0]) == "raised MismatchError"


def test_last_call_says_when_a_rank_is_in_no_call():
    rec = _ring([("barrier", [])])
    (call,) = rec.entries()
    assert flight.last_call([]) == "no collective call yet"
    assert flight.last_call([call], call["end"] + 4.0) == \
        "store 0 call 1: barrier (no keys), done; in no mpikv call since, for 4.0 s"


def _file(tmp_path, rank, calls, reason="timeout"):
    return flight.write(tmp_path, rank, calls, reason)


def test_merge_lines_up_calls_and_flags_where_ranks_differ(tmp_path):
    same = _ring([("init", ["w"]), ("push", ["w"])]).entries()
    other = _ring([("init", ["w"]), ("pull", ["w"])]).entries()
    short = _ring([("init", ["w"])]).entries()
    for rank, calls in enumerate([same, other, short]):
        _file(tmp_path, rank, calls)
    merged = flight.merge(flight.read(tmp_path))
    assert "first call the ranks differ on: store 0 call 2" in merged
    block = merged.split("store 0 call 2   <-- ranks differ\n", 1)[1].splitlines()
    assert block == ["  rank 0: push (keys 'w'; 1 key, 8 B), done",
                     "  rank 1: pull (keys 'w'; 1 key, 8 B), done",
                     "  rank 2: -- (not made)"]
    assert "store 0 call 1\n  rank 0: init" in merged   # equal everywhere: no flag


def test_merge_tells_a_call_older_than_a_ring_from_one_not_made(tmp_path):
    _file(tmp_path, 0, _ring([("push", [i]) for i in range(6)], capacity=2).entries())
    _file(tmp_path, 1, _ring([("push", [i]) for i in range(6)], capacity=6).entries())
    merged = flight.merge(flight.read(tmp_path))
    assert "store 0 call 1\n  rank 0: -- (older than its ring)\n  rank 1: push" in merged
    assert "first call the ranks differ on: none" in merged


def test_mpikv_trace_command(tmp_path, capsys):
    _file(tmp_path, 0, _ring([("push", [1])]).entries())
    assert main(["trace", str(tmp_path)]) == 0
    assert "mpikv trace: 1 rank(s): 0" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["trace", str(empty)]) == 1
    assert "no rank-N.json files" in capsys.readouterr().out
    (empty / "rank-3.json").write_text(json.dumps({"format": "other"}))
    assert main(["trace", str(empty)]) == 1
    assert "not an mpikv trace file" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["trace"])


@pytest.mark.parametrize("start_mpi", [False, True])
def test_outside_an_mpi_job_an_uncaught_exception_is_pythons_own(start_mpi):
    # import mpikv installs the hook that ends an MPI job (issue 38, class 3); with
    # MPI not running, or one rank, Python's own hook runs: no abort, status 1.
    import subprocess
    import sys
    code = ("from mpi4py import MPI; " if start_mpi else "") + (
        "import sys, mpikv; assert sys.excepthook is not sys.__excepthook__; "
        "raise ValueError('plain')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: plain"), proc.stderr
    assert "mpikv: uncaught" not in proc.stderr and "MPI_ABORT" not in proc.stderr
