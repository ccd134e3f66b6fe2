"""Why ranks may not proceed: the messages every rank raises, built without MPI."""

import numpy as np

from mpikv import errors
from mpikv.calls.agreement import (describe, explain, format_ranks, in_context, is_joined, joined_record, record)
from mpikv.calls.reader import Call, CallReader


def _record(op, keys, shape=(2, 3), dtype="float32", settings=None, lookup=None):
    reader = CallReader(lookup or (lambda k: None), lambda: None)
    values = [np.zeros(shape, dtype) for _ in keys]
    call = reader.read(op, list(keys), values, new_keys=True, need_values=True,
                       settings=settings)
    return describe(call)


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_equal_calls_have_equal_digests_whatever_the_key_order():
    a, ra = _record("init", [1, 2, 3])
    b, rb = _record("init", [3, 1, 2])
    assert a == b
    assert explain([ra, rb]) is None


def test_different_shapes_name_key_and_ranks():
    _, r0 = _record("init", [1, 2])
    _, r1 = _record("init", [1, 2], shape=(3, 2))
    cls, msg = explain([r0, r0, r1])
    assert cls is errors.MismatchError
    assert msg == "init: key 1 has different shapes: (2, 3) on ranks 0-1; (3, 2) on rank 2"


def test_different_dtypes():
    _, r0 = _record("init", ["w"])
    _, r1 = _record("init", ["w"], dtype="float64")
    cls, msg = explain([r0, r1])
    assert cls is errors.MismatchError
    assert msg == "init: key 'w' has different dtypes: float32 on rank 0; float64 on rank 1"


def test_missing_key():
    _, r0 = _record("init", [1, 2])
    _, r1 = _record("init", [1])
    cls, msg = explain([r0, r1, r0])
    assert cls is errors.MismatchError
    assert msg == "init: key 2 was given on ranks 0, 2 but not on rank 1"


def test_different_operations():
    _, r0 = _record("init", [1])
    _, r1 = _record("broadcast", [1])
    cls, msg = explain([r0, r1])
    assert msg == "ranks called different operations: init on rank 0; broadcast on rank 1"


def test_settings_differ():
    d0, r0 = _record("init", [1], settings={"updater": None})
    d1, r1 = _record("init", [1], settings={"updater": "function"})
    assert d0 != d1
    cls, msg = explain([r0, r1])
    assert cls is errors.MismatchError
    assert msg == 'init: ranks differ in updater: null on rank 0; "function" on rank 1'


def test_input_error_on_one_rank_wins_and_keeps_its_class():
    _, ok = _record("init", [1])
    _, bad = _record("init", [1], lookup=lambda k: ((2, 3), np.dtype("float32")))
    cls, msg = explain([ok, bad, bad])
    assert cls is errors.DuplicateInitError
    assert msg.startswith("init: ranks 1-2: key 1 is already initialised")


def test_digest_ignores_error_text():
    reader = CallReader(lambda k: None, lambda: None)
    call = reader.read("push", [1], [None], need_values=True)
    digest, record = describe(call)
    assert record["errors"] and record["errors"][0][0] == "UnknownKeyError"


def test_joined_ranks_take_no_part_in_the_comparison():
    _, r0 = _record("init", [1, 2])
    _, r1 = _record("init", [1])
    _, r2 = _record("init", [1, 2], shape=(3, 2))
    assert explain([None, r0, None, r0]) is None
    assert explain([r0, None]) is None
    assert explain([r0, None, r1]) == (
        errors.MismatchError, "init: key 2 was given on rank 0 but not on rank 2")
    assert explain([None, r0, r2]) == (
        errors.MismatchError,
        "init: key 1 has different shapes: (2, 3) on rank 1; (3, 2) on rank 2")


# -- contexts: what each rank was doing, in its caller's terms ---------------------------
STEPS = "the ranks ran different numbers of steps; for uneven data use trainer.join()"
SAVE = "save_checkpoint is collective: every rank must call it"


def _in(context, op="push", keys=("w",), **kw):
    """A record of ``op`` made in ``context`` (``(activity, hint)``)."""
    reader = CallReader(lambda k: None, lambda: None)
    call = reader.read(op, list(keys), [np.zeros(2, "float32") for _ in keys], new_keys=True,
                       need_values=True, **kw) if keys else Call(op)
    return record(call, context)


STEP_13 = ("is in step 13", None)


def test_a_rank_that_closed_early_is_named_in_the_callers_terms():
    closed = _in(("closed the Trainer after step 12", STEPS), "Trainer.close", ())
    assert explain([_in(STEP_13), closed]) == (
        errors.MismatchError,
        f"rank 1 closed the Trainer after step 12 while rank 0 is in step 13: {STEPS}")


def test_several_ranks_are_and_the_ranks_with_a_hint_come_first():
    ended = _in(("ended its process after step 12", STEPS), "exit", ())
    assert explain([_in(STEP_13), _in(STEP_13), ended, _in(STEP_13)])[1] == (
        f"rank 2 ended its process after step 12 while ranks 0-1, 3 are in step 13: {STEPS}")
    saving = _in(("called save_checkpoint after step 12", SAVE), "save_checkpoint", ())
    assert explain([saving, _in(STEP_13), _in(STEP_13)])[1] == (
        f"rank 0 called save_checkpoint after step 12 while ranks 1-2 are in step 13: {SAVE}")
    assert explain([saving, saving, _in(STEP_13)])[1].startswith(
        "ranks 0-1 called save_checkpoint after step 12 while rank 2 is in step 13")


def test_three_activities_and_each_hint_once():
    closed = _in(("closed the Trainer after step 12", STEPS), "Trainer.close", ())
    ended = _in(("ended its process after step 12", STEPS), "exit", ())
    saving = _in(("called save_checkpoint after step 12", SAVE), "save_checkpoint", ())
    assert explain([_in(STEP_13), closed, saving, ended])[1] == (
        "rank 1 closed the Trainer after step 12 while rank 2 called save_checkpoint after "
        "step 12 and rank 3 ended its process after step 12 and rank 0 is in step 13: "
        f"{STEPS}; {SAVE}")


def test_a_rank_without_a_context_is_named_by_its_call():
    closed = _in(("closed the Trainer after step 12", STEPS), "Trainer.close", ())
    assert explain([_in(None), closed])[1] == (
        f"rank 1 closed the Trainer after step 12 while rank 0 called push: {STEPS}")
    # No hint anywhere: no colon.
    assert explain([_in(None), _in(("has left the loop", None), "barrier", ())])[1] == (
        "rank 1 has left the loop while rank 0 called push")


def test_contexts_that_do_not_tell_the_ranks_apart_leave_the_message_as_it_was():
    # The same step: the keys differ, and that is what the message says.
    assert explain([_in(STEP_13, keys=("w",)), _in(STEP_13, keys=("w", "b"))]) == (
        errors.MismatchError, "push: key 'b' was given on rank 1 but not on rank 0")
    # No context on any rank: the store calls.
    assert explain([_in(None), _in(None, "barrier", ())]) == (
        errors.MismatchError,
        "ranks called different operations: push on rank 0; barrier on rank 1")


def test_an_input_error_keeps_its_class_and_message_whatever_the_contexts():
    reader = CallReader(lambda k: None, lambda: None)
    bad = reader.read("push", ["w"], [None], need_values=True)
    good = _record("push", ["w"])[1]
    good.update(doing="is in step 13", hint=None)
    cls, msg = explain([good, record(bad, ("is in step 12", None))])
    assert cls is errors.UnknownKeyError and msg.startswith("push: rank 1: key 'w'")


def test_a_joined_rank_says_what_it_did_and_takes_no_part():
    joined = joined_record(("called trainer.join() after step 10", "join them"))
    assert is_joined(joined) and is_joined(None) and not is_joined(_in(STEP_13))
    assert joined_record(None) is None
    # The others agree: the call goes on.
    assert explain([joined, _in(STEP_13), _in(STEP_13)]) is None
    saving = _in(("called save_checkpoint after step 12", SAVE), "save_checkpoint", ())
    assert explain([joined, saving, _in(STEP_13)])[1] == (
        "rank 0 called trainer.join() after step 10 while rank 1 called save_checkpoint after "
        f"step 12 and rank 2 is in step 13: join them; {SAVE}")
    assert in_context([joined, saving]) == (
        "rank 0 called trainer.join() after step 10 while rank 1 called save_checkpoint after "
        f"step 12: join them; {SAVE}")
    assert in_context([None, saving]) == (
        f"rank 1 called save_checkpoint after step 12 while rank 0 has joined (kv.join()): {SAVE}")


def test_in_context_needs_a_context_and_two_activities():
    assert in_context([_in(None), _in(None, "barrier", ())]) is None
    assert in_context([_in(STEP_13), _in(STEP_13, "barrier", ())]) is None
    assert in_context([_in(STEP_13)]) is None


def test_a_context_is_in_the_record_not_in_the_fingerprint(make_store):
    reader = CallReader(lambda k: None, lambda: None)
    call = reader.read("init", ["w"], [np.zeros(2, "float32")], new_keys=True, need_values=True)
    digest, plain = describe(call)
    told = record(call, ("is in step 13", "a hint"))
    assert (told["doing"], told["hint"]) == ("is in step 13", "a hint")
    assert {k: v for k, v in told.items() if k not in ("doing", "hint")} == plain
    assert describe(call)[0] == digest
    # A local store takes a context and goes on as before.
    kv = make_store()
    kv.set_context("is in step 1", "a hint", exit=("ended its process after step 0", None))
    kv.init("w", np.zeros(2, "float32"))
    kv.set_context(None)
    kv.push("w", np.ones(2, "float32"))
