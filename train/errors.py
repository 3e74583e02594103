"""The two ways vit-train stops on purpose, each reported as one line (`vit-train: ...`), never a traceback.

    SetupError      a run that cannot start as asked (exit 2): a bad setting, a missing or damaged
                    checkpoint, another run's checkpoint in the way
    TrainingError   a run that stopped because going on would be wrong (exit 1): a non-finite loss,
                    a checkpoint that could not be written
`train.cli.main` catches both; any other exception is a bug, and keeps its traceback.
"""

from __future__ import annotations


class SetupError(Exception):
    """A run that cannot start as asked: a missing folder, a bad setting, an existing run in the way."""


class TrainingError(Exception):
    """A run that had to stop: continuing (or saving) would have produced a wrong model."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), at most 400 characters: room for
    what to do, which ends our messages and Lightning's."""
    text = str(e).strip()
    return text.splitlines()[0][:400] if text else type(e).__name__
