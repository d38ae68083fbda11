"""The last document patches an in-process Bokeh server sent, kept to explain a browser error.

BokehJS throws "reference pNNNN isn't known" when a server message names a model the page
does not hold (a model dropped by an earlier message of the same batch, bokeh/bokeh#13153).
The browser report then names only the id. `install` (called by the tests' shared server)
keeps the events of the last `KEEP` PATCH-DOC messages this process created: their time,
thread, kind, the model and attribute they change and the models their new value holds; the
browser watch (`conftest.WatchedBrowser`) adds the ones that mention the unknown id to the
failure, so the next occurrence says which model and which change.
"""
from __future__ import annotations

import collections
import re
import threading
import time
from typing import Any

KEEP = 3000
_LOG: collections.deque[tuple[float, str, list[tuple]]] = collections.deque(maxlen=KEEP)
_INSTALLED = False
UNKNOWN = re.compile(r"reference (p\d+) isn't known")


def _ids(value: Any, depth: int = 0) -> list[str]:
    from bokeh.model import Model

    if isinstance(value, Model):
        return [value.id]
    if depth < 2 and isinstance(value, (list, tuple)):
        return [i for v in value[:200] for i in _ids(v, depth + 1)]
    if depth < 2 and isinstance(value, dict):
        return [i for v in list(value.values())[:200] for i in _ids(v, depth + 1)]
    return []


def _event(e: Any) -> tuple:
    model = getattr(e, "model", None)
    return (type(e).__name__, None if model is None else f"{type(model).__name__} {model.id}",
            getattr(e, "attr", None), _ids(getattr(e, "new", None)))


def install() -> None:
    """Record every PATCH-DOC message this process creates from now on (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from bokeh.protocol.messages.patch_doc import patch_doc

    create = patch_doc.create.__func__

    def recorded(cls, events, *args, **kwargs):
        try:
            _LOG.append((time.time(), threading.current_thread().name,
                         [_event(e) for e in events]))
        except Exception as exc:                     # the record must never break a send
            _LOG.append((time.time(), "?", [("unrecorded", repr(exc), None, [])]))
        return create(cls, events, *args, **kwargs)

    patch_doc.create = classmethod(recorded)
    _INSTALLED = True


def mentions(model_id: str, most: int = 12) -> list[str]:
    """The recorded messages whose events change ``model_id`` or carry it in a new value."""
    lines = []
    for t, thread, events in _LOG:
        hit = [ev for ev in events if (ev[1] or "").endswith(f" {model_id}") or model_id in ev[3]]
        if hit:
            stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
            lines.append(f"{stamp} [{thread}] {len(events)} events; "
                         + "; ".join(f"{k} {m} .{a} new={ids[:6]}" for k, m, a, ids in hit[:4]))
    return lines[-most:]


def explain(text: str) -> str:
    """For a page error naming an unknown reference, the recorded messages that mention it."""
    found = UNKNOWN.search(text)
    if not found or not _INSTALLED:
        return ""
    lines = mentions(found.group(1))
    return ("\n  server patches naming " + found.group(1) + ":\n    "
            + ("\n    ".join(lines) if lines else "none recorded (not sent by this process)"))
