"""The KVStore's pieces on their own: row-table calls, saves, the checkpoint
directory, the elastic loop, a joined rank's replay (no MPI: a local transport
or fakes)."""

import logging

import numpy as np
import pytest

import mpikv
from mpikv.store import config
from mpikv.elastic import loop as elastic
from mpikv import errors
from mpikv.elastic.checkpoints import CheckpointDir, manifest_reads, name_of
from mpikv.store.join import Joiner
from mpikv.rows.tables import RowTables
from mpikv.rows.rowsparse import RowSparse
from mpikv.state.saves import Saves
from mpikv.transport import make_transport


def _tables():
    return RowTables(make_transport("local", None, config.resolve()))


def _failures(call):
    return [(cls, key) for cls, key, _ in call.errors]


class _Engine:
    """What a row call reads of the engine: the updater and optimizer (none here), the
    dense keys (``dense``: key -> (shape, dtype)) and their type."""
    updater_kind = None
    optimizer = None
    owners = None
    key_type = None

    def __init__(self, dense=None):
        self.dense = dense or {}

    def lookup(self, key):
        return self.dense.get(key)


def test_init_call_checks_the_key_and_shape_and_installs_on_the_action():
    tables = _tables()
    call, action = tables.init_call("emb", (4, 2), np.float32, 1.5, False, _Engine())
    assert call.errors == [] and "emb" not in tables
    assert call.settings == {"row_sparse_weight": False}
    assert [(i.key, i.shape, i.dtype) for i in call.items] == [("emb", (4, 2), np.float32)]
    action()
    assert "emb" in tables and (tables.tables["emb"].block == 1.5).all()
    again, _ = tables.init_call("emb", (4, 2), np.float32, None, False, _Engine())
    dense, _ = tables.init_call("w", (4, 2), np.float32, None, False, _Engine({"w": ((2,), "f4")}))
    flat, _ = tables.init_call("x", (), np.float32, None, False, _Engine())
    assert _failures(again) == [("DuplicateInitError", "emb")]
    assert _failures(dense) == [("DuplicateInitError", "w")]
    assert _failures(flat) == [("ShapeError", "x")]


def test_an_initializer_that_raises_is_the_calls_input_error():
    def init(lo, hi):
        raise ValueError("no rows today")
    call, _ = _tables().init_call("emb", (4, 2), np.float32, init, False, _Engine())
    ((cls, key, message),) = call.errors
    assert (cls, key) == ("InputError", "emb") and "raised ValueError: no rows today" in message


def test_push_call_takes_row_sparse_values_of_row_tables_only():
    tables = _tables()
    tables.init_call("emb", (4, 2), np.float32, 0.0, False, _Engine())[1]()
    rows = RowSparse(np.array([1]), np.ones((1, 2), np.float32), (4, 2))
    assert tables.is_rows_call("emb", np.ones(2)) and tables.is_rows_call("w", rows)
    assert not tables.is_rows_call("w", np.ones(2))
    good, _ = tables.push_call("emb", rows, _Engine())
    assert good.errors == [] and good.settings == {"priority": 0, "updater": None}
    assert good.keys == ["emb"]
    assert _failures(tables.push_call(["emb", "w"], [rows], _Engine())[0]) == [
        ("InputError", None)]
    assert _failures(tables.push_call(["emb", "w"], [rows, rows], _Engine())[0]) == [
        ("UnknownKeyError", "w")]
    assert _failures(tables.push_call("emb", np.ones((4, 2)), _Engine())[0]) == [
        ("ValueTypeError", "emb")]
    wide = RowSparse(np.array([1]), np.ones((1, 3), np.float32), (4, 3))
    assert _failures(tables.push_call("emb", wide, _Engine())[0]) == [("ShapeError", "emb")]


def test_pull_call_fills_a_dense_out_and_checks_the_ids():
    tables = _tables()
    tables.init_call("emb", (4, 2), np.float32, lambda lo, hi: np.arange(
        lo * 2, hi * 2, dtype=np.float32).reshape(-1, 2), False, _Engine())[1]()
    out = np.full((4, 2), 9.0, np.float32)
    call, action = tables.pull_call("emb", out, [3, 1, 3], 0, _Engine())
    assert call.errors == []
    rows = action()
    assert rows.indices.tolist() == [1, 3]
    np.testing.assert_array_equal(out, [[0, 0], [2, 3], [0, 0], [6, 7]])
    assert _failures(tables.pull_call("nope", None, [0], 0, _Engine())[0]) == [("UnknownKeyError", "nope")]
    assert _failures(tables.pull_call("emb", None, [4], 0, _Engine())[0])[0][1] == "emb"
    assert _failures(tables.pull_call("emb", np.zeros(3), [0], 0, _Engine())[0]) == [("ShapeError", "emb")]


class _Protocol:
    """Runs a call's action unless it failed (as the agreement would, on every rank)."""
    closed = False

    def __init__(self):
        self.ops = []

    def collective(self, call, action):
        self.ops.append(call.op)
        if call.errors:
            raise getattr(errors, call.errors[0][0])(call.errors[0][2])
        return action()


class _Handle:
    def __init__(self, name, done):
        self.fname, self.done = name, done

    def finish(self):
        self.done.append(("finish", self.fname))

    def abandon(self):
        self.done.append(("abandon", self.fname))


def test_saves_commit_in_order_up_to_the_handle_waited_for():
    done = []
    saves = Saves(_Protocol(), _Engine(), None)
    a, b, c = (_Handle(n, done) for n in "abc")
    saves.pending.extend([a, b, c])
    saves.commit(b)
    assert done == [("finish", "a"), ("finish", "b")] and saves.pending == [c]
    assert saves.protocol.ops == ["save_checkpoint_wait"]
    saves.close()   # the newest, and so every one before it
    assert done[-1] == ("finish", "c") and saves.pending == []


def test_abandoned_saves_are_never_committed():
    done = []
    saves = Saves(_Protocol(), _Engine(), None)
    saves.pending.extend([_Handle("a", done), _Handle("b", done)])
    saves.abandon()
    saves.close()
    assert done == [("abandon", "a"), ("abandon", "b")] and saves.pending == []


def test_saving_optimizer_states_needs_an_optimizer():
    with pytest.raises(mpikv.OptimizerError, match="no optimizer is set"):
        Saves(_Protocol(), _Engine(), None).save_states("f", False)


def test_checkpoint_dir_finds_the_complete_ones_and_prunes_the_rest(tmp_path):
    for step in (0, 3, 6, 9):
        (tmp_path / name_of(step)).mkdir()
        (tmp_path / f"{name_of(step)}.trainer.json").write_text("{}")
    (tmp_path / f"{name_of(12)}.trainer.json").write_text("")   # a save cut short
    (tmp_path / "notes.txt").write_text("kept")
    found = CheckpointDir(tmp_path, lambda p: p.is_dir())
    assert name_of(12) == "step-000000012" and found.path_of(3) == tmp_path / name_of(3)
    assert found.newest_first() == [(s, tmp_path / name_of(s)) for s in (9, 6, 3, 0)]
    assert sorted(found.steps()) == [0, 3, 6, 9, 12]
    found.prune(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt", name_of(6), f"{name_of(6)}.trainer.json", name_of(9),
        f"{name_of(9)}.trainer.json"]
    assert CheckpointDir(tmp_path / "none").newest_first() == []


def test_a_checkpoint_is_complete_once_its_manifest_reads(tmp_path):
    kv = mpikv.create("local")
    kv.init("w", np.ones(3))
    kv.save_checkpoint(str(tmp_path / name_of(5)))
    (tmp_path / name_of(7)).mkdir()   # parts, no manifest
    assert manifest_reads(tmp_path / name_of(5)) and not manifest_reads(tmp_path / name_of(7))
    assert CheckpointDir(tmp_path).newest_first() == [(5, tmp_path / name_of(5))]
    assert elastic.newest_first(tmp_path) == [(5, tmp_path / name_of(5))]
    kv.close()


def _loss(lost, survivors):
    return mpikv.RankLostError("lost", lost=lost, lost_world=lost, survivors=survivors)


def test_run_loop_recovers_from_each_loss_and_returns_the_bodys_result(caplog):
    store, calls, losses = ["first"], [], [_loss([1], [0, 2]), _loss([0], [1])]

    def body(recovered):
        calls.append(("body", store[0]))
        recovered(4, 2)
        if losses:
            raise losses.pop(0)
        return "done"

    def recover(lost, older):
        calls.append(("recover", lost.lost, older))
        store[0] = f"after {lost.lost}"
    with caplog.at_level(logging.WARNING, logger=elastic.log.name):
        assert elastic.run_loop("loop", body, recover, lambda: store[0]) == "done"
    assert calls == [("body", "first"), ("recover", [1], None), ("body", "after [1]"),
                     ("recover", [0], None), ("body", "after [0]")]
    assert [r.getMessage() for r in caplog.records] == [
        "loop: lost rank 1 of 3; going on from step 4 on 2 ranks",
        "loop: lost rank 0 of 2; going on from step 4 on 2 ranks"]


def test_a_loss_during_a_recovery_hands_the_older_store_to_the_next():
    store, olders, losses = ["first"], [], [_loss([1], [0, 2, 3]), _loss([2], [0, 1])]

    def body(recovered):
        if losses:
            raise losses.pop(0)
        recovered(0, 2)
        return store[0]

    def recover(lost, older):
        olders.append(older)
        if losses:   # lost again before the recovery was done
            store[0] = "half made"
            raise losses.pop(0)
        store[0] = "made"
    assert elastic.run_loop("loop", body, recover, lambda: store[0]) == "made"
    assert olders[0] is None
    first, loss = olders[1]
    assert first == "first" and (loss.lost, loss.survivors) == ([1, 3], [0, 2])


def test_todo_skips_the_steps_done():
    assert list(elastic.todo(5, 2)) == [2, 3, 4] and elastic.todo([1, 4, 7], 4) == [4, 7]


def test_refuse_unless_positive_names_the_caller_and_the_first_bad_number():
    kv = mpikv.create("local")
    elastic.refuse_unless_positive(kv, "trainer.run", min_workers=2)   # nothing refused
    with pytest.raises(mpikv.InputError, match=r"trainer\.run: keep must be a positive int, "
                                               r"not True"):
        elastic.refuse_unless_positive(kv, "trainer.run", every=3, keep=True, min_workers=0)
    kv.barrier()
    kv.close()


def test_refuse_too_few_raises_only_below_min_workers():
    one = _loss([1, 2], [0])
    elastic.refuse_too_few("kv.run", one, 1, "no matter")   # enough: returns
    with pytest.raises(mpikv.MPIKVError, match=r"^kv\.run: 1 rank survives, fewer than "
                                               r"min_workers=2 \(.*\); it is in d$") as got:
        elastic.refuse_too_few("kv.run", one, 2, "it is in d")
    assert got.value.__cause__ is one
    with pytest.raises(mpikv.MPIKVError, match="2 ranks survive, fewer than min_workers=3"):
        elastic.refuse_too_few("kv.run", _loss([1], [0, 2]), 3, "")


def test_refuse_fails_the_call_on_every_rank_and_leaves_the_store_usable():
    kv = mpikv.create("local")
    with pytest.raises(mpikv.InputError, match="not today; nothing was applied"):
        kv.refuse(mpikv.InputError, "not today", context="called refuse")
    with pytest.raises(TypeError, match="MPIKVError subclass"):
        kv.refuse(ValueError, "no")
    kv.barrier()
    kv.close()


class _Transport:
    """Records what a joined rank's replay moves; an allreduce_ adds 1 (the others)."""

    def __init__(self):
        self.moved = []

    def allreduce_(self, array, what):
        self.moved.append(("allreduce_", array.shape, str(array.dtype)))
        array += 1

    def barrier(self, what):
        self.moved.append(("barrier",))


class _JoinProtocol:
    def __init__(self):
        self.transport, self.engine = _Transport(), None


def test_a_replayed_allreduce_sums_into_the_array_on_call_gives():
    joiner, seen = Joiner(_JoinProtocol()), []
    mine = np.full(2, 5.0)

    def on_call(call):
        seen.append((call.op, call.keys, call.settings["tag"], call.done))
        return None if call.done else mine
    rec = {"op": "allreduce_", "keys": [],
           "settings": {"shape": "(2,)", "dtype": "float64", "tag": "status"}}
    joiner.replay(rec, on_call, True)
    assert seen == [("allreduce_", [], "status", False), ("allreduce_", [], "status", True)]
    assert joiner.protocol.transport.moved == [("allreduce_", (2,), "float64")]
    np.testing.assert_array_equal(mine, [6.0, 6.0])


def test_a_replayed_barrier_takes_part_and_on_call_gives_no_array_there():
    joiner = Joiner(_JoinProtocol())
    rec = {"op": "barrier", "keys": [], "settings": {}}
    joiner.replay(rec, None, True)
    assert joiner.protocol.transport.moved == [("barrier",)]
    with pytest.raises(TypeError, match="on_call returned ndarray before a barrier"):
        joiner.replay(rec, lambda call: np.zeros(1), True)
    with pytest.raises(TypeError, match="on_call returned a value after a barrier"):
        joiner.replay(rec, lambda call: 1 if call.done else None, True)


def test_a_store_on_the_survivors_is_made_only_from_their_error():
    from mpikv.store import factory, recovery
    with pytest.raises(mpikv.ValueTypeError, match="takes the RankLostError they got, not "
                                                   "ValueError"):
        factory.remake_store("dist_sync", ValueError("no"))
    with pytest.raises(mpikv.ValueTypeError, match="not RankLostError"):   # no survivors' comm
        factory.remake_store("dist_sync", _loss([1], [0]))
    with pytest.raises(mpikv.ValueTypeError, match="create_on_survivors takes the RankLostError"):
        recovery.create_on_survivors(_loss([1], [0]))
