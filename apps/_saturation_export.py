"""Measuring and exporting the saturation page: the click latency through the page's own
update path, and screenshots of its plots for the paper's figures."""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TYPE_CHECKING

import numpy as np
import panel as pn

import explorer
from apps._saturation_corpus import _WEIGHTS
from explorer._checks import InputError, check_choice
from explorer.defaults import DEFAULT_MODEL

__all__ = ["click_latency", "export_figures"]


if TYPE_CHECKING:   # the page imports this module to re-export it
    from apps.saturation import SaturationView


def click_latency(view: SaturationView, positions: Sequence[int], *, k: int | None = None,
                  text: int = 0) -> dict[str, list[float]]:
    """Seconds per token click through the page's own update path, wall and process CPU.

    The view's page is attached to a new Bokeh ``Document`` (as a served session holds it)
    and each position is clicked as the token strip does it in the browser: the strip's
    ``selected`` changes, the view updates the header and the detail plots' data. Times
    stop when the Python side has applied every change to the document (sending the
    change to a browser and drawing it are not included).
    """
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    if view.result is None:
        raise InputError("the view has no result yet: nothing to click")
    doc = Document()
    layout = view.__panel__()
    wall, cpu = [], []
    with set_curdoc(doc):
        root = layout.get_root(doc)
        doc.add_root(root)
        try:
            view.param.update(text=text, **({} if k is None else {"k": k}))
            strip = view._strip_widget
            for pos in positions:
                w0, c0 = time.perf_counter(), time.process_time()
                if strip is not None:
                    strip.selected = int(pos)
                else:
                    view.selected = int(pos)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        finally:
            layout._cleanup(root)
            doc.clear()
    return {"wall": wall, "cpu": cpu}


def export_figures(folder: str | Path, *, max_tokens: int | None = None,
                   random_tokens: int | None = None, seed: int = 0,
                   model: str = DEFAULT_MODEL,
                   analysis_options: dict[str, Any] | None = None,
                   weights: Sequence[str] = _WEIGHTS) -> list[Path]:
    """Screenshots of the page's plots for SmolLM2 (trained and random-init) from the store.

    Serves the view on a free local port, drives headless chromium with Playwright, clicks
    a token, and saves ``saturation_{trained,random}_{plot}.png`` files. ``max_tokens`` and
    ``random_tokens`` (default: the whole corpus) must match the analysed runs so the
    results are read from the activation store (run ``benchmarks/saturation_evidence.py``),
    and so must ``analysis_options`` (e.g. ``{"unembed_dtype": "bfloat16"}``).
    """
    import socket

    from playwright.sync_api import sync_playwright

    from apps.saturation import SaturationView

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = explorer.load_model(model)
    saved = []
    for weights in [check_choice("weights", w, list(_WEIGHTS)) for w in weights]:
        n_tokens = (max_tokens if weights == "trained" else random_tokens) or 50_000
        view = SaturationView(base, background=False, weights=weights, n_tokens=n_tokens,
                              analysis_options={**(analysis_options or {}), "seed": seed})
        if view.result is None:
            raise InputError(f"no {weights} result: {view.error}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = pn.serve(view.page, port=port, address="127.0.0.1", show=False, threaded=True)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                            args=["--no-sandbox", "--disable-gpu", "--disable-quic",
                                                  "--disable-background-networking",
                                                  "--disable-component-update", "--disable-sync"])
                page = browser.new_page(viewport={"width": 1600, "height": 1200})
                page.goto(f"http://127.0.0.1:{port}/", timeout=120_000)
                page.locator(".sat-tau-hist canvas").first.wait_for(state="attached", timeout=120_000)
                # click the first text's token with the longest run of ranks saturating in time
                one = view.result.isel(prompt=0)
                n = int(one.mask.values.sum())
                s5 = one.sat_layer.values[:n, :5]
                early = (s5 >= 0) & (s5 < view.result.sizes["layer"] - 1)
                run = np.cumprod(early, axis=1).sum(1) * one.kept.values[:n]
                page.locator(f".sat-token[data-pos='{int(run.argmax())}']").click()
                page.locator(".sat-rank-table canvas").first.wait_for(state="attached", timeout=60_000)
                page.locator(".sat-intervention canvas").first.wait_for(state="attached", timeout=120_000)
                time.sleep(2)
                tag = "trained" if weights == "trained" else "random"
                for cls, name in ((".sat-strip", "strip"), (".sat-rank-table", "rank_table"),
                                  (".sat-staircase", "staircase"), (".sat-tau-hist", "tau"),
                                  (".sat-probe", "probe"), (".sat-pareto", "pareto"),
                                  (".sat-intervention", "intervention")):
                    path = folder / f"saturation_{tag}_{name}.png"
                    page.locator(cls).first.screenshot(path=str(path))
                    saved.append(path)
                browser.close()
        finally:
            server.stop()
    return saved
