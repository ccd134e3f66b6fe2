"""trainer.resume on one process: which checkpoint a new job takes (the newest
complete one; partial, corrupt and old ones skipped and removed), and its checks."""

import shutil

import pytest

torch = pytest.importorskip("torch")

import mpikv  # noqa: E402
import mpikv.torch  # noqa: E402
from mpikv.torch import resume  # noqa: E402
from tests import trainer_cases as cases  # noqa: E402


def _run(directory, steps, **kwargs):
    """A new job: resumes, trains up to ``steps``; returns (start, trainer)."""
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.Adam, {"lr": 0.01}, "local")
    start = trainer.resume(directory, **kwargs)
    for step in range(start, steps):
        x, y = cases.data(step, 0)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x, False), y).backward()
        trainer.step()
    return start, trainer


def test_the_newest_complete_checkpoint_is_taken_and_the_rest_removed(tmp_path):
    start, trainer = _run(tmp_path, 5, every=2, keep=5)
    trainer.close()   # makes the checkpoint due after step 4
    assert start == 0 and [s for s, _ in resume.newest_first(tmp_path)] == [4, 2]
    # A job killed while saving step 6: its parts and manifest, no Trainer file.
    shutil.copytree(tmp_path / "step-000000004.parts", tmp_path / "step-000000006.parts")
    shutil.copy(tmp_path / "step-000000004", tmp_path / "step-000000006")
    assert not resume.is_complete(tmp_path / "step-000000006")
    start, trainer = _run(tmp_path, 4)
    assert start == 4 and trainer.num_update == 4
    assert sorted(resume.steps_in(tmp_path)) == [2, 4]   # the partial one went
    trainer.close()
    # A corrupt manifest: the one before it.
    manifest = tmp_path / "step-000000004"
    manifest.write_bytes(manifest.read_bytes()[:-7] + b"garbage")
    start, trainer = _run(tmp_path, 2)
    assert start == 2 and sorted(resume.steps_in(tmp_path)) == [2]
    trainer.close()


def test_a_checkpoint_whose_parts_do_not_load_is_skipped(tmp_path):
    _, trainer = _run(tmp_path, 4, every=2, keep=5)
    trainer.close()
    for part in (tmp_path / "step-000000004.parts").iterdir():
        part.write_bytes(b"\0" * part.stat().st_size)   # a disk that lost the data
    start, trainer = _run(tmp_path, 2)
    assert start == 2
    trainer.close()


def test_only_the_last_keep_checkpoints_stay(tmp_path):
    _, trainer = _run(tmp_path, 7, every=2, keep=2)
    trainer.close()
    assert sorted(resume.steps_in(tmp_path)) == [4, 6]


def test_the_users_state_rides_along(tmp_path):
    class Position:
        def __init__(self):
            self.batches = 0

        def state_dict(self):
            return {"batches": self.batches}

        def load_state_dict(self, d):
            self.batches = d["batches"]

    first = Position()
    net = cases.Net()
    trainer = mpikv.torch.Trainer(net, torch.optim.SGD, {"lr": 0.1}, "local")
    trainer.resume(tmp_path, every=3, state=first)
    for step in range(4):
        first.batches += 1
        x, y = cases.data(step, 0)
        trainer.zero_grad()
        torch.nn.functional.mse_loss(net(x, False), y).backward()
        trainer.step()
    trainer.close()
    again = Position()
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    assert trainer.resume(tmp_path, state=again) == 3 and again.batches == 3
    trainer.close()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"every": 0}, mpikv.InputError, "every must be a positive number"),
    ({"keep": 0}, mpikv.InputError, "keep must be at least 1"),
    ({"minutes": -1}, mpikv.InputError, "minutes must be positive"),
    ({"state": object()}, mpikv.ValueTypeError, "state_dict"),
])
def test_bad_resume_arguments_are_refused(tmp_path, kwargs, error, match):
    trainer = mpikv.torch.Trainer(cases.Net(), torch.optim.SGD, {"lr": 0.1}, "local")
    with pytest.raises(error, match=match):
        trainer.resume(tmp_path, **kwargs)
    trainer.close()
