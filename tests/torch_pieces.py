"""The pieces of the Trainers a test makes (``mpikv.torch._pieces.Pieces``), for the
white-box tests that look inside a Trainer through its pieces' public interfaces."""

from mpikv.torch import trainer as trainer_module


def record(monkeypatch):
    """From now on (until the test ends), each Trainer's pieces are appended, as made,
    to the list this returns (a recovery's too)."""
    made = []
    make = trainer_module.make_pieces

    def recording(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(trainer_module, "make_pieces", recording)
    return made
