"""What the browser tests share: serving a page on a free 127.0.0.1 port, and waiting on it.

Pages are served either in this process (`served_in_process`, Panel's threaded server:
fast, shares the session's fixtures) or in a child process (`served_in_subprocess`: its
own interpreter, e.g. the gallery as a user starts it; `served_view` and the module fixture
`served_view_fixture` serve one page so). Both wait until the server's own
process listens on the port and it answers, and stop the server afterwards; the port comes
from `free_port`, which gives each parallel test worker its own range. The waits read either a pane's text (`wait_for_text`) or a
data attribute that a page sets on itself (`attribute`, `wait_for`). The browser itself is
the `browser` fixture in conftest.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from explorer.benches.child import answers, child_server, listens

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"   # gitignored screenshots for a look by eye

# Panel panes render inside a shadow root, after their <style> elements
SHADOW_TEXT = """el => el.shadowRoot
    ? Array.from(el.shadowRoot.children).filter(c => !['STYLE', 'LINK'].includes(c.tagName))
        .map(c => c.innerText).join(' ')
    : el.innerText"""


_PORTS_FROM = 20000   # the ports tests serve on lie below the kernel's ephemeral range
_RANDOM = random.SystemRandom()   # not the `random` module's state, which tests may seed


def _ports_of_this_process() -> range:
    """The ports this test process serves on: its own share of ``20000 ..`` the start of the
    kernel's ephemeral range (where client connections get their ports), one share per
    xdist worker, so two workers never pick the same port and a client socket never holds
    one a server is about to bind."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    share = (max(ephemeral, _PORTS_FROM + 1000) - _PORTS_FROM) // max(count, index + 1)
    start = _PORTS_FROM + index * share
    return range(start, start + share)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now, from this test process's own
    share (`_ports_of_this_process`); another test session on the machine may pick from the
    same share, so the port is checked by binding it, and picked at random."""
    ports = _ports_of_this_process()
    for _ in range(200):
        port = _RANDOM.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {ports.start}..{ports.stop - 1}")


@contextlib.contextmanager
def served_in_process(pages: dict[str, Callable], *, timeout: float = 30,
                      **serve_options) -> Iterator[str]:
    """Serve ``{slug: page factory}`` with Panel's threaded server; yields the base URL.

    ``serve_options`` go to `panel.serve` (e.g. session lifetimes).
    """
    import panel as pn

    from apps import theme

    theme.enable_extension()
    port = free_port()
    server = pn.serve(pages, port=port, address="127.0.0.1", threaded=True, show=False,
                      websocket_origin=[f"127.0.0.1:{port}"], **serve_options)
    try:
        deadline = time.time() + timeout
        while not (listens(os.getpid(), port) and answers(port)):
            if time.time() > deadline:
                raise RuntimeError(f"the page server did not answer on port {port} in {timeout} s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def served_galleries(model: str, *, slug: str = "", **gallery) -> Iterator[tuple[str, list]]:
    """Serve `apps.gallery.Gallery` ``(model, **gallery)`` in this process, one per browser
    session, at ``/<slug>`` (the root by default); yields the page's URL and the list of the
    sessions' galleries in the order they opened, for tests that read a session's state."""
    from apps.gallery import Gallery

    sessions: list[Gallery] = []

    def app() -> object:
        g = Gallery(model, **gallery)
        sessions.append(g)
        return g.template()

    with served_in_process({slug or "/": app}) as url:
        yield (f"{url}/{slug}" if slug else url), sessions


@contextlib.contextmanager
def served_in_subprocess(argv: Sequence[str], port: int, log_path: Path, *,
                         timeout: float = 240, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``python argv...`` (a server listening on ``port``); yields its base URL.

    The child's output goes to ``log_path``; its tail is in the error if it exits early.
    """
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with child_server([sys.executable, *argv], port, log=log_path, env=env, cwd=ROOT,
                      timeout=timeout, own_port=True, poll=0.3):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def served_view(folder: Path, name: str, setup: str, app: str, *, one_thread: bool = False,
                timeout: float = 240, env: dict[str, str] | None = None) -> Iterator[str]:
    """One page (``name`` its path; "/" for the root) served by a child interpreter, as
    `panel serve` would; yields its URL.

    ``setup`` is the module code run once (imports, ``model = load_model(...)``), ``app`` the
    body of the function that makes the page for each session (it returns it). The child
    loads the theme's extension after ``setup``; with ``one_thread`` torch runs on one
    thread. Its output goes to ``folder``/server.log; ``EXPLORER_CACHE`` is
    ``folder``/cache unless ``env`` says otherwise."""
    port = free_port()
    threads = "import torch\ntorch.set_num_threads(1)\n" if one_thread else ""
    code = (f"{threads}import panel as pn\nfrom apps import theme\n"
            f"{textwrap.dedent(setup).strip()}\ntheme.enable_extension()\n\n"
            f"def app():\n{textwrap.indent(textwrap.dedent(app).strip(), '    ')}\n\n"
            f"pn.serve({{{name!r}: app}}, port={port}, address='127.0.0.1', threaded=True, show=False,\n"
            f"         websocket_origin=['127.0.0.1:{port}']).join()  # the interpreter stays\n")
    with served_in_subprocess(["-c", code], port, folder / "server.log", timeout=timeout,
                              env={"EXPLORER_CACHE": str(folder / "cache"), **(env or {})}) as url:
        yield f"{url}/{name.strip('/')}"


def served_view_fixture(name: str, setup: str | Callable[[Path], str],
                        app: str | Callable[[Path], str], **options):
    """A module-scoped ``page_url`` fixture: the page ``name`` served by `served_view` from a
    temp folder of its own, for the module's tests; it yields the page's URL.

    ``setup`` and ``app`` are the code `served_view` takes, or functions of that folder that
    give it (for code that reads files written there first); ``options`` go to `served_view`.
    A test module assigns it: ``page_url = served_view_fixture("icl", setup, app)``."""
    import pytest

    @pytest.fixture(scope="module")
    def page_url(tmp_path_factory):
        folder = tmp_path_factory.mktemp(f"{name.strip('/') or 'root'}-server")
        code = [part(folder) if callable(part) else part for part in (setup, app)]
        with served_view(folder, name, *code, **options) as url:
            yield url

    return page_url


# -- one page server per test process, shared by the browser tests that read pages --------

_SHARED: dict[str, Callable[[], object] | None] = {}
"""The apps of the shared server, by path: reserved when a test module is imported (every
module is imported before the first test runs, so the server knows every path when it
starts) and set by the module's ``page_url`` fixture for its tests."""


def shared_page(slug: str, build: Callable[[object], Callable[[], object]]):
    """A module-scoped ``page_url`` fixture for a page served by the test process's shared
    server (the `shared_server` fixture in conftest: Panel's threaded server in this
    process, started once per test worker), at ``/<slug>``; it yields the page's URL.

    ``build(request)`` runs once, when the module's first test needs the page (``request``
    is that fixture's request: ``request.getfixturevalue`` gives other fixtures), and
    returns the app: a function of no arguments that makes one browser session's page
    (``lambda: Gallery("tiny-llama", views=...).template()``). Each browser session gets a
    page of its own, so tests that open the page in fresh browser contexts share nothing
    but the server and the process's models. The pages read ``$EXPLORER_CACHE`` of the
    process. A module assigns it: ``page_url = shared_page("positions", build)``; the
    module must import it from ``_browser`` (not ``tests._browser``)."""
    import pytest

    if slug in _SHARED:
        raise ValueError(f"the shared server already has a page at /{slug}: pick another slug")
    _SHARED[slug] = None

    @pytest.fixture(scope="module")
    def page_url(request, shared_server):
        _SHARED[slug] = build(request)
        try:
            yield f"{shared_server}/{slug}"
        finally:
            _SHARED[slug] = None

    return page_url


@contextlib.contextmanager
def serve_shared(**serve_options) -> Iterator[str]:
    """Serve every path reserved by `shared_page` (the app its module set, or a note that
    none is set); yields the base URL. The `shared_server` fixture's body."""
    import panel as pn
    from _patch_log import install

    install()                                   # to explain an unknown-reference page error

    def app(slug: str):
        def session():
            made = _SHARED.get(slug)
            if made is None:
                return pn.pane.Markdown(f"No test module serves /{slug} now.")
            return made()
        return session

    with served_in_process({slug: app(slug) for slug in _SHARED}, timeout=60,
                           **serve_options) as url:
        yield url


def open_page(browser, url: str, *, viewport: dict | None = None, timeout: float = 300,
              ready: str = ".bk-Canvas canvas, canvas"):
    """A new tab on ``url`` once ``ready`` (by default a Bokeh canvas) is attached; returns
    (page, JavaScript errors)."""
    page = browser.new_page(viewport=viewport or {"width": 1500, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url, timeout=180_000)  # generous: the machine running the suite may be busy
    page.wait_for_selector(ready, state="attached", timeout=timeout * 1000)
    return page, errors


def open_gallery(browser, served: tuple[str, list], *, ready: str, timeout: float = 180):
    """A tab on the gallery `served_galleries` serves, once ``ready`` is attached and the
    page has settled; returns (tab, that tab's session `Gallery`)."""
    url, sessions = served
    tab, _ = open_page(browser, url, viewport={"width": 1280, "height": 1000}, timeout=timeout,
                       ready=ready)
    assert settle_gallery_page(tab, timeout=240)
    return tab, sessions[-1]


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, what: str = "",
               interval: float = 0.1) -> object:
    """``predicate()``'s first truthy value, polled in this thread (the server's state, read
    in process); AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what}")


def wait_for_canvas(page, selector: str, timeout: float = 240) -> None:
    """Until a canvas inside ``selector`` is attached."""
    page.wait_for_selector(f"{selector} canvas", state="attached", timeout=timeout * 1000)


def wait_for_text(page, selector: str, pattern: str, timeout: float = 240) -> str:
    """The text of the first ``selector`` (shadow DOM included) once it matches ``pattern``."""
    deadline = time.time() + timeout
    last = ""
    while time.time() < deadline:
        loc = page.locator(selector)
        if loc.count():
            last = loc.first.evaluate(SHADOW_TEXT)
            if re.search(pattern, last):
                return last
        page.wait_for_timeout(250)
    raise AssertionError(f"{selector!r} never matched {pattern!r}; last text: {last!r}")


_AWAY = {"Home": "End", "End": "Home"}


def press_until(page, handle_css: str, key: str, selector: str, pattern: str, *, nth: int = 0,
                tries: int = 4, timeout: float = 60) -> str:
    """Press ``key`` ("Home" or "End") on a slider handle until ``selector`` reads ``pattern``.

    A press that lands while the page is still settling after its first result can move the
    handle without the value reaching the server; pressing the same key again then changes
    nothing. So each retry looks the handle up again, moves it to the other end first and
    then presses ``key``.
    """
    if key not in _AWAY:
        raise ValueError(f"press_until moves a handle to an end: key must be one of {sorted(_AWAY)}")
    for attempt in range(tries):
        handle = page.locator(handle_css).nth(nth)
        handle.focus()
        if attempt:
            handle.press(_AWAY[key])
            page.wait_for_timeout(1000)
        handle.press(key)
        try:
            return wait_for_text(page, selector, pattern, timeout=timeout)
        except AssertionError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _page_of(target):
    return target if hasattr(target, "goto") else target.page


def painted(target, *, timeout: float = 30, interval: float = 0.15, **screenshot) -> bytes:
    """A screenshot (PNG bytes) of ``target`` (a page or a locator) once two taken
    ``interval`` s apart are identical: layout, canvases and animations done. After
    ``timeout`` s the last one (a page that keeps moving, e.g. a spinner). ``screenshot``
    goes to Playwright's ``screenshot`` (``path``, ``full_page``): the file written is the
    settled image."""
    path = screenshot.pop("path", None)
    page = _page_of(target)
    deadline = time.time() + timeout
    last = target.screenshot(**screenshot)
    while time.time() < deadline:
        page.wait_for_timeout(interval * 1000)
        now = target.screenshot(**screenshot)
        if now == last:
            break
        last = now
    if path is not None:
        Path(path).write_bytes(last)
    return last


def steady(page, expression: str, *, timeout: float = 30, interval: float = 0.15):
    """The value of the JavaScript ``expression`` (a function of no arguments) once it is not
    null and the same twice in a row ``interval`` s apart (Bokeh's layout and data settled)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        value = page.evaluate(expression)
        if value is not None and value == last:
            return value
        last = value
        page.wait_for_timeout(interval * 1000)
    raise AssertionError(f"the page's value never settled in {timeout} s; last {last!r}")


def attribute(page, name: str) -> str:
    """The value of the data attribute ``name`` on the first element that carries it."""
    return page.locator(f"[{name}]").first.get_attribute(name)


def wait_for(page, name: str, predicate, timeout: float = 120) -> str:
    """The attribute ``name`` once ``predicate`` holds for it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = attribute(page, name)
        if predicate(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"{name} is {attribute(page, name)!r} after {timeout} s")


def slider_handle(page, low: float, high: float):
    """The handle of the (first) slider whose range is ``low..high``."""
    handles = page.locator(".noUi-handle")
    for i in range(handles.count()):
        h = handles.nth(i)
        if (float(h.get_attribute("aria-valuemin")) == low
                and float(h.get_attribute("aria-valuemax")) == high):
            return h
    raise AssertionError(f"no slider with range {low}..{high}")


# -- what a page shows: Bokeh's layout, the pixels, titles, selects ------------------------

_PLOT_VIEWS = """() => [...Bokeh.index.all_views()].filter(v =>
    (v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected
    && v.el.offsetParent != null)"""

# One line per plot in the page now, and whether anything is still spinning.
_SIGNATURE = f"""(busy) => {{
  if (window.Bokeh == null || Bokeh.index == null) return null
  const plots = ({_PLOT_VIEWS})()
  let spinning = [...Bokeh.index.all_views()].filter(v => v.el != null && v.el.isConnected
      && v.el.offsetParent != null && (v.model.css_classes || []).includes('spin')).length
  // a progress bar on show that has not reached its end (or has no value: indeterminate)
  const walk = root => {{
    for (const el of root.querySelectorAll('*')) {{
      if (el.tagName === 'PROGRESS' && el.offsetParent != null
          && (!el.hasAttribute('value') || el.value < el.max)) spinning += 1
      if (el.shadowRoot) walk(el.shadowRoot)
    }}
  }}
  walk(document)
  // a status line on show that says work is under way (``busy``: a regular expression)
  if (busy) {{
    const pattern = new RegExp(busy, 'i')
    const texts = root => {{
      for (const el of root.querySelectorAll('*')) {{
        if (el.offsetParent != null)
          for (const node of el.childNodes)
            if (node.nodeType === 3 && pattern.test(node.textContent)) spinning += 1
        if (el.shadowRoot) texts(el.shadowRoot)
      }}
    }}
    texts(document)
    // and a placeholder drawn inside a plot ("Measuring long-string accuracy…", hv.Text)
    for (const v of plots)
      for (const r of v.model.renderers)
        if (r.glyph != null && r.glyph.type === 'Text' && r.data_source != null) {{
          const field = r.glyph.text != null ? r.glyph.text.field : null
          const column = field != null ? r.data_source.data[field] : null
          if (column != null && Array.from(column).some(t => pattern.test(String(t)))) spinning += 1
        }}
  }}
  // the gallery's "Stop running work" button: live while the session has a job submitted and
  // not finished (queued, running or about to deliver), whatever page it belongs to
  const stop = [...Bokeh.index.all_views()].filter(v =>
      (v.model.css_classes || []).includes('stop-work'))
  const active = stop.some(v => !v.model.disabled)
  if (active) spinning += 1
  // a document whose roots have not all finished their first render
  if (Bokeh.documents.some(d => !d.is_idle)) spinning += 1
  return {{spinning, gallery: stop.length > 0, active, ids: plots.map(v => v.model.id),
          plots: plots.map(v => [v.model.id, Math.round(v.bbox.width), Math.round(v.bbox.height),
                                 Math.round(v.frame.bbox.width), Math.round(v.frame.bbox.height),
                                 v.model.title != null ? v.model.title.text : ''])}}
}}"""


BUSY_TEXT = (r"\b(computing|analysing|training|loading|measuring|running|scoring|comparing|"
             r"tracing|attributing|waiting|localizing)\b[^.]*…")
"""A status line or placeholder of a page at work ("Training H = 2: step 40/200 (3 s)…",
"computing td…", "Comparing the two prompts…"): every such verb the pages write before "…"."""


QUIET_S = {"gallery": 1.5, "page": 3.0}
"""Seconds a page's plots must stay unchanged to count as settled: in the gallery, whose stop
button says when the session has no job in flight, and on a page served alone, which can
only be watched."""


def show_gallery_page(tab, title: str, *, width: int, timeout: float = 240) -> None:
    """Open the gallery page ``title`` from the sidebar, move the mouse off it (no tooltip
    over the page) and wait until it settles (`settle_gallery_page`; for the page already
    shown, until its plots are still)."""
    button = tab.locator(".bk-btn-group button", has_text=title).first
    before = [] if "bk-active" in (button.get_attribute("class") or "") else plot_ids(tab)
    button.click()
    tab.mouse.move(width // 2, 10)
    assert settle_gallery_page(tab, before=before, timeout=timeout), f"{title} did not settle"


def settle_gallery_page(page, *, before: Sequence[str] = (), timeout: float = 90,
                        quiet: float | None = None, busy: str | None = BUSY_TEXT) -> bool:
    """Wait until the page's Bokeh plots stop changing: no spinner or unfinished progress bar
    shown, no text matching ``busy`` (default `BUSY_TEXT`) shown (in the page or drawn in a
    plot), no job of the session in flight (the gallery's stop button is off), every Bokeh
    document idle, the same plots at the same sizes for ``quiet`` seconds (default `QUIET_S`),
    and (when ``before`` lists the plot ids shown before a navigation) not the plots of the
    page left behind. False on timeout."""
    deadline = time.time() + timeout
    last, since = None, time.time()
    while time.time() < deadline:
        sig = page.evaluate(_SIGNATURE, busy)
        fresh = sig is not None and sig["ids"] and not set(sig["ids"]) <= set(before)
        key = json.dumps(sig["plots"]) if sig else None
        wait = quiet if quiet is not None else QUIET_S["gallery" if sig and sig["gallery"] else "page"]
        if key != last or not fresh or sig["spinning"]:
            last, since = key, time.time()
        elif time.time() - since >= wait:
            return True
        page.wait_for_timeout(250)
    return False


RESIZED_QUIET_S = 0.5
"""Seconds the plots must stay unchanged after the window is resized with the page open:
nothing is computed, Bokeh only lays the same plots out again."""

_NEXT_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"


def resize_and_settle(page, width: int, height: int, *, timeout: float = 90,
                      quiet: float = RESIZED_QUIET_S) -> bool:
    """Resize the window to ``width`` x ``height`` with the page open, as a person widening
    the browser does, and wait (`settle_gallery_page`, ``quiet`` s) until Bokeh has laid the
    plots out again and drawn them: two animation frames (the resize observers' turn) and
    then the same plots at the same sizes for ``quiet`` s. False on timeout."""
    page.set_viewport_size({"width": width, "height": height})
    page.evaluate(_NEXT_FRAMES)
    return settle_gallery_page(page, timeout=timeout, quiet=quiet)


def plot_ids(page) -> list[str]:
    """Model ids of the Bokeh plots shown now."""
    sig = page.evaluate(_SIGNATURE, None)
    return list(sig["ids"]) if sig else []


# The frame (data area) of the first plot inside the pane with CSS class `css`, in page
# pixels: {left, top, width, height}.
FRAME_IN_PANE = """(css) => {
  const views = [...Bokeh.index.all_views()].filter(v =>
      (v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected
      && v.el.offsetParent != null)
  for (const v of views) {
    let node = v.el, inside = false
    while (node != null) {
      if (node.classList != null && node.classList.contains(css)) { inside = true; break }
      node = node.parentNode || node.host
    }
    if (!inside) continue
    const c = v.canvas_view.el.getBoundingClientRect(), f = v.frame.bbox
    return {left: c.left + f.left, top: c.top + f.top, width: f.width, height: f.height}
  }
  return null
}"""

# A plot's title: its text, its width as Bokeh measures it and the room it has from where it
# starts: to the canvas's edge, or to the toolbar's left edge where the toolbar shares the
# title's row (a toolbar "above" is drawn in the title's band and covers what runs under it).
TITLE_FIT = """(v) => {
  const title = v.model.title
  const text = title != null && title.text ? String(title.text) : ''
  if (!text) return {text, tw: 0, room: Infinity}
  const cv = v.canvas_view, width = cv.bbox.width
  const tv = [...Bokeh.index.all_views()].find(t => t.model === title)
  let tw, room, sx, band = null
  if (tv != null && tv.layout != null) {
    tw = tv._get_size().width
    sx = tv._get_position().sx
    room = title.align === 'center' ? 2 * Math.min(sx, width - sx)
         : title.align === 'right' ? sx : width - sx
    band = tv.layout.bbox
  } else {
    const ctx = document.createElement('canvas').getContext('2d')
    ctx.font = `${title.text_font_style} ${title.text_font_size} ${title.text_font}`
    tw = ctx.measureText(text).width
    sx = v.frame.bbox.left
    room = width - sx
  }
  const panel = v.toolbar_panel
  const bar = panel != null && panel.toolbar_view != null ? panel.toolbar_view.el : null
  if (band != null && bar != null && bar.isConnected) {
    const c = cv.el.getBoundingClientRect(), t = bar.getBoundingClientRect()
    const left = t.left - c.left, top = t.top - c.top, bottom = t.bottom - c.top
    if (t.width > 0 && t.height > 0 && top < band.bottom && bottom > band.top && left > 0) {
      room = Math.min(room, title.align === 'center' ? 2 * (left - sx)
                          : title.align === 'right' ? (left >= sx ? room : 0) : left - sx)
    }
  }
  return {text, tw, room}
}"""


def title_fits(plot: dict) -> bool:
    """A plot's title (`TITLE_FIT`, as `gallery_page_state` reports it) is no wider than its
    room, within a pixel; a plot without a title fits."""
    return not plot["title"] or plot["title_width"] <= plot["title_room"] + 1


def clipped_titles(plots: list[dict]) -> list[tuple[str, int, int]]:
    """The titles that do not fit (`title_fits`): (text, width px, room px)."""
    return [(p["title"], round(p["title_width"]), round(p["title_room"]))
            for p in plots if not title_fits(p)]


# Per plot: its outer box, its frame (data area), the canvas size, the share of the frame's
# pixels that differ from the frame's commonest colour, its title's width and room
# (`TITLE_FIT`). Per select: label, options.
_STATE = f"""() => {{
  const plots = ({_PLOT_VIEWS})().map(v => {{
    const frame = v.frame.bbox, cv = v.canvas_view
    const canvas = cv.primary.canvas
    let ink = 0
    if (frame.width >= 1 && frame.height >= 1 && canvas.width > 0 && canvas.height > 0) {{
      const r = canvas.width / Math.max(1, cv.bbox.width)
      const x = Math.max(0, Math.floor(frame.left * r)), y = Math.max(0, Math.floor(frame.top * r))
      const w = Math.min(canvas.width - x, Math.floor(frame.width * r))
      const h = Math.min(canvas.height - y, Math.floor(frame.height * r))
      if (w > 0 && h > 0) {{
        const data = canvas.getContext('2d').getImageData(x, y, w, h).data
        const counts = new Map()
        for (let i = 0; i < data.length; i += 4) {{
          const key = (data[i] << 24) | (data[i + 1] << 16) | (data[i + 2] << 8) | data[i + 3]
          counts.set(key, (counts.get(key) || 0) + 1)
        }}
        const commonest = Math.max(...counts.values())
        ink = 1 - commonest / (w * h)
      }}
    }}
    const {{text, tw, room}} = ({TITLE_FIT})(v)
    return {{id: v.model.id, title: text, title_width: tw, title_room: room,
            box: [Math.round(v.bbox.width), Math.round(v.bbox.height)],
            frame: [Math.round(frame.width), Math.round(frame.height)],
            canvas: [canvas.width, canvas.height], ink}}
  }})
  const selects = []
  const walk = root => {{
    for (const el of root.querySelectorAll('*')) {{
      if (el.tagName === 'SELECT' && el.getClientRects().length && el.offsetParent != null) {{
        const label = el.getRootNode().querySelector('label')
        const shown = el.selectedIndex >= 0 ? el.options[el.selectedIndex].text.trim() : ''
        const named = [...el.options].filter(o => o.text.trim()).length
        selects.push({{label: label ? label.innerText.trim() : '', options: el.options.length,
                      named, shown}})
      }}
      if (el.shadowRoot) walk(el.shadowRoot)
    }}
  }}
  walk(document)
  return {{plots, selects}}
}}"""


def gallery_page_state(page) -> dict:
    """What the page shows now: ``plots`` (see `_STATE`) and ``selects`` (label, number of
    options, how many have text, the text of the option shown)."""
    return page.evaluate(_STATE)


# Per axis of each plot shown whose tick labels Bokeh draws all of (its `AllLabels` policy;
# the app's theme sets a policy that hides the ones that would collide): the neighbouring
# major tick labels whose boxes overlap along the axis. Text drawn at an angle collides when the distance
# between neighbouring labels, across the text, is less than the text's height.
_TICK_COLLISIONS = """() => {
  const out = []
  for (const v of Bokeh.index.all_views()) {
    const type = v.model.type || ''
    if (!type.endsWith('Axis') || v.parent == null || v.parent.el == null) continue
    if (!v.parent.el.isConnected || v.parent.el.offsetParent == null || !v.model.visible) continue
    const policy = v.model.major_label_policy
    if (policy == null || policy.type !== 'AllLabels') continue
    let coords, labels
    try {
      coords = v.tick_coords.major
      const dim = v.dimension
      const ticks = coords[dim]
      if (ticks.length < 2) continue
      labels = v.compute_labels(ticks)
      labels.visuals = v.visuals.major_label_text.values()   // the font the axis draws with
      const screen = v.scoords(coords)[dim]
      const orient = v.model.major_label_orientation
      const angle = typeof orient === 'number' ? orient
          : orient === 'vertical' ? Math.PI / 2 : orient === 'horizontal' ? 0
          : orient === 'parallel' ? (dim === 0 ? 0 : Math.PI / 2) : (dim === 0 ? Math.PI / 2 : 0)
      // the label's direction against the axis: 0 when the text runs along it
      const across = dim === 0 ? Math.abs(Math.sin(angle)) : Math.abs(Math.cos(angle))
      const items = labels.items.map((box, i) => ({text: typeof box.text === 'string' ? box.text : '',
                                                   at: screen[i], size: box.size()}))
        .filter(x => x.text.trim() && Number.isFinite(x.at)).sort((a, b) => a.at - b.at)
      for (let i = 1; i < items.length; i++) {
        const a = items[i - 1], b = items[i]
        const gap = Math.abs(b.at - a.at)
        const clash = across > 0.2
          ? gap * across < 0.9 * Math.max(a.size.height, b.size.height)
          : gap < (a.size.width + b.size.width) / 2 + 1
        if (clash) {
          const title = v.parent.model.title != null ? String(v.parent.model.title.text) : ''
          out.push({plot: title, axis: dim === 0 ? 'x' : 'y', labels: [a.text, b.text],
                    gap: Math.round(gap)})
          break
        }
      }
    } catch (e) {
      out.push({plot: '', axis: '?', labels: [], error: String(e)})
    }
  }
  return out
}"""


def tick_collisions(page) -> list[dict]:
    """Axes of the plots shown now whose neighbouring tick labels overlap: one entry per
    axis (plot title, ``x``/``y``, the first two labels that collide, their distance)."""
    return page.evaluate(_TICK_COLLISIONS)
