"""trainer.run survives killed ranks: the survivors go on from the latest checkpoint
and end with the weights of an uninterrupted run (issue 28, ``redundancy="checkpoint"``).

One job (``scripts/mpirun.sh --ft -n 3``, tests/jobs/scripts/elastic_train.py):
rank 0 is killed while a checkpoint is being written, later rank 1 of the two
left; the last rank ends alone. Its refusals (``min_workers``, no checkpoints)
are tested in tests/unit/test_elastic.py.
"""

import os
import re
import sys
import uuid

import pytest

from .conftest import KILL_DETECTOR, KILL_SEEN_WITHIN, MPIRUN, launch
from .test_rank_lost import leftovers

SCRIPT = "tests/jobs/scripts/elastic_train.py"


def launch_job(directory, redundancy, kills="0@3,1@10", n=3, env=None):
    """The job's output, once it checked that the job ended well."""
    token = f"mpikv-ft-{uuid.uuid4().hex[:12]}"
    cmd = ["timeout", "-k", "5", "90", str(MPIRUN), "--ft", "-n", str(n), sys.executable,
           SCRIPT, str(directory), kills, "1", token, redundancy]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_AUTOTUNE="0",
               MPIKV_FT_DETECTOR_TIMEOUT=str(KILL_DETECTOR), **(env or {}))
    rc, out = launch(cmd, env)
    assert rc != 124, f"the job hung:\n{out}"
    assert leftovers(token) == [], out
    assert rc in (0, 9), out   # (survivors of a SIGKILL end with status 0)
    assert "Traceback" not in out, out
    return out


#: the Trainers recovered: the default, shard="parameters", a sparse embedding's row tables
KINDS = [{}, {"SHARD": "parameters"}, {"MODEL": "embedding"}]


def run_job(directory, redundancy, kind=None):
    """Rank 0 killed in step 3, rank 1 in step 10: the output and when each died."""
    out = launch_job(directory, redundancy, env=kind)
    died = {int(r): (int(s), float(t))
            for r, s, t in re.findall(r"rank (\d): dying in step (\d+) at ([\d.]+)", out)}
    assert sorted(died) == [0, 1] and died[0][0] == 3 and died[1][0] == 10, out
    return out, died


def finished_exactly(out):
    final = re.findall(r"rank (\d): finished (\d+) updates on (\d) workers as rank (\d); "
                       r"max difference ([\d.e+-]+)", out)
    assert [f[:4] for f in final] == [("2", "14", "1", "0")], out
    assert float(final[0][4]) <= 1e-10, out   # the uninterrupted run's weights
    # Every checkpoint with its Trainer file in place is whole; the partial ones went.
    listed = re.search(r"checkpoints \[([\d, ]*)\]; committed but incomplete \[\]", out)
    assert listed and "12" in listed.group(1).split(", "), out


@pytest.mark.parametrize("kind", KINDS + [{"SHARD": "none"}],
                         ids=["default", "parameters", "embedding", "none"])
def test_killed_ranks_cost_the_steps_since_the_checkpoint_and_the_weights_are_exact(tmp_path,
                                                                                   kind):
    out, died = run_job(tmp_path / "ckpt", "checkpoint", kind)
    # Rank 0 died while the checkpoint of step 3 was being written: it was never
    # committed, and the survivors went back to the one trainer.run made at the start.
    for r, as_rank in ((1, 0), (2, 1)):
        assert f"rank {r}: step 0 on 2 workers as rank {as_rank} at " in out, out
    # Then rank 1 (of the two left) in step 10, its step-9 checkpoint being written:
    # 9 where that write ended in time to be committed at step 10's zero_grad (before
    # the kill), else 6 (committed at the latest when the one of 9 started). Both are
    # right; which one depends on the disk and the load.
    again = re.search(r"rank 2: step (\d+) on 1 workers as rank 0 at ([\d.]+)", out)
    assert again and int(again.group(1)) in (6, 9), out
    # From each kill to the survivors' next completed step: usually a fraction of a
    # second (a SIGKILL is seen at once); bench ft measures it, this only bounds it.
    done = {(int(r), int(n)): float(t) for r, n, t in re.findall(
        r"rank (\d): step \d+ completed on (\d) workers at ([\d.]+)", out)}
    assert set(done) == {(1, 2), (2, 2), (2, 1)}, out
    assert all(done[(r, 2)] - died[0][1] < KILL_SEEN_WITHIN for r in (1, 2)), out
    assert done[(2, 1)] - died[1][1] < KILL_SEEN_WITHIN, out
    finished_exactly(out)


@pytest.mark.parametrize("kind", KINDS, ids=["default", "parameters", "embedding"])
def test_with_buddy_copies_killed_ranks_cost_only_the_step_in_flight(tmp_path, kind):
    out, _ = run_job(tmp_path / "ckpt", "memory", kind)
    # Each survivor goes on with the step its lost peer died in: no step lost
    # (the checkpoints on disk were of 0 and 9 steps).
    for r, as_rank in ((1, 0), (2, 1)):
        assert re.findall(rf"rank {r}: step (\d+) on 2 workers as rank {as_rank} at ", out) \
            == ["3"], out
    assert re.findall(r"rank 2: step (\d+) on 1 workers as rank 0 at ", out) == ["10"], out
    finished_exactly(out)


def test_two_ranks_killed_at_once_each_with_a_living_buddy(tmp_path):
    # 4 ranks: ranks 1 and 3 killed in step 7; their buddies (2 and 0) hold their
    # copies: the two left go on from step 7, no step lost, whether both deaths fall
    # into one loss or the second into the recovery (the first store's copies serve).
    out = launch_job(tmp_path / "ckpt", "memory", kills="1@7,3@7", n=4)
    assert sorted(re.findall(r"rank (\d): dying in step 7 at", out)) == ["1", "3"], out
    for r, as_rank in ((0, 0), (2, 1)):
        assert re.findall(rf"rank {r}: step (\d+) on 2 workers as rank {as_rank} at ", out) \
            == ["7"], out
    assert out.count("trainer.run: lost ranks 1, 3 of 4; going on from step 7 on 2 ranks") \
        == 2, out
    final = re.findall(r"rank (\d): finished (\d+) updates on (\d) workers as rank (\d); "
                       r"max difference ([\d.e+-]+)", out)
    assert sorted(f[:4] for f in final) == [("0", "14", "2", "0"), ("2", "14", "2", "1")], out
    assert all(float(f[4]) <= 1e-10 for f in final), out


@pytest.mark.parametrize("redundancy, second, step", [
    ("checkpoint", 2, "3"),
    # rank 2 held rank 1's copy: as a rank lost with its buddy, the checkpoint
    ("memory", 2, "3"),
    # rank 3's and rank 1's buddies (0 and 2) live: the first store's copies serve
    ("memory", 3, "5"),
])
def test_a_rank_lost_during_the_recovery_is_recovered_from_in_turn(tmp_path, redundancy,
                                                                   second, step):
    # 4 ranks: rank 1 killed in step 5; rank `second` as the recovery starts making
    # the survivors' store: the two left recover again and end with the exact weights.
    # The step-3 checkpoint is committed before the loop goes on (BACKGROUND=0): a
    # background write might not have committed by step 5 on a loaded machine, and
    # the survivors would go on from step 0, not the step asserted below.
    out = launch_job(tmp_path / "ckpt", redundancy, kills="1@5", n=4,
                     env={"DIE_IN_RECOVERY": str(second), "BACKGROUND": "0"})
    assert f"rank {second}: dying in the recovery at " in out, out
    alive = [r for r in range(4) if r not in (1, second)]
    for as_rank, r in enumerate(alive):
        assert re.findall(rf"rank {r}: step (\d+) on 2 workers as rank {as_rank} at ", out) \
            == [step], out
    final = re.findall(r"rank (\d): finished (\d+) updates on (\d) workers as rank (\d); "
                       r"max difference ([\d.e+-]+)", out)
    assert sorted(f[:4] for f in final) == [(str(r), "14", "2", str(i))
                                            for i, r in enumerate(alive)], out
    assert all(float(f[4]) <= 1e-10 for f in final), out


def test_with_buddy_copies_a_rank_lost_with_its_buddy_goes_back_to_the_checkpoint(tmp_path):
    # 4 ranks: rank 1 and its buddy, rank 2, both killed in step 7, where the checkpoint
    # of 6 steps is being written. Nobody holds rank 1's copy: the two left go on from
    # the newest complete checkpoint (6 steps, or 3 where the one of 6 was not
    # committed), whether both deaths fall into one loss or the second into the recovery.
    out = launch_job(tmp_path / "ckpt", "memory", kills="1@7,2@7", n=4)
    assert sorted(re.findall(r"rank (\d): dying in step 7 at", out)) == ["1", "2"], out
    back = {r: re.findall(rf"rank {r}: step (\d+) on 2 workers as rank {as_rank} at ", out)
            for r, as_rank in ((0, 0), (3, 1))}
    assert back[0] == back[3] and back[0] in (["3"], ["6"]), out
    assert len(re.findall(rf"trainer.run: lost ranks? [\d, ]+ of [34]; going on from step "
                          rf"{back[0][0]} on 2 ranks", out)) == 2, out
    if "were both lost" in out:   # one loss: every survivor says why it went back
        assert out.count("rank 1 and its buddy rank 2 (which held its copy) were both lost: "
                         "no survivor holds what they owned; going on from the newest "
                         "periodic checkpoint") == 2, out
    final = re.findall(r"rank (\d): finished (\d+) updates on (\d) workers as rank (\d); "
                       r"max difference ([\d.e+-]+)", out)
    assert sorted(f[:4] for f in final) == [("0", "14", "2", "0"), ("3", "14", "2", "1")], out
    assert all(float(f[4]) <= 1e-10 for f in final), out


@pytest.mark.parametrize("redundancy, step", [("checkpoint", "3"), ("memory", "5")])
def test_a_rank_killed_inside_backward_while_buckets_are_reduced(tmp_path, redundancy, step):
    # 3 ranks, one bucket per parameter: rank 1 dies in step 5 when its first layer's
    # gradient is made, the other buckets' reductions under way on every rank.
    # BACKGROUND=0: the step-3 checkpoint is committed before step 4 starts, not when
    # a background write happens to end (see the test above).
    out = launch_job(tmp_path / "ckpt", redundancy, kills="1@5", n=3,
                     env={"KILL_IN": "backward", "BACKGROUND": "0"})
    assert "rank 1: dying in step 5 in backward at " in out, out
    for r, as_rank in ((0, 0), (2, 1)):
        assert re.findall(rf"rank {r}: step (\d+) on 2 workers as rank {as_rank} at ", out) \
            == [step], out
    final = re.findall(r"rank (\d): finished (\d+) updates on (\d) workers as rank (\d); "
                       r"max difference ([\d.e+-]+)", out)
    assert sorted(f[:4] for f in final) == [("0", "14", "2", "0"), ("2", "14", "2", "1")], out
    assert all(float(f[4]) <= 1e-10 for f in final), out
