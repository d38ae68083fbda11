"""A page's caches: named stores of what its jobs computed, kept between jobs.

`PageCaches` is a base class of `apps._view.View`: every page has `cached`, `cache_get`,
`cache_put` and `forget`, usable from any thread (one lock guards every store), and its
`View.close` empties them all. A store is a plain mapping of key to value, made on its first
entry; ``limit`` empties a store that has grown past it, and `bound_cache` makes a store a
least-recently-used one with a size bound (`apps._server.BoundedCache`). docs/views.md
describes the pattern.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from apps._server import BoundedCache

__all__ = ["PageCaches"]

_MISSING = object()   # a cache miss (None is a value a cache may hold)


class PageCaches:
    """The named caches of a page (any thread; one lock guards them all).

    Parameters
    ----------
    **params
        Passed on to the next base class (the page's Parameters).
    """

    def __init__(self, **params: Any):
        super().__init__(**params)
        self._page_caches: dict[str, dict[Any, Any]] = {}   # store -> key -> value
        self._cache_bounds: dict[str, tuple[int, int | None]] = {}
        self._page_cache_lock = threading.Lock()

    def bound_cache(self, store: str, *, max_items: int,
                    max_bytes: int | None = 256 * 2**20) -> None:
        """Make ``store`` least recently used: it keeps at most ``max_items`` entries and
        ``max_bytes`` of array data, the entries used longest ago dropped first
        (`apps._server.BoundedCache`); it stays so after `forget`. Entries it held are
        dropped."""
        BoundedCache(max_items, max_bytes)                # the bounds checked at once
        with self._page_cache_lock:
            self._cache_bounds[store] = (max_items, max_bytes)
            self._page_caches.pop(store, None)

    def cache_get(self, store: str, key: Any, default: Any = None) -> Any:
        """Entry ``key`` of the page's cache ``store``; ``default`` when it holds none."""
        with self._page_cache_lock:
            return self._page_caches.get(store, {}).get(key, default)

    def cache_put(self, store: str, key: Any, value: Any, *, limit: int | None = None) -> Any:
        """Keep ``value`` as entry ``key`` of ``store`` (a store holding more than ``limit``
        entries is emptied first); returns ``value``."""
        with self._page_cache_lock:
            entries = self._page_caches.get(store)
            if entries is None:
                bounds = self._cache_bounds.get(store)
                entries = BoundedCache(*bounds) if bounds is not None else {}
                self._page_caches[store] = entries
            if limit is not None and len(entries) > limit:
                entries.clear()
            entries[key] = value
        return value

    def cached(self, store: str, key: Any, compute: Callable[[], Any], *,
               limit: int | None = None) -> Any:
        """Entry ``key`` of ``store``, from ``compute()`` on a miss (run outside the lock: a
        slow computation holds up no other thread; two threads missing at once both compute,
        and the later one is kept). A store that ``limit`` will empty is emptied before the
        computation, so what it held (e.g. a model copy, ``limit=0``) is not kept alongside
        the new value while that is made."""
        with self._page_cache_lock:
            entries = self._page_caches.get(store, {})
            value = entries.get(key, _MISSING)
            if value is _MISSING and limit is not None and len(entries) > limit:
                entries.clear()
        if value is _MISSING:
            value = self.cache_put(store, key, compute(), limit=limit)
        return value

    def forget(self, *stores: str, where: Callable[[Any], bool] | None = None) -> None:
        """Empty the page's caches ``stores`` (every one without names); with ``where``, drop
        only their entries whose key ``where(key)`` is true for."""
        with self._page_cache_lock:
            for name in stores or list(self._page_caches):
                if where is None:
                    self._page_caches.pop(name, None)
                    continue
                entries = self._page_caches.get(name, {})
                for key in [k for k in entries if where(k)]:
                    del entries[key]
