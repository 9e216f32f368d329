"""A named registry of loss-piece adapters, kept as data (the optax spirit).

One :class:`Registry` per kind of piece (surrogates, advantage estimators, ratios) maps a
name to an entry (a ``NamedTuple`` holding the function and what it needs). Entries present
when the library finishes importing are built-ins: they can be overridden, never removed,
because the presets are made of them. ``view`` is a live read-only mapping of the entries.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

EntryT = TypeVar("EntryT")


class Registry(Generic[EntryT]):
    """Name -> entry, refusing silent replacement.

    Attributes:
      kind: what the entries are (``"surrogate"``, ...), used in error messages.
      view: live read-only ``Mapping[str, EntryT]`` of the registered entries.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, EntryT] = {}
        self._builtins: frozenset[str] = frozenset()
        self.view: Mapping[str, EntryT] = types.MappingProxyType(self._entries)

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order (built-ins first)."""
        return tuple(self._entries)

    def add(self, name: str, entry: EntryT, *, override: bool = False) -> None:
        """Registers ``entry`` under ``name``; a taken name needs ``override=True``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty str, got {name!r}")
        if name in self._entries and not override:
            raise ValueError(
                f"{self.kind} {name!r} is already registered; pass override=True to replace it "
                f"(registered: {self.names()})"
            )
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Unregisters a user entry; built-ins (which the presets use) cannot be removed."""
        if name in self._builtins:
            raise ValueError(
                f"{self.kind} {name!r} is built in and cannot be unregistered; "
                "register a replacement with override=True instead"
            )
        if name not in self._entries:
            raise ValueError(f"no {self.kind} {name!r} is registered; registered: {self.names()}")
        del self._entries[name]

    def get(self, name: str) -> EntryT:
        """The entry of ``name``; an unknown name raises a ValueError listing the registered."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        return self._entries[name]

    def mark_builtins(self) -> None:
        """Marks every entry registered so far as built in."""
        self._builtins = frozenset(self._entries)


def check_registration(kind: str, name: Any, fn: Any) -> None:
    """Raises on a missing name (``@register_x`` used without a call) or a non-callable."""
    if callable(name):
        raise ValueError(f"register_{kind} needs a name: use @register_{kind}('my_{kind}')")
    if fn is not None and not callable(fn):
        raise ValueError(f"a {kind} must be callable, got {fn!r} for {name!r}")
