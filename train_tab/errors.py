"""The Train tab's one refusal: :class:`TrainInputError`, raised by every module of the package (its
message is shown to the user as it is), so none of them imports another just for it."""

from __future__ import annotations


class TrainInputError(ValueError):
    """Input the Train tab refuses; the message is shown as it is."""
