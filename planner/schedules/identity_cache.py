"""Remembering what was computed from an immutable object, by the object itself: hashing a
schedule's lists would cost as much as some of what is remembered. Holding the argument keeps
its id from being reused while it is remembered."""
from __future__ import annotations

import functools
from typing import Callable, Dict, Tuple, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def cached_by_identity(size: int) -> Callable[[Callable[[T], R]], Callable[[T], R]]:
    """Decorate a one-argument function: its results for the last `size` arguments, by id."""
    def decorate(function: Callable[[T], R]) -> Callable[[T], R]:
        remembered: Dict[int, Tuple[T, R]] = {}

        @functools.wraps(function)
        def cached(argument: T) -> R:
            hit = remembered.get(id(argument))
            if hit is not None and hit[0] is argument:
                return hit[1]
            result = function(argument)
            if len(remembered) >= size:
                remembered.pop(next(iter(remembered)))
            remembered[id(argument)] = (argument, result)
            return result
        return cached
    return decorate
