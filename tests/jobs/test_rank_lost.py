"""A lost rank under a ULFM launch: one agreed RankLostError on every survivor, no hang.

Each job runs ``scripts/mpirun.sh --ft -n 3`` (ULFM, failure detector) on
tests/jobs/scripts/rank_lost.py, whose rank 1 calls ``os._exit(9)`` at step 20
while the others go on calling the store; and the refusals of
``fault_tolerant=True`` where the launch has no ULFM.
"""

import functools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

import pytest

from .conftest import MPIRUN, launch, started_together

SCRIPT = "tests/jobs/scripts/rank_lost.py"
#: the failure detector's timeout the jobs run with (scripts/mpirun.sh --ft)
DETECTOR = 2.0
#: the longest a loss may take to be seen before a test calls it a hang: a loaded
#: machine delays the detector's heartbeats (bench ft measures the real delays)
SEEN_WITHIN = DETECTOR + 20
TIMEOUT = 90
#: the detector's timeout of the jobs whose rank computes 3 x as long without MPI
SLOW_DETECTOR = 6.0
TCP = ["--mca", "btl", "tcp,self"]


def leftovers(token, wait=10.0):
    """The command lines of processes still running with ``token`` in them (after
    up to ``wait`` seconds for them to go)."""
    deadline = time.monotonic() + wait
    while True:
        found = subprocess.run(["pgrep", "-af", token], capture_output=True, text=True).stdout
        found = [line for line in found.splitlines() if "pgrep" not in line]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


#: a survivor's word that MPI took another survivor for dead before their end
#: (mpikv.transport.ulfm.end_survivor)
LOST_AT_END = re.compile(r"^mpikv: rank \d+: .* lost too, before the survivors' end.*$", re.M)


def taken_for_dead(output):
    """Where the job's output shows a live rank taken for dead, the line that says so;
    else None.

    A 2 s detector (these jobs wait for it) takes for dead a rank that a loaded
    machine stalls for longer (docs/fault-tolerance.md): MPI's verdict, not the
    case under test, and the others end without that rank's report.
    """
    said = LOST_AT_END.search(output)
    if said:
        return said.group(0)
    dying = set(re.findall(r"^rank (\d+): dying at", output, re.M))
    for lost in re.findall(r"^rank \d+: lost=\[([\d, ]*)\]", output, re.M):
        extra = {r.strip() for r in lost.split(",") if r.strip()} - dying
        if extra:
            return f"a survivor's report names rank(s) {sorted(extra)} lost: {lost!r}"
    return None


def unforwarded(output, reports):
    """The lines the ranks wrote to ``reports`` (a directory of ``R.txt`` files, one
    per rank: rank_lost.py's ``RANK_LOST_REPORTS``) that are not in ``output``."""
    seen = set(output.splitlines())
    return [line for path in sorted(reports.glob("*.txt"))
            for line in path.read_text().splitlines() if line not in seen]


def run_job(cmd, env, token, rerun=True):
    """Runs a job; returns (returncode, output, seconds), after checking that it did
    not hang and that none of its processes is left. ``rerun``: a job whose output
    shows a live rank taken for dead (:func:`taken_for_dead`) runs once more, with
    a warning, and the output says so. Lines a rank wrote to its report file that
    the launcher did not forward are added to the output, with a warning."""
    note = ""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as reports:
            start = time.monotonic()
            rc, output = launch(cmd, dict(env, RANK_LOST_REPORTS=reports))
            seconds = time.monotonic() - start
            lost = unforwarded(output, pathlib.Path(reports))
        if lost:
            warnings.warn(f"the launcher did not forward {len(lost)} line(s) the ranks "
                          f"wrote: {lost}")
            output += "[written by the ranks, not forwarded by the launcher:]\n" + "".join(
                line + "\n" for line in lost)
        output = f"{note}{output}[the job: exit status {rc}, {seconds:.1f} s]\n"
        assert rc != 124, f"the job hung:\n{output}"
        assert leftovers(token) == [], output
        why = taken_for_dead(output) if rerun else None
        if why is None or attempt == 2:
            return rc, output, seconds
        warnings.warn(f"a live rank was taken for dead ({why}); the job ran again")
        note = f"[a live rank was taken for dead; ran again]\n{output}\n[again:]\n"


def run_ft(n, case, launcher_args=(), ft=True, env=None, rerun=True):
    """Runs the script on ``n`` ranks with :func:`run_job`; returns (returncode,
    output, seconds)."""
    token = f"mpikv-ft-{uuid.uuid4().hex[:12]}"
    cmd = ["timeout", "-k", "5", str(TIMEOUT), str(MPIRUN), *(["--ft"] if ft else []),
           *launcher_args, "-n", str(n), sys.executable, SCRIPT, case, token]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_FT_DETECTOR_TIMEOUT=str(DETECTOR))
    full_env.update(env or {})
    return run_job(cmd, full_env, token, rerun)


def survivors_saw(output, what, dying="rank 1", lost="rank 1", n=3):
    """Asserts each survivor's report: the same message on every survivor, naming the
    lost rank and the call; returns {rank: seconds from the death to its error}."""
    died = re.findall(rf"{dying}: dying at ([\d.]+)", output)
    assert len(died) == 1, output
    survivors = [r for r in range(n) if f"rank {r}" != lost]
    # ``what``: text, or a pattern (a data phase names the keys in the store's order)
    what = what if isinstance(what, re.Pattern) else re.compile(re.escape(what))
    head = re.compile(re.escape(f"{lost} of {n} lost during ") + what.pattern + re.escape(
        f": the process died; {n - 1} survive ({', '.join(map(str, survivors))})"))
    tail = (". This store is unusable now; a store made on the survivors' communicator "
            "(this error's .comm) goes on")
    messages, steps, delays = set(), {}, {}
    for rank in survivors:
        said = re.findall(rf"^rank {rank}: RankLostError: (.*)$", output, re.M)
        assert len(said) == 1, output
        messages.add(said[0])
        facts = re.search(rf"rank {rank}: lost=\[{lost[5:]}\] lost_world=\[{lost[5:]}\] "
                          rf"survivors=\[{', '.join(map(str, survivors))}\] "
                          rf"shrunk_size={n - 1} step=(\d+) completed_here=(True|False) "
                          rf"seen_at=([\d.]+)", output)
        assert facts, output
        assert f"rank {rank}: again: True" in output, output   # the store stays lost
        steps[rank] = (int(facts.group(1)), facts.group(2) == "True")
        delays[rank] = float(facts.group(3)) - float(died[0])
    assert len(messages) == 1, output                 # the same text on every survivor
    message = messages.pop()
    start = head.match(message)
    assert start and message.endswith(tail), (message, head.pattern)
    # Usually every survivor was in the same call. Where the dead rank's data reached
    # some survivors before it died, those completed the call and are one step ahead,
    # and the message says so.
    behind = {s for s, here in steps.values() if not here}
    ahead = {s for s, here in steps.values() if here}
    assert len(behind) == 1 and ahead <= {min(behind) + 1}, (steps, output)
    if ahead:
        assert "; that call completed on rank" in message, message
    else:
        assert message == start.group(0) + tail, message
    assert output.count("RankLostError:") == n - 1, output   # no traceback, nothing else
    assert "finished without a loss" not in output, output
    return delays


#: a pushpull of the four keys: the agreement names them in the call's order, a data
#: phase in the store's (a survivor may be in either)
PUSHPULL = re.compile(r"pushpull \(keys '\w', '\w', '\w', '\w'\)")


@pytest.mark.parametrize("case, what", [
    ("agreement", PUSHPULL),
    ("data", PUSHPULL),
    ("barrier", "barrier"),
])
def test_lost_rank_over_shared_memory_is_one_error_on_every_survivor(case, what):
    rc, out, seconds = run_ft(3, case)
    delays = survivors_saw(out, what)
    assert rc == 9, out    # mpiexec's status: the dead rank's
    # Shared memory sees the death through the detector's heartbeats only: never at
    # once (6.05 s for a 2 s detector was seen in a loaded CI run).
    assert all(DETECTOR * 0.5 < d < SEEN_WITHIN for d in delays.values()), (delays, out)
    assert seconds < 45, out


def test_a_survivor_stalled_before_the_end_is_named_by_the_others():
    # Rank 2 reports the error, then stops (SIGSTOP) before the survivors' end: the
    # detector takes it for dead, and rank 0 says so as it ends without it.
    rc, out, seconds = run_ft(3, "stall", rerun=False)
    assert rc == 9, out
    for rank in (0, 2):
        assert f"rank {rank}: again: True" in out, out
    assert "rank 2: stopping" in out, out
    said = LOST_AT_END.findall(out)
    assert len(said) == 1, out
    # (the error class's number is the library's: no MPI in this process to ask)
    assert re.fullmatch(
        r"mpikv: rank 0: COMM_WORLD rank 2 lost too, before the survivors' end \(MPI error "
        r"class \d+; the failure detector takes a rank that stalls longer than its timeout "
        r"for dead\); ending without them", said[0]), said
    assert taken_for_dead(out) == said[0]
    assert seconds < 45, out


def test_a_rank_taken_for_dead_is_read_from_either_sign():
    report = "rank 0: lost=[{}] lost_world=[{}] survivors=[0] shrunk_size=1\n"
    assert taken_for_dead("rank 1: dying at 1.0\n" + report.format("1", "1")) is None
    assert taken_for_dead("rank 1: dying at 1.0\n" + report.format("1, 2", "1, 2")) == (
        "a survivor's report names rank(s) ['2'] lost: '1, 2'")
    line = ("mpikv: rank 0: COMM_WORLD rank 2 lost too, before the survivors' end (MPI "
            "error class 75; ...); ending without them")
    assert taken_for_dead(f"rank 1: dying at 1.0\n{line}\n") == line


def test_lines_the_launcher_did_not_forward_are_found(tmp_path):
    (tmp_path / "0.txt").write_text("rank 0: a\nrank 0: b\n")
    (tmp_path / "2.txt").write_text("rank 2: a\n")
    assert unforwarded("rank 0: a\nrank 0: b\n", tmp_path) == ["rank 2: a"]
    assert unforwarded("rank 2: a\nrank 0: b\nrank 0: a\n", tmp_path) == []


def test_rank_killed_by_sigkill_is_reported_by_its_daemon_at_once():
    # A process killed by a signal is seen by the launcher's daemon (its parent),
    # which tells the others: no wait for the detector (measured 8-17 ms), unlike a
    # process that exits. (mpiexec then exits 0: the killed rank has no status.)
    rc, out, _ = run_ft(3, "sigkill")
    delays = survivors_saw(out, PUSHPULL)
    assert rc in (0, 9), out
    assert all(d < DETECTOR / 2 for d in delays.values()), (delays, out)


def test_lost_rank_over_tcp_is_seen_at_once():
    rc, out, _ = run_ft(3, "agreement", TCP)
    delays = survivors_saw(out, PUSHPULL)
    assert rc == 9, out
    assert all(d < DETECTOR for d in delays.values()), (delays, out)   # a closed socket


def test_fault_tolerant_job_without_a_loss_finishes():
    rc, out, _ = run_ft(3, "none")
    assert rc == 0, out
    assert sorted(re.findall(r"rank (\d): finished without a loss", out)) == ["0", "1", "2"], out


NO_ULFM = ("refused: FaultToleranceUnavailableError: create(fault_tolerant=True): ranks 0, 1: "
           "the launch has no ULFM (OMPI_MCA_mpi_ft_enable is not set): launch with "
           "scripts/mpirun.sh --ft (mpiexec --with-ft ulfm); no store was created")
NO_RECOVERY = ("refused: FaultToleranceUnavailableError: create(fault_tolerant=True): ranks 0, "
               "1: the launcher (prterun) was started without --with-ft ulfm: it would end the "
               "whole job when a rank dies; launch with scripts/mpirun.sh --ft; no store was "
               "created")


def test_plain_launch_is_refused_on_every_rank():
    rc, out, _ = run_ft(2, "refuse", ft=False)
    assert rc == 0, out
    assert out.count(NO_ULFM + "\n") == 2, out
    assert "created: not refused" not in out


def test_plain_launch_with_ulfm_library_switch_is_refused_for_its_launcher():
    # The library's switch alone: the launcher would still end the job at a death.
    rc, out, _ = run_ft(2, "refuse", ft=False, env={"OMPI_MCA_mpi_ft_enable": "1"})
    assert rc == 0, out
    assert out.count(NO_RECOVERY + "\n") == 2, out


def test_ft_launch_is_not_refused():
    rc, out, _ = run_ft(2, "refuse")
    assert rc == 0, out
    assert out.count("created: not refused\n") == 2, out


SLOW = ["slow", "slow_plain", "slow_start"]


@pytest.fixture(scope="module")
def slow_jobs():
    """The slow cases' jobs, started together: each sleeps 3 x the detector's timeout."""
    return started_together({case: functools.partial(
        run_ft, 3, case, env={"MPIKV_FT_DETECTOR_TIMEOUT": str(SLOW_DETECTOR)})
        for case in SLOW})


@pytest.mark.parametrize("case", SLOW)
def test_a_rank_computing_longer_than_the_detector_timeout_is_not_lost(slow_jobs, case):
    """In a fault-tolerant store, in one made with fault_tolerant=False under --ft, and
    before any store when MPI started before mpikv was imported: heartbeats go on.

    A detector of 6 s (rank 2 computes 18 s): at 2 s, a loaded machine (the suite beside
    other work) had a rank declared dead while it imported mpikv after MPI started, a
    gap that is no computing of the script's, and at 4 s once at load average 11-12
    (docs/fault-tolerance.md)."""
    rc, out, seconds = slow_jobs[case].result()
    assert rc == 0, out
    assert sorted(re.findall(r"rank (\d): finished without a loss", out)) == ["0", "1", "2"], out
    assert seconds > 3 * SLOW_DETECTOR, out


# -- survivors go on: a new store on the error's .comm ---------------------------------
SURVIVE = "tests/jobs/scripts/survive.py"


def run_survive(n, deaths, launcher_args=(), env=None):
    token = f"mpikv-ft-{uuid.uuid4().hex[:12]}"
    cmd = ["timeout", "-k", "5", str(TIMEOUT), str(MPIRUN), "--ft", *launcher_args,
           "-n", str(n), sys.executable, SURVIVE, deaths, token]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", MPIKV_FT_DETECTOR_TIMEOUT=str(DETECTOR),
                    **(env or {}))
    rc, output, _ = run_job(cmd, full_env, token)
    return rc, output


@pytest.mark.parametrize("n, dead, launcher_args", [
    (4, 1, ()),          # shared memory: 3 survivors
    (3, 0, TCP),         # rank 0 (the coordinator, rank 0's values) over TCP: 2 survivors
])
def test_survivors_go_on_with_the_right_sums_on_a_new_store(n, dead, launcher_args):
    rc, out = run_survive(n, f"20:{dead}", launcher_args)
    assert rc == 9, out
    alive = [r for r in range(n) if r != dead]
    assert out.count(f"rank {dead}: dying at step 20\n") == 1, out
    for new_rank, r in enumerate(alive):
        assert re.search(rf"rank {r}: step (19|20): lost store ranks \[{dead}\]; "
                         rf"survivors now \[{', '.join(map(str, alive))}\]\n", out), out
        assert f"rank {r}: new store: rank {new_rank} of {n - 1}, " in out, out
        # Every step's sums were checked in the script; the last: (ranks + 1) x 60.
        assert (f"rank {r}: finished 60 steps on {n - 1} ranks {alive}; "
                f"last sum {60 * sum(a + 1 for a in alive)}\n") in out, out
    assert "Traceback" not in out, out


def test_a_rank_lost_while_the_survivors_make_their_store():
    # Rank 1 dies in step 20; rank 2 is killed as the two others make their store:
    # their creation raises one RankLostError (the store's creation) on both, and
    # the next try, on its .comm, goes on with the right sums.
    rc, out = run_survive(4, "20:1", env={"DIE_BY": "sigkill", "DIE_IN_RECOVERY": "2"})
    assert rc == 0, out
    assert "rank 2: dying while the survivors make their store" in out, out
    for new_rank, r in enumerate((0, 3)):
        said = re.findall(rf"^rank {r}: making the store: (.*)$", out, re.M)
        assert said == ["rank 1 of 3 lost (COMM_WORLD rank 2) during the store's creation: "
                        "the process died; "
                        "2 survive (0, 2). This store is unusable now; a store made on the "
                        "survivors' communicator (this error's .comm) goes on"], out
        assert f"rank {r}: new store: rank {new_rank} of 2, " in out, out
        assert f"rank {r}: finished 60 steps on 2 ranks [0, 3]; last sum 300\n" in out, out
    assert "Traceback" not in out, out


def test_a_survivor_computing_long_after_a_loss_is_not_lost():
    # After a loss only mpikv's heartbeat thread turns MPI's progress engine while a
    # rank computes (without it, this rank 2 was taken for dead at step 40).
    rc, out = run_survive(3, "20:1", env={"SLOW": "40:2"})
    assert rc == 9, out
    for r in (0, 2):
        assert f"rank {r}: finished 60 steps on 2 ranks [0, 2]; last sum 240\n" in out, out
    assert "step 40: lost" not in out, out


def test_lost_rank_in_a_background_call_is_raised_by_the_handles_wait():
    # The failure reaches the store's worker thread (pushpull_async's data phase, in
    # flight when rank 1 dies in its updater): each survivor's handle.wait() raises
    # the agreed RankLostError, as a blocking call would, and the store stays lost.
    rc, out, seconds = run_ft(3, "async")
    survivors_saw(out, PUSHPULL)
    assert rc == 9, out
    assert "failed in the background" not in out, out
    assert "Traceback" not in out, out
    assert seconds < 45, out


def test_lost_rank_while_the_others_end_their_processes():
    # The survivors are in the store's agreed "exit" call (the interpreter's end):
    # the error is printed once per survivor and they end together, status 1.
    rc, out, seconds = run_ft(3, "at_exit")
    assert rc in (1, 9), out
    message = ("mpikv: RankLostError: rank 1 of 3 lost during exit: the process died; 2 "
               "survive (0, 2).")
    assert out.count(message) == 2, out
    assert sorted(re.findall(r"rank (\d): finished without a loss", out)) == ["0", "1", "2"], out
    assert seconds < 45, out


def test_successive_kills_down_to_one_rank():
    # kill -9 three times (store ranks 1, then 2 of the 3 left, then 1 of the 2): the
    # survivors go on each time, then one rank alone. (Ranks that *exit* instead:
    # prterun ends the job at the second loss of 4 ranks; docs/fault-tolerance.md.)
    rc, out = run_survive(4, "20:1,40:3,50:2", env={"DIE_BY": "sigkill"})
    assert rc == 0, out
    for r, step in ((1, 20), (3, 40), (2, 50)):
        assert out.count(f"rank {r}: dying at step {step}\n") == 1, out
    assert len(re.findall(r"rank [023]: step (19|20): lost store ranks \[1\]; "
                          r"survivors now \[0, 2, 3\]", out)) == 3, out
    assert len(re.findall(r"rank [02]: step (39|40): lost store ranks \[2\]; "
                          r"survivors now \[0, 2\]", out)) == 2, out
    assert re.search(r"rank 0: step (49|50): lost store ranks \[1\]; survivors now \[0\]", out), out
    assert "rank 0: finished 60 steps on 1 ranks [0]; last sum 60\n" in out, out
    assert "Traceback" not in out, out
