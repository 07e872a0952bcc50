"""A memo that holds only inside a `with` scope: what one command computes more than once (seed
shapes, PipeDream's partition, whole searches), dropped when the command's scope ends.

Scopes nest: an inner scope shares the outer one's entries. Entries are keyed by the profile,
compared by identity and content hash, and hold it, so its id is not reused while they live.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional


class ScopedMemo:
    def __init__(self):
        self._entries: Optional[Dict[tuple, tuple]] = None

    @contextlib.contextmanager
    def scope(self):
        outer = self._entries
        if outer is None:
            self._entries = {}
        try:
            yield
        finally:
            self._entries = outer

    def get(self, profile, key: tuple) -> Optional[Any]:
        """The value put for (`profile`, `key`) in this scope, else None (also outside one)."""
        if self._entries is None:
            return None
        hit = self._entries.get((id(profile), profile.content_hash) + key)
        return hit[1] if hit is not None and hit[0] is profile else None

    def put(self, profile, key: tuple, value: Any) -> None:
        """Remember `value` (not None) until the scope ends; outside a scope, nothing."""
        if self._entries is not None:
            self._entries[(id(profile), profile.content_hash) + key] = (profile, value)
