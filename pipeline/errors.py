"""Errors a user can fix by changing a flag or an input; the CLI turns them into exit code 2."""


class UsageError(Exception):
    """A configuration or input problem; the message says what to change."""
