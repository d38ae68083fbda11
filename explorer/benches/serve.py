"""``explorer bench serve``: a shared gallery under load, measured from real browsers.

It starts ``explorer serve`` in a subprocess (on 127.0.0.1, a free port) and drives headless
chromium through Playwright. First, on the quiet server, one session opens the Logit lens and
moves its steering slider (the light figures' baseline). Then, for each session count N, N
browser contexts open at once: ``heavy`` of them start a heavy analysis (by default the
Saturation page's corpus analysis) and the others open the lens and move its slider while those
run. It reports the light pages' open and update times against the quiet ones (as ratios), how
long each heavy job waited in the server's queue, and the server's resident memory (its process
tree) with one session, with N idle sessions, and after every session has closed and the server
has dropped it.

Open: from navigation to the lens's result shown (its ``data-lens-digest`` attribute set and its
plot's canvas drawn). Update: one key step of the steering slider to a new digest (a server
round trip and a redraw).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from explorer._checks import InputError, check_int
from explorer.benches.child import child_server, unused_port
from explorer.benches.timing import median_ms
from explorer.defaults import DEFAULT_MODEL

__all__ = ["bench_serve"]

#: How the project launches a browser (the serve bench, the browser tests, the screenshot
#: scripts): Debian's chromium, never a Playwright-downloaded one, with these flags.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def sync_playwright_for(bench: str) -> Any:
    """Playwright's ``sync_playwright``, checked to drive Debian's chromium; an InputError
    naming ``bench`` and what to install when either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise InputError(f"the {bench} bench drives chromium with Playwright: pip install "
                         f"playwright (and apt-get install chromium)") from None
    if not Path(CHROMIUM).exists():
        raise InputError(f"the {bench} bench needs chromium at {CHROMIUM} (apt-get install chromium)")
    return sync_playwright


_WAITING = "Waiting for the server:"
#: Seconds a heavy tab has, from its click, to show that it waits in the queue; one that has
#: not by then is counted as not queued (a wait of 0).
QUEUE_WAIT_GRACE_S = 5.0
_DIGEST = "[data-lens-digest]"


def _rss_mb(pid: int) -> float:
    """Resident memory of a process and its children, in MB."""
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total / 2**20


@contextlib.contextmanager
def _server(model: str, heavy_jobs: int | None, log_dir: Path, timeout: float = 600
            ) -> Iterator[tuple[subprocess.Popen, int]]:
    port = unused_port()
    env = dict(os.environ)
    if heavy_jobs is not None:
        env["EXPLORER_HEAVY_JOBS"] = str(heavy_jobs)
    # no result cache warm-up: the pages compute what is timed, and no child shares the cores
    argv = [sys.executable, "-m", "explorer.cli", "serve", "--model", model, "--port", str(port),
            "--no-warm-cache"]
    with child_server(argv, port, log=log_dir / "serve.log", env=env, timeout=timeout) as proc:
        yield proc, port


def _lens_open(context: Any, url: str, timeout_ms: float) -> tuple[Any, float]:
    """A new tab on the lens; seconds from navigation to its result drawn."""
    page = context.new_page()
    start = time.perf_counter()
    page.goto(url + "?view=lens", timeout=timeout_ms)
    page.locator(".lens-plot canvas").first.wait_for(state="attached", timeout=timeout_ms)
    _until(lambda: page.locator(_DIGEST).count() > 0
           and page.locator(_DIGEST).first.get_attribute("data-lens-digest"), timeout_ms)
    return page, time.perf_counter() - start


def _until(predicate: Any, timeout_ms: float, poll: float = 0.02) -> None:
    """Poll ``predicate`` (Playwright locators pierce Panel's shadow roots; a page script
    would not) until it is true."""
    deadline = time.monotonic() + timeout_ms / 1000
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result within {timeout_ms / 1000:.0f} s")
        time.sleep(poll)


def _lens_update(page: Any, timeout_ms: float, key: str) -> float:
    """Seconds from one key step of the steering slider to a new result shown."""
    digest = page.locator(_DIGEST).first
    before = digest.get_attribute("data-lens-digest")
    handle = page.locator(".bk-input-group", has_text="Steering strength").locator(".noUi-handle")
    handle.first.focus()
    start = time.perf_counter()
    page.keyboard.press(key)
    _until(lambda: digest.get_attribute("data-lens-digest") != before, timeout_ms)
    return time.perf_counter() - start


def _start_heavy(context: Any, url: str, page_slug: str, button: str, timeout_ms: float) -> tuple[Any, float]:
    """A new tab on ``page_slug`` with its heavy job started; returns (page, start time)."""
    page = context.new_page()
    page.goto(f"{url}?view={page_slug}", timeout=timeout_ms)
    target = page.locator("button", has_text=re.compile(button))
    target.first.wait_for(timeout=timeout_ms)
    started = time.perf_counter()
    target.first.click()
    return page, started


def _page_text(page: Any) -> str:
    """The page's text, shadow roots included."""
    return page.evaluate("""() => { const out = [];
        const walk = (root) => { for (const el of root.querySelectorAll('*')) {
            if (el.shadowRoot) walk(el.shadowRoot);
            if (el.childElementCount === 0 && el.textContent) out.push(el.textContent); } };
        walk(document); return out.join(' '); }""")


def _say(text: str) -> None:
    """Progress on stderr (the JSON result goes to stdout)."""
    print(f"[bench serve] {text}", file=sys.stderr, flush=True)


def bench_serve(*, model: str = DEFAULT_MODEL, sessions: str = "1,4,10", heavy: int = 3,
                updates: int = 3, heavy_page: str = "saturation", heavy_button: str = "^Analyse",
                heavy_jobs: int | None = None, idle_sessions: int = 6, close_wait_s: int = 45,
                timeout_s: int = 600) -> dict[str, Any]:
    """Light pages, queue waits and memory of a served gallery with N browser sessions.

    Parameters
    ----------
    model : str, default="smollm2-135m"
        The model the server loads.
    sessions : str, default="1,4,10"
        Comma-separated session counts N, measured in turn on the same server.
    heavy : int, default=3
        Sessions (of each N, at most N - 1) that start a heavy job; the rest use the lens.
    updates : int, default=3
        Slider steps timed per light session.
    heavy_page, heavy_button : str
        The gallery page (its ``?view=`` slug) and the button text (a regular expression) that
        start the heavy job.
    heavy_jobs : int, optional
        The server's heavy-job limit (default: the server's own, one per two cores).
    idle_sessions : int, default=6
        Lens sessions held open together on the quiet server, for the memory an idle session
        costs (0: skip).
    close_wait_s : int, default=45
        Seconds to wait after closing every session before the memory is read (the server
        drops a closed session after about 15-32 s).
    """
    try:
        counts = [int(part) for part in str(sessions).split(",") if part.strip()]
    except ValueError:
        raise InputError(f"`sessions` must list session counts, e.g. 1,4,10; got {sessions!r}.") from None
    counts = [check_int("sessions", n, low=1, high=64) for n in counts]
    if not counts:
        raise InputError("`sessions` must list session counts, e.g. 1,4,10; got ''.")
    heavy = check_int("heavy", heavy, low=0, high=63)
    updates = check_int("updates", updates, low=1, high=50)
    timeout_ms = 1000 * check_int("timeout_s", timeout_s, low=10)
    sync_playwright = sync_playwright_for("serve")
    log_dir = Path(tempfile.mkdtemp(prefix="explorer-bench-serve-"))
    figures: dict[str, float] = {}
    per_n: dict[str, Any] = {}
    keys = ["ArrowRight", "ArrowLeft"]
    try:
        with _server(model, heavy_jobs, log_dir) as (proc, port), sync_playwright() as pw:
            url = f"http://127.0.0.1:{port}/"
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            figures["server_no_session_mb"] = _rss_mb(proc.pid)
            # -- quiet: one session ----------------------------------------------------------
            quiet_open, quiet_update = [], []
            for i in range(2):                       # the first open warms the server's caches
                ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
                page, took = _lens_open(ctx, url, timeout_ms)
                _say(f"quiet server: lens opened in {took:.1f} s")
                if i:
                    quiet_open.append(took)
                    quiet_update += [_lens_update(page, timeout_ms, keys[j % 2]) for j in range(updates)]
                    figures["server_one_session_mb"] = _rss_mb(proc.pid)
                ctx.close()
            figures["lens_open_quiet_ms"] = median_ms(quiet_open)
            figures["lens_update_quiet_ms"] = median_ms(quiet_update)
            idle_sessions = check_int("idle_sessions", idle_sessions, low=0, high=64)
            if idle_sessions > 1:                    # memory of idle sessions, nothing else running
                contexts = [browser.new_context(viewport={"width": 1400, "height": 1000})
                            for _ in range(idle_sessions)]
                _lens_open(contexts[0], url, timeout_ms)
                one = _rss_mb(proc.pid)
                for ctx in contexts[1:]:
                    _lens_open(ctx, url, timeout_ms)
                time.sleep(2)
                figures["idle_session_mb"] = max(0.001, (_rss_mb(proc.pid) - one) / (idle_sessions - 1))
                _say(f"{idle_sessions} idle lens sessions: {figures['idle_session_mb']:.1f} MB each")
                for ctx in contexts:
                    ctx.close()
            time.sleep(close_wait_s)
            figures["server_after_quiet_close_mb"] = _rss_mb(proc.pid)
            # -- loaded: N sessions ----------------------------------------------------------
            for n in counts:
                n_heavy = min(heavy, n - 1) if n > 1 else 0
                contexts = [browser.new_context(viewport={"width": 1400, "height": 1000})
                            for _ in range(n)]
                heavy_tabs = [_start_heavy(contexts[i], url, heavy_page, heavy_button, timeout_ms)
                              for i in range(n_heavy)]
                opens, ups, lens_tabs = [], [], []
                for ctx in contexts[n_heavy:]:
                    page, took = _lens_open(ctx, url, timeout_ms)
                    opens.append(took)
                    lens_tabs.append(page)
                _say(f"N={n}: {n_heavy} heavy job(s) started, {len(opens)} lens session(s) "
                     f"opened (median {median_ms(opens):.0f} ms)")
                idle_mb = _rss_mb(proc.pid)
                for page in lens_tabs:
                    ups += [_lens_update(page, timeout_ms, keys[j % 2]) for j in range(updates)]
                waits, still = [], []
                for page, started in heavy_tabs:     # queue wait: until its status leaves the line
                    deadline = time.monotonic() + timeout_s
                    saw_wait = False
                    while time.monotonic() < deadline:
                        text = _page_text(page)
                        if _WAITING in text:
                            saw_wait = True
                        elif saw_wait or time.perf_counter() - started > QUEUE_WAIT_GRACE_S:
                            break
                        time.sleep(0.5)
                    waits.append(time.perf_counter() - started if saw_wait else 0.0)
                    if _WAITING in _page_text(page):
                        still.append(page)
                peak_mb = _rss_mb(proc.pid)
                for ctx in contexts:
                    ctx.close()
                time.sleep(close_wait_s)
                after_mb = _rss_mb(proc.pid)
                _say(f"N={n}: updates median {median_ms(ups):.0f} ms, queue waits "
                     f"{[round(w, 1) for w in waits]} s, memory {peak_mb:.0f} MB -> {after_mb:.0f} MB "
                     "after closing")
                entry = {"light_sessions": n - n_heavy, "heavy_sessions": n_heavy,
                         "lens_open_ms": round(median_ms(opens), 1),
                         "lens_open_max_ms": round(1000 * max(opens), 1),
                         "lens_update_ms": round(median_ms(ups), 1),
                         "lens_update_max_ms": round(1000 * max(ups), 1),
                         "queue_wait_ms": [round(1000 * w, 1) for w in waits],
                         "server_open_mb": round(idle_mb, 1), "server_peak_mb": round(peak_mb, 1),
                         "server_after_close_mb": round(after_mb, 1)}
                per_n[str(n)] = entry
            browser.close()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    top = per_n[str(counts[-1])]
    figures["lens_open_loaded_ms"] = top["lens_open_ms"]
    figures["lens_update_loaded_ms"] = top["lens_update_ms"]
    figures["lens_open_loaded_ratio"] = top["lens_open_ms"] / figures["lens_open_quiet_ms"]
    figures["lens_update_loaded_ratio"] = top["lens_update_ms"] / figures["lens_update_quiet_ms"]
    figures["server_after_close_mb"] = top["server_after_close_mb"]
    figures["after_close_vs_one_session_ratio"] = (top["server_after_close_mb"]
                                                   / figures["server_one_session_mb"])
    waits = [w for n in counts for w in per_n[str(n)]["queue_wait_ms"]]
    if any(waits):
        figures["queue_wait_max_ms"] = max(waits)
    return {"params": {"model": model, "sessions": counts, "heavy": heavy, "updates": updates,
                       "heavy_page": heavy_page, "heavy_button": heavy_button,
                       "heavy_jobs": heavy_jobs, "close_wait_s": close_wait_s, "per_n": per_n},
            "figures": {k: float(v) for k, v in figures.items()},
            "notes": {"idle_session_mb": "server RSS with idle_sessions lens sessions open minus "
                                         "with one, per extra session, on the quiet server",
                      "memory": "resident set of the server process tree (psutil)"}}
