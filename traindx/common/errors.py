"""Errors meant for the user: the CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input (a command not found, a folder that is not a run, a corrupt file, ...)."""

    exit_code = 2
