"""Old public spellings of renamed record fields, kept readable for a while."""

from __future__ import annotations

import warnings


def renamed(new: str, old: str) -> property:
    """A read-only property under a field's old name: warns (DeprecationWarning) and returns the field `new`."""

    def read(self):
        warnings.warn(f"{type(self).__name__}.{old} is deprecated: use .{new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(read, doc=f"Deprecated spelling of `{new}`.")
