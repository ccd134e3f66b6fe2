"""Every case of tests/error_cases.py against a dist_sync store, at 1-4 ranks: every
rank raises the same error, nothing was applied on any rank, the store still works."""

import numpy as np
import pytest

from tests import error_cases
from tests.error_cases import EVERY

pytestmark = pytest.mark.mpi

RUNS = [(case, where) for case in error_cases.CASES for where in case.bad_on]


def _run_id(run):
    case, where = run
    return f"{case.name}-{'every rank' if where == EVERY else f'rank {where} only'}"


def _bad_ranks(where, size):
    return frozenset(range(size)) if where == EVERY else frozenset([where % size])


@pytest.mark.parametrize("case,where", RUNS, ids=[_run_id(r) for r in RUNS])
def test_error_everywhere_nothing_applied(kv, comm, case, where):
    size = comm.size
    if size < case.min_ranks:
        pytest.skip(f"needs {case.min_ranks} ranks: its bad input is a difference between ranks")
    bad = _bad_ranks(where, size)
    for earlier in case.bad_on[:case.bad_on.index(where)]:
        if _bad_ranks(earlier, size) == bad:
            pytest.skip(f"at {size} rank{'s' * (size > 1)}, "
                        f"the same run as {_run_id((case, earlier))}")
    held = case.setup(kv)
    try:
        case.call(kv, comm.rank in bad)
        error = None
    except Exception as e:  # any class: every rank must report the same one
        error = e
    everyone = comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
    assert all(m is not None for m in everyone), everyone
    assert len(set(everyone)) == 1, everyone
    error_cases.check_error(case, error, size, None if where == EVERY else min(bad))
    if case.after is not None:
        case.after(kv)
    # Nothing applied: every key as the setup left it, the same on every rank.
    values = error_cases.held_values(kv, held)
    for other in comm.allgather(values):
        assert other.keys() == values.keys()
        for key, value in values.items():
            np.testing.assert_array_equal(other[key], value)
    error_cases.still_works(kv, held, comm.rank, size)
