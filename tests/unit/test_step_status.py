"""The Trainer's step status (mpikv.torch.status), summed by hand over two "ranks"."""

import numpy as np
import pytest

pytest.importorskip("torch")

import mpikv  # noqa: E402
from mpikv.torch.status import StepStatus  # noqa: E402

NAMES = ["a", "b", "c", "d"]


class _KV:
    num_workers = 2

    def __init__(self, rank):
        self.rank = rank


def _summed(rows_of):
    """Each rank's row, summed as kv.allreduce_ would; the status of rank 0 holds it."""
    statuses = [StepStatus(_KV(r), NAMES) for r in range(2)]
    total = sum(np.array(s.row(**rows_of[r])) for r, s in enumerate(statuses))
    statuses[0].row(**rows_of[0])[:] = total
    return statuses[0]


def _row(touched=(1, 1, 1, 1), cleared=(0, 0, 0, 0), late=(), gather=False, ticket=0):
    return dict(touched=list(touched), cleared=list(cleared), late=list(late), gather=gather,
                ticket=ticket)


def test_a_parameter_no_rank_used_or_every_rank_cleared_is_skipped():
    status = _summed([_row(touched=(1, 0, 0, 1), cleared=(0, 0, 1, 0)),
                      _row(touched=(1, 0, 0, 1), cleared=(0, 0, 1, 0))])
    verdict, error = status.read(averaging=True, error_unused=True)
    assert "parameters got no gradient (rank 0: b; rank 1: b)" in str(error)   # not c: cleared
    verdict, error = status.read(averaging=True, error_unused=False)
    assert error is None and verdict.unused_everywhere == {"b", "c"}
    assert not verdict.joined_round and verdict.sender == 0


def test_cleared_on_one_rank_only_and_late_gradients_are_errors():
    status = _summed([_row(cleared=(0, 1, 0, 0), touched=(1, 0, 1, 1)), _row()])
    _, error = status.read(averaging=True, error_unused=False)
    assert isinstance(error, mpikv.GradientError) and "some ranks only (b)" in str(error)
    status = _summed([_row(), _row(late=("a",))])
    _, error = status.read(averaging=False, error_unused=False)
    assert "on rank(s) 1; with shard='gradients'" in str(error)


def test_a_joined_rank_gives_only_its_ticket_and_the_sender_is_the_first_training_rank():
    status = _summed([_row(ticket=7), _row(gather=True)])
    verdict, error = status.read(averaging=True, error_unused=True)
    assert error is None and verdict.joined_round and verdict.gathering
    assert verdict.sender == 1 and status.first_training_rank() == 1


@pytest.mark.parametrize("flags, want", [
    (((0, 0, 0), (0, 0, 0)), (False, False, False)),
    (((1, 0, 1), (0, 0, 0)), (True, False, False)),   # one rank's signal stops every rank
    (((0, 1, 1), (0, 0, 1)), (False, True, True)),    # rank 0's clock; both parts written
    (((0, 0, 1), (0, 0, 0)), (False, False, False)),  # one part still being written
])
def test_signals_clock_and_written_parts_are_read_alike(flags, want):
    rows = [dict(_row(), stop=bool(s), save=bool(c), written=bool(w)) for s, c, w in flags]
    verdict, error = _summed(rows).read(averaging=True, error_unused=True)
    assert error is None and (verdict.stop, verdict.save, verdict.written) == want


def test_a_joined_rank_never_counts_as_written():
    rows = [dict(_row(ticket=3), written=True), dict(_row(), written=True)]
    verdict, _ = _summed(rows).read(averaging=True, error_unused=True)
    assert verdict.joined_round and not verdict.written
