"""Public names of a facade module, imported on first use (PEP 562): most pull in torch or transformers,
which take seconds to import, and `mirrorsd --help` or an argument error should not wait for that."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(namespace: dict, sources: dict[str, tuple[str, ...]]) -> Callable[[str], object]:
    """A module `__getattr__` serving each name in `sources` (module -> names) from its module, once."""
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = vars(importlib.import_module(where[name]))[name]
        namespace[name] = value
        return value

    return __getattr__
