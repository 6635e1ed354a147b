"""One generic name → object registry: explicit registration, no overwrite, helpful lookups."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from surgery.errors import ConfigError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects; ``get`` of an unknown name lists what exists.

    >>> KINDS = Registry("action kind")
    >>> @KINDS.register("init")
    ... class Init: ...
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator that registers an object under ``name`` (default: its own ``name``); twice is an error."""

        def add(obj: T) -> T:
            key = name if name is not None else getattr(obj, "name", None)
            if not isinstance(key, str):
                raise ValueError(f"a {self.what} needs a name: register('NAME') or a `name` attribute")
            if key in self._items:
                raise ValueError(f"{self.what} {key!r} is already registered")
            self._items[key] = obj
            return obj

        return add

    def get(self, name: str, where: str = "") -> T:
        """Return the object named ``name`` or raise a ConfigError listing the known names."""
        if name in self._items:
            return self._items[name]
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}unknown {self.what} {name!r}.{did_you_mean(str(name), self._items)}"
            f" Available: {', '.join(sorted(self._items))}.",
            options=sorted(self._items),
        )

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
