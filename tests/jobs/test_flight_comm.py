"""The flight recorder's exchange keeps off the user's communicator (issue 38, class 8)."""

import pytest

from .conftest import run_job


@pytest.mark.parametrize("n", [2, 3])
def test_the_flight_recorder_takes_no_user_message_and_gives_it_none(n):
    rc, out, _ = run_job(n, "tests/jobs/scripts/user_comm.py", timeout=300)
    assert rc not in (0, 124), out
    # A user's message with the exchange's tag reaches the user ...
    assert "rank 0: user received ('user', 'before the barrier') with tag 32011" in out, out
    # ... and a user's receive of any tag gets none of the exchange's messages.
    assert out.count("user received") == 1, out
    # The exchange itself still ran: rank 0 answered with its last call.
    assert "uncaught RuntimeError on rank 1" in out, out
    assert "mpikv: the last call of each rank" in out, out
    assert "  rank 0: store 0 call 4: push (keys 'w'; 1 key, 24 B), waiting for the other " \
           "ranks to agree" in out, out
    if n == 3:
        assert "  rank 2: store 0 call 4: push (keys 'w'; 1 key, 24 B), waiting" in out, out
