"""Errors a user can fix (exit code 2), and retrying the ones that pass by themselves."""

from __future__ import annotations


class UsageError(Exception):
    """A configuration or input problem; the message says what to change."""
