"""Errors that reach the user as one line and exit code 2, never as a traceback."""


class UserError(Exception):
    """Bad input: the message names the file, key and value at fault."""

    exit_code = 2
