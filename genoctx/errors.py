"""Errors that mean "the user gave bad input": the CLI prints their one-line message and exits with 2."""


class GenoctxError(Exception):
    """Bad input from the user (a file, a record, a flag). The message is one line and names the culprit."""

    exit_code = 2


class AgreedError(GenoctxError):
    """A ``GenoctxError`` raised on every rank of a mesh at once (``genoctx.parallel.build.agree``): no rank is left
    waiting in a collective, so a worker may end with it quietly (``genoctx.cluster`` hands it back as one line)."""
