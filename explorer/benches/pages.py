"""``explorer bench pages``: how fast each gallery page answers, measured in a real browser.

It starts ``explorer serve`` in a subprocess (127.0.0.1, a free port) and drives headless
chromium (Debian's, `CHROMIUM`) through Playwright. For each run a fresh browser session
opens the gallery and, page by page, clicks the page's button in the sidebar and records:

- ``first_result_ms``: from the click to the first frame in which one of the new page's
  plots is drawn with a result: a data glyph (not a "Computing…" text placeholder) whose
  source has rows, and the plot's frame holding more than one colour. None when the page
  draws none before the session has had no work in flight for a few seconds (it waits for
  a button) or before ``timeout_s``;
- ``settled_ms``: until the session has no job in flight (the sidebar's stop button is
  off) and the page's plots have not changed for ``quiet_s`` (the last change's time).

Then, on a page with a live slider (`SLIDERS`), it presses the button `PREPARE` names for the
page, if any (the conflicts page's α sliders scale the chosen heads: it picks the top heads),
waits until the page is quiet, and drags the slider: the mouse goes down on
its handle and moves towards the farther end in ``moves`` steps; after each step it waits
until the page's plots' pixels change (up to ``move_timeout_s``) and ``settle_s`` more.
Each step gives ``move → changed pixels`` (from the browser's pointer event to the frame
whose pixels differ), split into its parts: the pointer event to the first websocket
message sent (the widget's change leaving the browser), that message to the last message
received before the frame (the server: its queue, the computation, the document patch and
the transport), and that to the frame (applying the patch and Bokeh's repaint). A step that
does not change the slider's value is not counted; one not redrawn in time counts as
missing. After the mouse goes up, ``release → exact`` is the time from the pointer event to
the last frame that changed before the session went quiet (the exact result drawn).

How pixels are watched: a script installed before the page's own watches every animation
frame (``requestAnimationFrame``), but reads pixels only in a frame after a Bokeh plot
painted (each plot view counts its paints): it draws each plot's canvas at a third of its
size into a small canvas and hashes that. Idle frames cost a pass over Bokeh's views; a
read costs about a millisecond (``signature_ms``, ``frame_idle_ms`` in the result). CDP
screenshots were not used: each capture rasterises and encodes the whole page, tens of
milliseconds of CPU taken from the page and server on a small machine, and samples the
screen at the capture's own pace rather than catching the frame that changed.
"""
from __future__ import annotations

import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from explorer._checks import InputError, check_float, check_int
from explorer.benches.serve import CHROMIUM, CHROMIUM_ARGS, _server, sync_playwright_for
from explorer.defaults import DEFAULT_MODEL

__all__ = ["bench_pages", "SLIDERS", "PREPARE", "RECORDER", "page_table", "percentile",
           "continuous_drag"]

#: The pages with a slider that redraws while it moves: slug -> the slider's label (a
#: regular expression matched against the text of its input group).
SLIDERS: dict[str, str] = {
    "lens": r"Steering strength",
    "conflicts": r"α_l",
    "attention": r"^\s*Head\b",
    "circuits": r"Top-n edges",
}

#: What the bench presses on a page before dragging its slider, where the slider changes
#: nothing until then: slug -> the button's text. The conflicts page's α sliders scale the
#: chosen heads, and no head is chosen when it opens; the circuits page's size slider steps
#: through the sizes of a circuit, which SmolLM2's page computes when asked.
PREPARE: dict[str, str] = {
    "conflicts": "Pick top heads for the direction",
    "circuits": "Compute circuit",
}

#: The in-page recorder (added before the page's scripts): pointer events, websocket
#: messages sent and received, and a log of the frames whose plot pixels changed.
RECORDER = r"""(() => {
  if (window.__pb) return
  const pb = window.__pb = {log: [], moves: [], downs: [], ups: [], clicks: [], sent: [],
                            received: [], busy: [], sigCost: [], idleCost: [], key: null,
                            sig: null, active: null}
  const on = (name, list, test) => document.addEventListener(name, e => {
    if (!test || test(e)) list.push(e.timeStamp) }, true)
  on('pointermove', pb.moves, e => e.buttons)
  on('pointerdown', pb.downs)
  on('pointerup', pb.ups)
  on('click', pb.clicks)
  const WS = window.WebSocket
  window.WebSocket = class extends WS {
    constructor(...args) {
      super(...args)
      this.addEventListener('message', () => pb.received.push(performance.now()))
    }
    send(data) { pb.sent.push(performance.now()); return super.send(data) }
  }
  const small = document.createElement('canvas')
  const ctx = small.getContext('2d', {willReadFrequently: true})
  // a plot's pixels: its canvas at a third of its size, hashed; and whether its frame
  // holds more than one colour (1 % of the samples differ from the first)
  const read = (v) => {
    const cv = v.canvas_view, canvas = cv.primary.canvas
    const sw = Math.max(1, Math.ceil(canvas.width / 3)), sh = Math.max(1, Math.ceil(canvas.height / 3))
    if (small.width !== sw || small.height !== sh) { small.width = sw; small.height = sh }
    ctx.imageSmoothingEnabled = false
    ctx.clearRect(0, 0, sw, sh)
    ctx.drawImage(canvas, 0, 0, sw * 3, sh * 3, 0, 0, sw, sh)
    const data = ctx.getImageData(0, 0, sw, sh).data
    let a = 0, b = 0
    for (let k = 0; k < data.length; k += 4) {
      a = (a * 31 + data[k] + 7 * data[k + 1] + 13 * data[k + 2] + 17 * data[k + 3]) | 0
      b = (b + data[k + 1]) | 0
    }
    const r = canvas.width / Math.max(1, cv.bbox.width) / 3, f = v.frame.bbox
    const x0 = Math.floor(f.left * r), y0 = Math.floor(f.top * r)
    const x1 = Math.min(sw, Math.ceil(f.right * r)), y1 = Math.min(sh, Math.ceil(f.bottom * r))
    let first = -1, differ = 0, n = 0
    for (let y = y0; y < y1; y++) for (let x = x0; x < x1; x++) {
      const k = 4 * (y * sw + x), c = (data[k] << 16) | (data[k + 1] << 8) | data[k + 2]
      if (first < 0) first = c; else if (c !== first) differ++
      n++
    }
    return {hash: a + ':' + b, inked: n > 0 && differ > 0.01 * n}
  }
  const hasData = (v) => v.model.renderers.some(r => r.type === 'GlyphRenderer'
      && r.glyph != null && r.glyph.type !== 'Text' && r.data_source != null
      && typeof r.data_source.get_length === 'function' && (r.data_source.get_length() || 0) > 0)
  const tick = () => {
    requestAnimationFrame(tick)
    if (window.Bokeh == null || Bokeh.index == null) return
    const t0 = performance.now()
    const views = [...Bokeh.index.all_views()]
    const plots = views.filter(v => (v.model.type === 'Figure' || v.model.type === 'Plot')
        && v.el.isConnected && v.el.offsetParent != null && v.canvas_view != null)
    const stop = views.filter(v => (v.model.css_classes || []).includes('stop-work'))
    // work in flight: the session's stop button live, or a spinner turning (the header's
    // busy indicator while the server handles an event, a page's own)
    const active = stop.some(v => !v.model.disabled) || views.some(v =>
        (v.model.css_classes || []).includes('spin') && v.el != null && v.el.isConnected
        && v.el.offsetParent != null)
    if (active !== pb.active) { pb.active = active; pb.busy.push([t0, active]) }
    const key = plots.map(v => v.model.id + '.' + v._render_count).join(',')
    if (key === pb.key) { pb.idleCost.push(performance.now() - t0); return }
    pb.key = key
    const seen = plots.map(v => [v, read(v)])
    const sig = seen.map(([v, s]) => v.model.id + '=' + s.hash).join(',')
    pb.sigCost.push(performance.now() - t0)
    if (sig === pb.sig) return
    pb.sig = sig
    pb.log.push({t: t0, ids: plots.map(v => v.model.id),
                 results: seen.filter(([v, s]) => s.inked && hasData(v)).map(([v]) => v.model.id),
                 titles: plots.map(v => v.model.title != null ? String(v.model.title.text) : '')})
  }
  requestAnimationFrame(tick)
})()"""

_NOW = "() => performance.now()"
_STATE = """() => { const pb = window.__pb; return pb == null ? null : {
  log: pb.log.length, last: pb.log.length ? pb.log[pb.log.length - 1].t : null,
  active: pb.active, now: performance.now(),
  ids: pb.log.length ? pb.log[pb.log.length - 1].ids : []} }"""
_SINCE = """(i) => { const pb = window.__pb; return {log: pb.log.slice(i), moves: pb.moves, downs: pb.downs,
  ups: pb.ups, clicks: pb.clicks, sent: pb.sent, received: pb.received, busy: pb.busy} }"""
_COSTS = """() => { const pb = window.__pb, med = xs => { const s = [...xs].sort((p, q) => p - q);
  return s.length ? s[Math.floor(s.length / 2)] : null };
  return {signature_ms: med(pb.sigCost), frame_idle_ms: med(pb.idleCost),
          signatures: pb.sigCost.length, idle_frames: pb.idleCost.length} }"""


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (linear interpolation, as numpy's default)."""
    s = sorted(values)
    if not s:
        raise ValueError("percentile of no values")
    at = (len(s) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def _say(text: str) -> None:
    print(f"[bench pages] {text}", file=sys.stderr, flush=True)


def _state(page: Any) -> dict[str, Any]:
    return page.evaluate(_STATE)


def _after(page: Any, index: int) -> dict[str, Any]:
    return page.evaluate(_SINCE, index)


def _wait_quiet(page: Any, *, quiet_s: float, timeout_s: float, after: float | None = None,
                grace_s: float = 10.0, poll: float = 0.1) -> bool:
    """Until the session has no job in flight and no plot changed for ``quiet_s``; with
    ``after`` (a time in the page's clock), also until a plot changed after it or
    ``grace_s`` went by without one (a change the server sends some seconds later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = _state(page)
        since = (s["now"] - s["last"]) / 1000 if s["last"] is not None else quiet_s
        changed = after is None or (s["last"] is not None and s["last"] >= after) \
            or (s["now"] - after) / 1000 >= grace_s
        if not s["active"] and since >= quiet_s and changed:
            return True
        time.sleep(poll)
    return False


def _wait_loaded(page: Any, *, quiet_s: float, timeout_s: float) -> None:
    """Until the gallery has loaded its model (its sidebar's "Loading model…" gone) and is
    quiet."""
    page.wait_for_selector(".gallery-nav button", state="attached", timeout=1000 * timeout_s)
    deadline = time.monotonic() + timeout_s
    loading = page.get_by_text("Loading model…")
    while time.monotonic() < deadline and any(loading.nth(i).is_visible()
                                              for i in range(loading.count())):
        time.sleep(0.1)
    _wait_quiet(page, quiet_s=quiet_s, timeout_s=max(1.0, deadline - time.monotonic()))


def _open_page(page: Any, title: str, *, timeout_s: float, quiet_s: float,
               idle_s: float) -> dict[str, Any]:
    """Click the sidebar button of the page ``title``; its first result and settled times."""
    start_index = _state(page)["log"]
    before = set(_state(page)["ids"])
    button = page.locator(".gallery-nav button", has_text=title).first
    if not button.count():
        button = page.locator(".bk-btn-group button", has_text=title).first
    button.click()
    deadline = time.monotonic() + timeout_s
    first, idle_since = None, None
    while time.monotonic() < deadline:
        got = _after(page, start_index)
        clicked = got["clicks"][-1] if got["clicks"] else None
        if clicked is not None:
            for entry in got["log"]:
                if entry["t"] >= clicked and set(entry["results"]) - before:
                    first = entry["t"] - clicked
                    break
        if first is not None:
            break
        s = _state(page)
        if s["active"]:
            idle_since = None
        elif clicked is not None and s["now"] - clicked > 1000 * idle_s:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > idle_s:
                break                          # nothing in flight and no result: it waits
        time.sleep(0.05)
    slug = page.evaluate("() => new URLSearchParams(location.search).get('view')")
    settled = None
    if _wait_quiet(page, quiet_s=quiet_s, timeout_s=max(1.0, deadline - time.monotonic())):
        got = _after(page, start_index)
        clicked = got["clicks"][-1] if got["clicks"] else None
        if clicked is not None:
            times = [e["t"] for e in got["log"] if e["t"] >= clicked]
            settled = (times[-1] if times else clicked) - clicked
    return {"slug": slug, "first_result_ms": None if first is None else round(first, 1),
            "settled_ms": None if settled is None else round(settled, 1)}


def _pages_asked(page: Any, asked: list[str], known: dict[str, str]) -> list[tuple[str, str]]:
    """(slug, title) of the pages ``asked`` (slugs of ``known``, slug -> sidebar title, or
    sidebar titles; all of them when empty), in the order asked or, for all, the sidebar's."""
    titles = [t.strip() for t in page.locator(".gallery-nav button").all_inner_texts()]
    slug_of = {title: slug for slug, title in known.items()}
    if not asked:                       # every page but the home page (it draws no plot)
        return [(slug_of.get(t, t), t) for t in titles if t != "Home"]
    out = []
    for item in asked:
        title = known.get(item) or next((t for t in titles if t.lower() == item.lower()), None)
        if title is None or title not in titles:
            raise InputError(f"`pages` has {item!r}, not a page of the gallery's sidebar; its "
                             f"pages: {', '.join(slug_of.get(t, repr(t)) for t in titles)}.")
        out.append((slug_of.get(title, item), title))
    return out


# Marks the handle of the slider labelled by a regular expression (its title, or the text
# beside it in its layout, as Panel's DiscreteSlider draws its label) with data-pb-handle.
_MARK_HANDLE = """(label) => {
  const re = new RegExp(label)
  const shown = v => v.el != null && v.el.isConnected && v.el.offsetParent != null
  const text = m => String(m.title ?? m.text ?? m.value ?? '')
  const views = [...Bokeh.index.all_views()].filter(shown)
  const isSlider = v => /Slider$/.test(v.model.type) && v.model.type !== 'RangeSlider'
  let slider = views.find(v => isSlider(v) && re.test(text(v.model)))
  if (slider == null)
    for (const v of views) {
      const kids = v.child_views || []
      if (kids.some(k => !isSlider(k) && re.test(text(k.model)))) {
        slider = kids.find(isSlider)
        if (slider != null) break
      }
    }
  document.querySelectorAll('[data-pb-handle]').forEach(e => e.removeAttribute('data-pb-handle'))
  for (const v of [...Bokeh.index.all_views()].filter(shown))
    v.shadow_el?.querySelectorAll?.('[data-pb-handle]').forEach(e => e.removeAttribute('data-pb-handle'))
  const handle = slider == null ? null : (slider.shadow_el ?? slider.el).querySelector('.noUi-handle')
  if (handle == null) return false
  handle.setAttribute('data-pb-handle', '1')
  return true
}"""


def _prepare(page: Any, button: str, *, quiet_s: float, timeout_s: float) -> dict[str, Any]:
    """Press the button whose text is ``button`` and wait until the page is quiet again;
    its text and the milliseconds from the press to quiet."""
    start = _state(page)["now"]
    page.get_by_role("button", name=button).first.click()
    quiet = _wait_quiet(page, quiet_s=quiet_s, timeout_s=timeout_s, after=start)
    took = _state(page)["now"] - start if quiet else None
    _say(f"pressed {button!r}: quiet after {took and round(took)} ms")
    return {"button": button, "quiet_ms": None if took is None else round(took, 1)}


def _slider_handle(page: Any, label: str) -> Any | None:
    """The handle of the slider labelled ``label`` (a regular expression), or None."""
    if not page.evaluate(_MARK_HANDLE, label):
        return None
    return page.locator("[data-pb-handle]").first


def _first_after(times: list[float], t: float, until: float | None = None) -> float | None:
    for x in times:
        if x >= t and (until is None or x <= until):
            return x
    return None


def _last_between(times: list[float], t0: float, t1: float) -> float | None:
    inside = [x for x in times if t0 <= x <= t1]
    return inside[-1] if inside else None


def _slider_grip(page: Any, label: str, direction: int | None
                 ) -> tuple[Any, float, float, float, float, int] | None:
    """The handle of the slider labelled ``label`` scrolled into view, its centre ``x, y``,
    its track's ``left, right`` and the drag direction (given, or towards the larger room);
    None when the page has no such slider."""
    handle = _slider_handle(page, label)
    if handle is None:
        return None
    handle.scroll_into_view_if_needed()
    box = handle.bounding_box()
    track = handle.locator("xpath=ancestor::div[contains(@class,'noUi-base')]").first.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    left, right = track["x"], track["x"] + track["width"]
    if direction is None:
        direction = 1 if right - x >= x - left else -1
    return handle, x, y, left, right, direction


def _drag(page: Any, label: str, *, moves: int, direction: int | None, move_timeout_s: float,
          settle_s: float, quiet_s: float, timeout_s: float,
          release_grace_s: float = 10.0) -> dict[str, Any]:
    """One drag of the slider labelled ``label``: per step, move → changed pixels and its
    parts; release → exact."""
    grip = _slider_grip(page, label, direction)
    if grip is None:
        return {"error": f"no slider labelled {label!r} on the page"}
    handle, x, y, left, right, direction = grip
    room = (right - x) if direction > 0 else (x - left)
    step = max(2.0, room / (moves + 0.5))
    steps: list[dict[str, Any]] = []
    page.mouse.move(x, y)
    page.mouse.down()
    try:
        for i in range(moves):
            value = handle.get_attribute("aria-valuenow")
            index = _state(page)["log"]
            page.mouse.move(x + direction * step * (i + 1), y)
            deadline = time.monotonic() + move_timeout_s
            changed = None
            while time.monotonic() < deadline:
                got = _after(page, index)
                moved = got["moves"][-1] if got["moves"] else None
                later = [e["t"] for e in got["log"] if moved is not None and e["t"] > moved]
                if later:
                    changed = later[0]
                    break
                time.sleep(0.01)
            now_value = handle.get_attribute("aria-valuenow")
            got = _after(page, index)
            moved = got["moves"][-1]
            if now_value == value:
                continue                          # the value did not change: nothing to draw
            if changed is None:
                steps.append({"value": now_value, "ms": None})
                continue
            sent = _first_after(got["sent"], moved, changed)
            received = _last_between(got["received"], sent if sent is not None else moved, changed)
            part = {"value": now_value, "ms": round(changed - moved, 1)}
            if sent is not None and received is not None:
                part.update(input_ms=round(sent - moved, 1), server_ms=round(received - sent, 1),
                            paint_ms=round(changed - received, 1))
            steps.append(part)
            page.wait_for_timeout(settle_s * 1000)
    finally:
        index = _state(page)["log"]
        page.mouse.up()
    up = page.evaluate("() => { const u = window.__pb.ups; return u.length ? u[u.length - 1] : null }")
    quiet = _wait_quiet(page, quiet_s=quiet_s, timeout_s=timeout_s, after=up,
                        grace_s=release_grace_s)
    got = _after(page, index)
    up = got["ups"][-1] if got["ups"] else None
    later = [e["t"] for e in got["log"] if up is not None and e["t"] >= up]
    exact = round(later[-1] - up, 1) if later and quiet else None
    return {"direction": direction, "steps": steps, "release_exact_ms": exact}


def continuous_drag(page: Any, label: str, *, seconds: float = 3.0, interval_ms: float = 40,
                    direction: int | None = None) -> dict[str, Any]:
    """A hand's drag of the slider labelled ``label``: a pointer move every ``interval_ms``
    for ``seconds`` (the handle crossing the track once), without waiting for redraws. The
    page keeps up by dropping moves; what it shows is how often the plots change meanwhile
    (``update_interval_ms``: the median time between changed frames during the drag) and how
    long after the last move the last preview lands (``last_move_to_frame_ms``)."""
    grip = _slider_grip(page, label, direction)
    if grip is None:
        return {"error": f"no slider labelled {label!r} on the page"}
    handle, x, y, left, right, direction = grip
    n = max(2, int(1000 * seconds / interval_ms))
    step = ((right - x) if direction > 0 else (x - left)) * 0.95 / n
    index = _state(page)["log"]
    page.mouse.move(x, y)
    page.mouse.down()
    try:
        for i in range(n):
            page.mouse.move(x + direction * step * (i + 1), y)
            page.wait_for_timeout(interval_ms)
        got = _after(page, index)
        moves = [t for t in got["moves"] if t >= got["downs"][-1]]
        last_move = moves[-1]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:   # the preview of the last move, before release
            frames = [e["t"] for e in _after(page, index)["log"] if e["t"] >= moves[0]]
            if frames and frames[-1] > last_move and \
                    _state(page)["now"] - frames[-1] > 1500:
                break
            time.sleep(0.05)
    finally:
        page.mouse.up()
    during = [t for t in frames if t <= last_move]
    gaps = [b - a for a, b in zip(during, during[1:])]
    after = [t for t in frames if t > last_move]
    return {"direction": direction, "moves": len(moves), "frames": len(frames),
            "update_interval_ms": round(statistics.median(gaps), 1) if gaps else None,
            "last_move_to_frame_ms": round(after[-1] - last_move, 1) if after else None}


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 50), 1), "p90_ms": round(percentile(values, 90), 1),
            "max_ms": round(max(values), 1)}


def page_table(result: dict[str, Any]) -> str:
    """The bench's result as a text table: a row per page."""
    head = ("page", "first result ms", "settled ms", "drag p50", "drag p90", "missing",
            "release→exact ms")
    rows = [head]
    for slug, entry in result["params"]["per_page"].items():
        drag = entry.get("drag") or {}

        def shown(v: Any) -> str:
            if v is None:
                return "-"
            return f"{v:.0f}" if isinstance(v, (int, float)) else str(v)

        rows.append((slug, shown(entry.get("first_result_ms")), shown(entry.get("settled_ms")),
                     shown(drag.get("p50_ms")), shown(drag.get("p90_ms")),
                     shown(drag.get("missing")), shown(drag.get("release_exact_ms"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 1) if got else None


def bench_pages(*, model: str = DEFAULT_MODEL, pages: str = "all", runs: int = 1, moves: int = 6,
                drags: int = 2, timeout_s: float = 120, move_timeout_s: float = 5.0,
                settle_s: float = 0.3, quiet_s: float = 1.5, idle_s: float = 3.0,
                width: int = 1400, titles: dict[str, str] | None = None) -> dict[str, Any]:
    """Per gallery page: time to its first result, to settled, and its live slider's drag.

    Parameters
    ----------
    model : str, default="smollm2-135m"
        The model the gallery serves.
    pages : str, default="all"
        Comma-separated page slugs (``lens,attention``), in the order they are opened, or
        ``all`` (every page of the sidebar, in its order).
    runs : int, default=1
        Fresh browser sessions, each opening every page (and dragging its slider) in turn;
        the server and its caches stay up between runs.
    moves, drags : int
        Slider steps per drag, and drags per page and run (alternating direction).
    timeout_s : float, default=120
        Seconds a page may take to show its first result and settle.
    move_timeout_s, settle_s, quiet_s, idle_s : float
        A step's wait for its redraw; the pause after it; how long the plots stay unchanged
        (and no job in flight) to count as settled; how long a page with no job in flight
        and no result counts as waiting for the user.
    width : int, default=1400
        The browser's width in pixels (height 1000).
    titles : dict, optional
        Page slug -> sidebar title, so ``pages`` can name pages by slug (``explorer bench
        pages`` passes the gallery's, `apps._page_titles.PAGE_TITLES`); without it pages are
        named by their sidebar titles.
    """
    runs = check_int("runs", runs, low=1, high=20)
    moves = check_int("moves", moves, low=1, high=40)
    drags = check_int("drags", drags, low=0, high=10)
    width = check_int("width", width, low=600, high=4000)
    timeout_s = check_float("timeout_s", timeout_s, low=5.0)
    move_timeout_s = check_float("move_timeout_s", move_timeout_s, low=0.5)
    settle_s = check_float("settle_s", settle_s, low=0.0)
    quiet_s = check_float("quiet_s", quiet_s, low=0.2)
    idle_s = check_float("idle_s", idle_s, low=0.5)
    every = str(pages).strip().lower() in ("", "all")
    asked = [] if every else [p.strip() for p in str(pages).split(",") if p.strip()]
    if not every and not asked:
        raise InputError(f"`pages` must list page slugs (lens,attention) or be 'all'; got {pages!r}.")
    sync_playwright = sync_playwright_for("pages")
    log_dir = Path(tempfile.mkdtemp(prefix="explorer-bench-pages-"))
    wanted: list[tuple[str, str]] = []      # (slug, sidebar title), read from the sidebar
    per_run: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    try:
        with _server(model, None, log_dir) as (_proc, port), sync_playwright() as pw:
            url = f"http://127.0.0.1:{port}/"
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            for run in range(runs):
                context = browser.new_context(viewport={"width": width, "height": 1000})
                context.add_init_script(RECORDER)
                tab = context.new_page()
                tab.goto(url, timeout=1000 * timeout_s + 180_000)
                tab.wait_for_selector(".bk-btn-group button", state="attached",
                                      timeout=1000 * timeout_s + 180_000)
                _wait_loaded(tab, quiet_s=quiet_s, timeout_s=timeout_s)
                if not wanted:
                    wanted = _pages_asked(tab, asked, dict(titles or {}))
                got: dict[str, Any] = {}
                for slug, title in wanted:
                    entry = _open_page(tab, title, timeout_s=timeout_s, quiet_s=quiet_s,
                                       idle_s=idle_s)
                    slug = entry.pop("slug") or slug
                    _say(f"run {run + 1}: {slug}: first result {entry['first_result_ms']} ms, "
                         f"settled {entry['settled_ms']} ms")
                    if slug in SLIDERS and entry["first_result_ms"] is not None:
                        if slug in PREPARE:
                            entry["prepared"] = _prepare(tab, PREPARE[slug], quiet_s=quiet_s,
                                                         timeout_s=timeout_s)
                        entry["drags"] = []
                        for d in range(drags):
                            previous = entry["drags"][-1].get("direction") if entry["drags"] else None
                            entry["drags"].append(_drag(
                                tab, SLIDERS[slug], moves=moves,
                                direction=None if previous is None else -previous,
                                move_timeout_s=move_timeout_s, settle_s=settle_s,
                                quiet_s=quiet_s, timeout_s=timeout_s))
                        _say(f"run {run + 1}: {slug}: drag steps (ms) "
                             f"{[s['ms'] for d in entry['drags'] for s in d.get('steps', [])]}, "
                             f"release → exact {[d.get('release_exact_ms') for d in entry['drags']]}")
                    got[slug] = entry
                costs.append(tab.evaluate(_COSTS))
                per_run.append(got)
                context.close()
            browser.close()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return _result(model, list(per_run[0]), runs, moves, drags, per_run, costs)


def _result(model: str, wanted: list[str], runs: int, moves: int, drags: int,
            per_run: list[dict[str, Any]], costs: list[dict[str, Any]]) -> dict[str, Any]:
    per_page: dict[str, Any] = {}
    figures: dict[str, float] = {}
    notes: dict[str, str] = {}
    for slug in wanted:
        entries = [r[slug] for r in per_run]
        firsts = [e["first_result_ms"] for e in entries]
        row: dict[str, Any] = {"first_result_ms": _median(firsts), "first_result_each_ms": firsts,
                               "settled_ms": _median([e["settled_ms"] for e in entries])}
        if row["first_result_ms"] is None:
            notes[slug] = ("no plot result after opening: the page waits for a button, draws "
                           "no plot, or took longer than timeout_s")
        if row["first_result_ms"]:
            figures[f"{slug}_first_result_ms"] = row["first_result_ms"]
        prepared = [e["prepared"] for e in entries if "prepared" in e]
        if prepared:
            row["prepared"] = {"button": prepared[0]["button"],
                               "quiet_each_ms": [p["quiet_ms"] for p in prepared]}
        dragged = [d for e in entries for d in e.get("drags", [])]
        if dragged:
            steps = [s for d in dragged for s in d.get("steps", [])]
            drawn = [s["ms"] for s in steps if s["ms"] is not None]
            exact = [d["release_exact_ms"] for d in dragged if d.get("release_exact_ms")]
            drag: dict[str, Any] = {"steps": len(steps), "missing": len(steps) - len(drawn),
                                    "each_ms": [s["ms"] for s in steps],
                                    "release_exact_each_ms": [d.get("release_exact_ms")
                                                              for d in dragged]}
            errors = sorted({d["error"] for d in dragged if "error" in d})
            if errors:
                drag["errors"] = errors
            if drawn:
                drag.update(_summary(drawn))
                figures[f"{slug}_drag_p50_ms"] = drag["p50_ms"]
                figures[f"{slug}_drag_p90_ms"] = drag["p90_ms"]
                for part in ("input_ms", "server_ms", "paint_ms"):
                    vals = [s[part] for s in steps if part in s]
                    if vals:
                        drag[f"{part[:-3]}_p50_ms"] = round(percentile(vals, 50), 1)
            elif steps:
                notes[f"{slug}_drag"] = ("no step of the drag redrew the page's plots: the "
                                         "slider applies on release")
            if exact:
                drag["release_exact_ms"] = round(statistics.median(exact), 1)
                figures[f"{slug}_release_exact_ms"] = drag["release_exact_ms"]
            row["drag"] = drag
        per_page[slug] = row
    watch = {k: round(statistics.median([c[k] for c in costs if c[k] is not None]), 3)
             for k in ("signature_ms", "frame_idle_ms") if any(c[k] is not None for c in costs)}
    figures.update({k: v for k, v in watch.items() if v > 0})
    notes["watch"] = ("signature_ms: main-thread time of one pixel read (after a Bokeh paint); "
                      "frame_idle_ms: of an animation frame with no paint (medians)")
    return {"params": {"model": model, "pages": wanted, "runs": runs, "moves": moves,
                       "drags": drags, "per_page": per_page},
            "figures": figures, "notes": notes}
