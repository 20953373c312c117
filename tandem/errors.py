"""Errors the engine raises. Each names what was wrong so a service can map it to a status
(InvalidArgument -> INVALID_ARGUMENT / HTTP 400) without parsing messages."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of every error Tandem raises on purpose."""


class InvalidArgument(TandemError, ValueError):
    """A request or configuration field has a bad value. `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # pickled from the engine core to its worker
        return type(self), (self.field, self.message)


class ModelLoadError(TandemError):
    """A model cannot be loaded: missing directory, unsupported architecture, bad tensors."""


class LayoutMismatch(TandemError):
    """Two KV pools cannot exchange blocks; `field` names the first differing property and
    `hint`, when given, what to change (the flag that sets it)."""

    def __init__(self, field: str, local: object, remote: object, hint: str = "") -> None:
        super().__init__(f"KV pool layout mismatch in {field}: local {local!r}, remote {remote!r}"
                         + (f"; {hint}" if hint else ""))
        self.field = field
        self.local, self.remote = local, remote
        self.hint = hint

    def __reduce__(self):
        return type(self), (self.field, self.local, self.remote, self.hint)


class Overloaded(TandemError):
    """The request cannot be queued now; retry later."""
