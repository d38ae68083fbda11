"""Plain torch hooks for the tests' independent references."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def removed_after(handles: Sequence[Any]) -> Iterator[Sequence[Any]]:
    """Run the block with the torch hook ``handles`` in place, then remove them (also when
    the block raises), so a failed reference leaves the shared tiny model unhooked."""
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()
