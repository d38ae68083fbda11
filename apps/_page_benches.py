"""Page benches: the harnesses that time a page (or export its plots) by driving its view
in-process, as a served session holds it.

They live in apps/, not in the bench layer (`explorer.bench`, `explorer.benches`), because
they build the pages' views and attach them to a Bokeh ``Document``: they import the pages
and Panel, which the import contracts forbid the bench and command layers. No page imports
this module; the command layer loads it with ``importlib`` (`explorer.commands.pages`), so
the measured pages and their harnesses form no import cycle (a contract checks apps/ for
cycles). The bench layer turns what these return into figures and ratios.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import panel as pn
import param
import xarray as xr

import explorer
from apps._lens_heatmap import is_preview
from apps._lens_tables import contrast_prompts
from apps._saturation_corpus import _WEIGHTS
from apps.circuits import CircuitsView, size_grid
from apps.lens import LensView
from apps.saturation import SaturationView
from explorer._checks import InputError, check_choice
from explorer.analyses import circuits as ca
from explorer.defaults import DEFAULT_MODEL

__all__ = ["slider_preview_times", "slider_redraw_times", "click_latency", "export_figures"]


# -- the logit lens page -------------------------------------------------------------------

def slider_preview_times(model: explorer.Model, prompt: str, *, steer_layer: int,
                         vector: np.ndarray | None = None, alphas: Any = None,
                         start_alpha: float = 4.0) -> dict[str, Any]:
    """Server-side time of the steering slider's preview while it moves (`explorer bench
    slider`): the page attached to a Bokeh Document (as in a served session), jobs inline,
    released once at ``start_alpha`` (its exact run fills the clean layers' readouts, as
    the first release does), then dragged through ``alphas``; each move is timed from the
    widget's value change until the heatmap's data are replaced (the preview's lens and
    the in-place redraw). ``vector`` replaces the contrast prompts' steering vector.
    Checks that every move drew a preview in place (no new plot) and returns the moves'
    wall and thread-CPU seconds and the previews, with the exact results after release.
    """
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    alphas = list(np.linspace(start_alpha + 0.25, start_alpha + 4.0, 16) if alphas is None
                  else alphas)
    view = LensView(model, prompt=prompt, steer_layer=steer_layer, background=False)
    if vector is not None:
        key = (tuple(contrast_prompts(view.contrast_a)), tuple(contrast_prompts(view.contrast_b)),
               steer_layer)
        view.cache_put("steering vectors", key, np.asarray(vector, dtype=np.float32), limit=16)
    doc = Document()
    wall, cpu, previews = [], [], []
    try:
        with set_curdoc(doc):
            doc.add_root(pn.panel(view).get_root(doc))
            slider = view.alpha_slider()
            with param.parameterized.edit_constant(slider):
                slider.param.update(value=start_alpha, value_throttled=start_alpha)
            version = view.plot_version
            for a in alphas:
                t0, c0 = time.perf_counter(), time.thread_time()
                slider.value = float(a)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                if not is_preview(view.preview) or view.plot_version != version:
                    raise RuntimeError(f"slider move to {a} drew no preview in place")
                previews.append(view.preview)
            with param.parameterized.edit_constant(slider):
                slider.value_throttled = float(alphas[-1])
            exact = view.result
    finally:
        view.close()
    return {"wall": wall, "cpu": cpu, "previews": previews, "alphas": alphas, "exact": exact}


# -- the circuits page ----------------------------------------------------------------------


def slider_redraw_times(model: explorer.Model, task: ca.CircuitTask, scores: xr.Dataset,
                        moves: int = 20) -> dict[str, float]:
    """Server-side time of a slider move on the Circuits page (`explorer bench eap`).

    The page is attached to a Bokeh Document (as in a served session, with the document as
    ``pn.state.curdoc``) and given ``scores``; its faithfulness curve is stood in by the
    pruned sizes of the slider's positions (no patching: only drawing is timed). Each move
    sets the slider to a position not visited before (no cached circuit), in a fixed
    shuffled order, and is timed from the widget's value change until every pane has been
    updated: re-pruning (`select_circuit`), the edge table, the graph's data source and the
    faithfulness marker's Bokeh updates.
    Checks that the drawn segments equal the page's circuit after each move.
    """
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    n = int(scores.sizes["edge"])
    sizes = [0, *size_grid(n).tolist()]
    kept = [int(ca.select_circuit(scores, top_n=k).sum()) for k in sizes]
    curve = xr.Dataset({"recovered": ("n_edges", np.array(kept) / n),
                        "n_kept": ("n_edges", np.array(kept))}, coords={"n_edges": sizes})
    view = CircuitsView(model, background=False, autostart=False)
    doc = Document()
    with set_curdoc(doc):
        doc.add_root(pn.panel(view).get_root(doc))
        view._got_scores((view._key(), task, scores, curve))
        options = list(view._slider.options.values())
        start = options.index(view._slider.value)
        order = [i for i in np.random.default_rng(0).permutation(len(options)) if i != start]
        wall, cpu = [], []
        for i in order[:moves]:
            t0, c0 = time.perf_counter(), time.thread_time()
            view._slider.value = options[i]
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            drawn = [len(r.data_source.data["x0"]) for r in doc.select({"name": "edges"})]
            if drawn != [view._shown["drawn"]] or view.n_edges != options[i]:
                raise RuntimeError(f"slider move to {options[i]} drew {drawn} segments, "
                                   f"expected {view._shown['drawn']}")
    return {"slider_redraw_ms": float(np.median(wall)) * 1e3,
            "slider_redraw_cpu_ms": float(np.median(cpu)) * 1e3,
            "slider_redraw_max_cpu_ms": float(np.max(cpu)) * 1e3,
            "slider_moves": len(cpu)}


# -- the saturation page -------------------------------------------------------------------


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
