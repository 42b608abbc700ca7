"""Errors a user can act on: each names the offending field and what is allowed."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A configuration or request value is out of range.

    `field` is the argument's name as the user wrote it (Engine keyword, CLI flag without
    dashes, or sampling parameter), so callers such as the HTTP server can point at it.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidArgument(field, message)
