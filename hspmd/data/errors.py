"""The one error of `hspmd.data`: data that cannot be read or must not be trained on."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset that is missing, malformed or corrupt, or that does not fit the model; the message names
    the file (the shard) and says why, in one line."""
