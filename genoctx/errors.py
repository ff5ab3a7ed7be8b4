"""Errors that mean "the user gave bad input": the CLI prints their one-line message and exits with 2."""


class GenoctxError(Exception):
    """Bad input from the user (a file, a record, a flag). The message is one line and names the culprit."""

    exit_code = 2
