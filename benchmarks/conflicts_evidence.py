"""Knowledge-conflicts evidence on SmolLM2 (JuICE, Li et al. ICML 2025); rerunnable.

Steps: closed-book filter over the shipped facts (cached per model) -> superposition
scores (direct effects, every head) -> JuICE head selection over all layers, parametric
and context direction, on the first ``--select-facts`` kept capital facts -> alpha search
on the next ``--val-facts`` kept facts (the paper's grids; JuICE and the single run each
get their own best alphas) -> greedy accuracy toward memory and toward context for
baseline / single run / JuICE on the remaining kept facts -> figures.

Writes ``docs/figures/conflicts_summary_<directions>.json``, ``conflicts_scatter.png`` (superposition
scatter), ``conflicts_delta.png`` (Delta+ per prompt type) and, with ``--page``,
``conflicts_page.png`` (the page on SmolLM2 with the chosen heads).

    nice -n 10 .venv/bin/python benchmarks/conflicts_evidence.py [--select-facts 4] [--page]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import torch

import _figures  # benchmarks/_figures.py, beside this script
from explorer.commands._common import add_number_options
from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ticker(label: str, every: int):
    def progress(done, total):
        if done == total or done % every == 0:
            log(f"  {label}: {done}/{total}")
    return progress


def page_screenshot(plus, minus, alpha_l, alpha_s, example: str, path: Path) -> None:
    """Serve the page on SmolLM2 with the chosen heads and photograph it."""
    from playwright.sync_api import sync_playwright

    code = textwrap.dedent(f"""
        import panel as pn, torch
        torch.set_num_threads(1)
        from apps import theme
        from apps.conflicts import ConflictsView
        from explorer import load_model
        model = load_model(DEFAULT_MODEL)
        theme.enable_extension()
        def app():
            v = ConflictsView(model, example={example!r}, heads_plus={plus!r},
                              heads_minus={minus!r}, alpha_l={alpha_l}, alpha_s={alpha_s})
            return theme.page([v], title="Knowledge conflicts (JuICE)")
        pn.serve({{"conflicts": app}}, port=PORT, address="127.0.0.1", threaded=True,
                 show=False).join()
    """)
    with _figures.page_server(code, quiet=True) as url, sync_playwright() as p:
        b = p.chromium.launch(executable_path=_figures.CHROMIUM, headless=True,
                              args=_figures.CHROMIUM_ARGS)
        page = b.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"{url}/conflicts", timeout=120_000)
        state = page.locator(".cf-state").first
        state.wait_for(state="attached", timeout=300_000)
        deadline = time.time() + 300
        while page.locator(".cf-state").first.get_attribute("data-cf-after") == "none":
            if time.time() > deadline:
                raise RuntimeError("the bars did not appear")
            time.sleep(0.5)
        time.sleep(3)
        page.screenshot(path=str(path), full_page=True)
        b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_number_options(ap, select_facts=4, val_facts=4, eval_facts=16, k=5, n_new=3)
    ap.add_argument("--directions", default="parametric,context")
    ap.add_argument("--page", action="store_true", help="also photograph the page")
    ap.add_argument("--no-scatter", action="store_true", help="skip the superposition scatter")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    import holoviews as hv
    import numpy as np

    from apps.conflicts import head_name, plot_head_scatter
    from explorer import load_model
    from explorer.analyses import conflicts as C

    hv.extension("bokeh", logo=False)
    FIGURES.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    load = os.getloadavg()
    model = load_model(DEFAULT_MODEL)
    kept = C.closed_book_facts(model, progress=ticker("closed book", 16))
    log(f"closed book: {len(kept)} of {len(C.load_facts())} facts kept")
    caps = [f for f in kept if f.relation == "country_capital"]
    sel_facts = caps[:args.select_facts]
    rest = [f for f in kept if f not in sel_facts]
    val = rest[:args.val_facts]
    evaluation = rest[args.val_facts:args.val_facts + args.eval_facts]
    summary = {"model": model.spec.name, "n_closed_book": len(kept),
               "n_facts": len(C.load_facts()),
               "select_subjects": [f.subject for f in sel_facts],
               "val_subjects": [f"{f.relation}:{f.subject}" for f in val],
               "eval_subjects": [f"{f.relation}:{f.subject}" for f in evaluation],
               "n_new": args.n_new, "k": args.k, "load_avg_start": load, "directions": {}}

    out_json = FIGURES / f"conflicts_summary_{args.directions.replace(',', '_')}.json"
    # superposition: direct effects of every head over 8 kept facts x 3 prompt types
    t = time.time()
    scores = C.head_context_memory_scores(model, kept[:8], ablation=False)
    both = np.minimum(scores.memory_score.values, scores.context_score.values)
    top = np.argsort(-both, axis=None)[:6]
    H = model.spec.n_heads
    summary["superposition"] = [
        {"head": head_name(*divmod(int(i), H)),
         "memory_score": float(scores.memory_score.values.flat[i]),
         "context_score": float(scores.context_score.values.flat[i])} for i in top]
    summary["superposition_s"] = time.time() - t
    log(f"superposition heads: {summary['superposition'][:3]}")
    if not args.no_scatter:
        ringed = [d["head"] for d in summary["superposition"][:3]]
        scatter = plot_head_scatter(scores, ringed).opts(
            width=760, height=460, responsive=False,
            title="SmolLM2: context vs memory score per head; top-3 superposition ringed")
        _figures.render_png(scatter, FIGURES / "conflicts_scatter.png", width=900, height=520,
                            settle_ms=2000)

    for direction in args.directions.split(","):
        out: dict = {}
        t = time.time()
        sel = C.juice_head_selection(model, sel_facts, direction=direction, k=args.k,
                                     prune=True, progress=ticker(f"selection {direction}", 27))
        plus, minus = C.selected_heads(sel)
        out["selection_s"] = time.time() - t
        out["heads_plus"] = [head_name(*h) for h in plus]
        out["heads_minus"] = [head_name(*h) for h in minus]
        out["n_consistent_plus"] = int(sel.consistent_plus.sum())
        out["n_consistent_minus"] = int(sel.consistent_minus.sum())
        out["n_scored"] = {k: int(np.isfinite(sel.delta_plus.sel(kind=k)).sum())
                           for k in C.PROMPT_KINDS}
        log(f"{direction}: S+ {out['heads_plus']} S- {out['heads_minus']} "
            f"({out['selection_s']:.0f} s)")
        if direction == "parametric":
            d = sel.delta_plus
            lim = float(np.nanmax(abs(d.values))) or 1.0
            maps = [hv.HeatMap([(int(h), int(x), float(d.sel(kind=k, layer=x, head=h)))
                                for x in d.layer.values for h in d["head"].values],
                               ["head", "layer"], "delta_plus").opts(
                cmap="coolwarm", clim=(-lim, lim), width=300, height=420, title=f"Δ⁺ {k}",
                colorbar=k == "coherent") for k in C.PROMPT_KINDS]
            _figures.render_png(hv.Layout(maps).cols(3), FIGURES / "conflicts_delta.png",
                                width=1050, height=470, settle_ms=2000)
        if not plus + minus:
            log(f"{direction}: no consistent head; skipping alphas and accuracy")
            summary["directions"][direction] = out
            continue
        grids = {"parametric": ((0.0, 1.0, 2.0, 3.0), (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)),
                 "context": ((0.0, 1.0, 2.0, 3.0, 4.0, 5.0), (0.0, 1.0, 2.0, 3.0, 4.0, 5.0))}
        alphas = {}
        t = time.time()
        for method in ("juice", "single"):
            s = C.juice_alpha_search(model, val, plus, minus, direction=direction,
                                     alpha_s_grid=grids[direction][0],
                                     alpha_l_grid=grids[direction][1], method=method)
            alphas[method] = (s.attrs["best_alpha_s"], s.attrs["best_alpha_l"])
            out[f"alpha_search_{method}"] = {
                "best_alpha_s": s.attrs["best_alpha_s"], "best_alpha_l": s.attrs["best_alpha_l"],
                "best_accuracy": float(s.accuracy.max()),
                "accuracy_at_0_0": float(s.accuracy.sel(alpha_s=0.0, alpha_l=0.0))}
        out["alpha_search_s"] = time.time() - t
        log(f"{direction}: alphas {alphas}")
        t = time.time()
        table = {}
        for method in ("baseline", "single", "juice"):
            a_s, a_l = alphas.get(method, (0.0, 0.0))
            acc = C.conflict_accuracy(model, evaluation, plus, minus, alpha_l=a_l, alpha_s=a_s,
                                      methods=[method], n_new=args.n_new,
                                      progress=ticker(f"accuracy {method}", 8))
            table[method] = {
                "alpha_s": a_s, "alpha_l": a_l,
                **{f"memory_{k}": float(acc.memory_accuracy.sel(intervention=method, kind=k))
                   for k in acc.kind.values.tolist()},
                **{f"context_{k}": float(acc.context_accuracy.sel(intervention=method, kind=k))
                   for k in acc.kind.values.tolist()}}
        out["accuracy"] = table
        out["accuracy_s"] = time.time() - t
        log(f"{direction}: accuracy {json.dumps(table)}")
        summary["directions"][direction] = out
        out_json.write_text(json.dumps(summary, indent=1))

    summary["total_s"] = time.time() - t_start
    summary["load_avg_end"] = os.getloadavg()
    out_json.write_text(json.dumps(summary, indent=1))
    log(f"done in {summary['total_s']:.0f} s")
    if args.page:
        par = summary["directions"].get("parametric", {})
        fr = next(f for f in evaluation if f.relation == "country_capital")
        from apps.conflicts import _label
        j = par.get("accuracy", {}).get("juice", {"alpha_s": 1.0, "alpha_l": 1.0})
        page_screenshot(par.get("heads_plus", []), par.get("heads_minus", []), j["alpha_l"],
                        j["alpha_s"], _label(fr), FIGURES / "conflicts_page.png")
        log("page screenshot written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
