"""What the evidence scripts share: rendering a HoloViews figure to a PNG for docs/figures/,
and serving a page in a child process to photograph it.

A figure is saved as standalone HTML (Bokeh resources inline, no network) and
screenshotted in Debian's chromium with Playwright once its canvas exists.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from explorer.benches.child import child_server, unused_port
from explorer.benches.serve import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[1]



def fixed(obj: Any, width: int, height: int) -> Any:
    """``obj`` at a fixed size in pixels (not responsive)."""
    return obj.opts(responsive=False, width=width, height=height)


def render_png(obj: Any, path: Path, *, width: int = 1100, height: int = 500,
               settle_ms: int = 1000) -> Path:
    """Write HoloViews object ``obj`` to ``path`` as a PNG of about ``width`` x ``height``."""
    import holoviews as hv
    from playwright.sync_api import sync_playwright

    hv.extension("bokeh", logo=False)
    with tempfile.TemporaryDirectory() as tmp:
        html_path = Path(tmp) / "plot.html"
        hv.save(obj, html_path, backend="bokeh", resources="inline")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width + 60, "height": height + 60})
            page.goto(html_path.as_uri())
            page.wait_for_selector("canvas", state="attached", timeout=60_000)
            page.wait_for_timeout(settle_ms)
            page.screenshot(path=str(path), full_page=True)
            browser.close()
    return path


def log(msg: str) -> None:
    """One progress line with the time of day, flushed at once."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def update_summary(path: Path, part: str, data: Any) -> None:
    """Set ``part`` of the JSON summary at ``path`` (the other parts stay as they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[part] = data
    path.write_text(json.dumps(old, indent=1) + "\n")


def update_timed_summary(path: Path, part: str, data: dict[str, Any]) -> None:
    """`update_summary` for a part that timed itself: ``data`` gains ``machine_after`` (the
    machine as the part ends; its ``machine_before`` is the machine as it began)."""
    data["machine_after"] = machine()
    update_summary(path, part, data)


def machine() -> dict[str, Any]:
    """What the timings were measured on (the load matters: the CPUs are shared)."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15": [round(x, 2) for x in load] if load else None}


def run_parts(parts: dict[str, Any], names: list[str], args: Any) -> int:
    """Run the evidence script's parts ``names`` in order (each ``parts[name](args)``) with
    torch on ``args.threads`` threads, logging each part's seconds; 0 (the exit status)."""
    import torch

    torch.set_num_threads(args.threads)
    for name in names:
        t0 = time.perf_counter()
        parts[name](args)
        log(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    return 0


@contextlib.contextmanager
def page_server(code: str, *, timeout: float = 300, quiet: bool = False) -> Iterator[str]:
    """Run ``code`` in a child Python (from the repository root) with ``PORT`` set to a free
    port; it must serve its pages on 127.0.0.1:PORT. Yields the base URL once the port
    answers; stops the child afterwards. ``quiet`` drops the child's output."""
    port = unused_port()
    argv = [sys.executable, "-c", f"PORT = {port}\n{code}"]
    with child_server(argv, port, cwd=ROOT, timeout=timeout, poll=0.5, quiet=quiet):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def browser_on_pages(pages: dict[str, Callable[[], Any]]) -> Iterator[tuple[str, Any]]:
    """Serve ``pages`` (slug -> page factory) in this process on 127.0.0.1, threaded, with
    the explorer theme, and launch headless Chromium. Yields the base URL and the browser;
    closes the browser and stops the server afterwards."""
    import panel as pn
    from playwright.sync_api import sync_playwright

    from apps import theme

    theme.enable_extension()
    port = unused_port()
    srv = pn.serve(pages, port=port, address="127.0.0.1", threaded=True, show=False,
                   websocket_origin=[f"127.0.0.1:{port}"])
    time.sleep(2)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                yield f"http://127.0.0.1:{port}", browser
            finally:
                browser.close()
    finally:
        srv.stop()
