"""Evidence for docs/editing.md: representation shattering on the synthetic knowledge graph.

Parts (each writes its numbers into ``docs/figures/shattering_summary.json``):

``train``    Train the knowledge-graph transformer with `DEFAULTS` (Nishi et al., ICML 2025,
             scaled to CPU), save it in the cache (the model ``explorer shattering train`` makes
             and the page shows): wall time, final loss, accuracy by split, and how ring-like
             each cycle is in the entity representations (mean distance between cycle
             neighbours over the mean pairwise distance, in the full space and in the PCA
             plane; 1 = no ring structure).
``sweep``    Many single counterfactual edits (distances 1-4, equal numbers) with ROME, with
             MEMIT (critical block 1, spread over blocks 0 and 1), with MEMIT on block 0
             alone and with fine-tuning of ROME's MLP: R against the accuracy drop on the
             other facts (least-squares line and r²), mean R and accuracy drop by distance,
             and the Spearman correlation of R with distance (scipy).
             ``--method`` runs only some; the others' numbers in the summary are kept.
             ``seconds`` includes reading a sweep already in the store (then near 0).
``search``   The training search behind the defaults (docs/editing.md, "Training a model that
             infers"): each setting trained with its planned cosine schedule and stopped at
             the step recorded for it, then scored by split; written to ``training_search``.
             The default setting's own row is the ``train`` part. About 25,000 steps in all
             (15-30 min of one CPU thread); ``--search-scale 0.01`` runs a 1 % smoke version
             (planned and stop steps scaled) without writing the summary.
``figures``  PNGs (rendered by chromium): the entity embedding before/after one edit (PCA and
             Isomap), the R vs accuracy-drop scatters, R by distance, and the page.

Usage::

    python benchmarks/shattering_evidence.py              # all parts, about 5-10 minutes here
    python benchmarks/shattering_evidence.py --part sweep --n-edits 40
    python benchmarks/shattering_evidence.py --part sweep --method memit
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import _figures  # benchmarks/_figures.py, beside this script
from _figures import browser_on_pages, log, machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "shattering_summary.json"
METHODS = ("rome", "memit", "finetune")
#: Sweep options per method beyond the defaults (block 0): MEMIT's last critical block is the
#: last block, so it spreads each edit over both MLPs (blocks 0 and 1).
METHOD_OPTIONS: dict[str, dict[str, Any]] = {"memit": {"layer": 1}}
#: Sweeps by name: (method, options). ``memit_block0`` is MEMIT on block 0 alone (ROME's MLP
#: and key), to separate the least-squares update from the spreading over blocks.
SWEEPS: dict[str, tuple[str, dict[str, Any]]] = {
    "rome": ("rome", {}), "memit": ("memit", METHOD_OPTIONS["memit"]),
    "memit_block0": ("memit", {"layer": 0}), "finetune": ("finetune", {})}
EXAMPLE = {"entity": 5, "relation": "B+1", "distance": 4}
EXAMPLE_ORDER = 1  # the cycle drawn (B, the edited relation's)


def write_summary(part: str, data: dict[str, Any]) -> None:
    _figures.update_summary(SUMMARY, part, data)


def ring_ratios(km) -> dict[str, list[float]]:
    """Per cycle: mean distance between cycle neighbours / mean distance between all entities,
    in the full representation space and in the plane of the first two principal components."""
    import numpy as np

    from explorer.analyses import shattering as sh

    reps = sh.entity_representations(km.model, km.graph.n_entities).double().numpy()
    centred = reps - reps.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    out: dict[str, list[float]] = {}
    for name, x in (("full", reps), ("pca_plane", centred @ vt[:2].T)):
        d = sh.distance_matrix(x)
        mean_all = d[np.triu_indices_from(d, 1)].mean()
        out[name] = [round(float(d[ring, np.roll(ring, -1)].mean() / mean_all), 3)
                     for ring in km.graph.orders]
    return out


def part_train(args: argparse.Namespace) -> None:
    from explorer.analyses import shattering as sh

    start = machine()
    km = sh.knowledge_model(retrain=args.retrain, progress=None, seed=args.seed)
    acc = sh.fact_accuracy(km)["accuracy"]
    n = km.graph.n_entities
    out = {"params": km.params, "train_seconds": km.train_seconds,
           "final_loss": km.history["loss"][-1],
           "accuracy": dict(zip(acc["split"].values.tolist(), map(float, acc.values))),
           "chance": 1 / n,
           "n_facts": {s: int((km.graph.split == s).sum()) for s in sh.SPLITS},
           "ring_neighbour_ratio": ring_ratios(km),
           "machine_start": start, "machine_end": machine()}
    log(f"train: {km.train_seconds:.0f} s, accuracy {out['accuracy']}")
    write_summary("train", out)


def part_sweep(args: argparse.Namespace) -> None:
    from explorer.analyses import shattering as sh

    km = sh.knowledge_model(seed=args.seed)
    old = json.loads(SUMMARY.read_text()).get("sweep", {}) if SUMMARY.exists() else {}
    out = dict(old)
    for name in args.method or list(SWEEPS):
        method, options = SWEEPS[name]
        t0 = time.perf_counter()
        sweep = sh.stored_edit_sweep(km, n_edits=args.n_edits, method=method, **options)
        from scipy.stats import spearmanr

        rho, pval = spearmanr(sweep["distance"].values, sweep["R"].values)
        out[name] = {**sh.sweep_summary(sweep), "seconds": round(time.perf_counter() - t0, 1),
                     "spearman_R_distance": {"rho": float(rho), "p": float(pval)},
                     "R_se_by_distance": {str(d): float(sweep["R"].values[sweep["distance"].values == d].std()
                                                        / max(1, (sweep["distance"].values == d).sum()) ** 0.5)
                                          for d in sorted(set(sweep["distance"].values.tolist()))},
                     "machine": machine()}
        log(f"sweep {name}: r2 {out[name]['r2']:.3f}, R by distance {out[name]['R_by_distance']}")
    if not args.method:
        out["machine"] = machine()
    write_summary("sweep", out)


#: The settings tried before the defaults (3 orders and 64 entities unless given), with the
#: planned schedule length and the step each was stopped at.
SEARCH_RUNS: list[dict[str, Any]] = [
    {"weight_decay": 1.0, "lr": 1e-3, "batch_size": 128, "planned_steps": 4000, "stop": 2250},
    {"weight_decay": 1.0, "lr": 3e-3, "batch_size": 128, "planned_steps": 4000, "stop": 2250},
    {"weight_decay": 1.0, "lr": 1e-3, "batch_size": 64, "planned_steps": 6000, "stop": 2500},
    {"weight_decay": 1.0, "lr": 3e-3, "batch_size": 128, "planned_steps": 12000, "stop": 1500,
     "n_entities": 32},
    {"weight_decay": 3.0, "lr": 1e-3, "batch_size": 128, "planned_steps": 15000, "stop": 3500},
    {"weight_decay": 2.0, "lr": 2e-3, "batch_size": 64, "planned_steps": 25000, "stop": 13500},
]


def part_search(args: argparse.Namespace) -> None:
    from explorer.analyses import shattering as sh

    scale = float(args.search_scale)
    start, runs = machine(), []
    for setting in SEARCH_RUNS:
        planned = max(10, int(setting["planned_steps"] * scale))
        stop = max(10, int(setting["stop"] * scale))
        params = {"weight_decay": setting["weight_decay"], "lr": setting["lr"],
                  "batch_size": setting["batch_size"], "steps": planned, "n_orders": 3,
                  "n_entities": setting.get("n_entities", 64), "seed": args.seed}
        log(f"search: {params}, stopped at step {stop}")
        km = sh.train_knowledge_model(progress=lambda done, total: done < stop, **params)
        acc = sh.fact_accuracy(km)["accuracy"]
        runs.append({**{k: v for k, v in params.items() if k != "steps"},
                     "planned_steps": planned, "stopped_at_step": int(km.history["step"][-1]),
                     "accuracy_direct_logical_compositional": [
                         round(float(acc.sel(split=s)), 3) for s in sh.SPLITS],
                     "train_seconds": round(km.train_seconds, 1)})
        log(f"  {runs[-1]}")
    if scale != 1.0:
        log("search: a scaled smoke run; the summary is left as it was")
        return
    write_summary("training_search", {
        "note": "Each setting trained with its planned cosine schedule, stopped at the step "
                "given; other settings as DEFAULTS. Accuracy at the stop step. The default "
                "setting (12,000 steps) is the train part.",
        "runs": runs, "machine_start": start, "machine_end": machine()})


def render_png(obj: Any, path: Path, *, width: int = 1100, height: int = 500) -> None:
    """Render a HoloViews object to PNG (see benchmarks/_figures.py)."""
    _figures.render_png(obj, path, width=width, height=height)
    log(f"  wrote {path.relative_to(ROOT)}")


def part_figures(args: argparse.Namespace) -> None:
    import holoviews as hv
    import numpy as np

    from apps.shattering import plot_embedding, plot_shattering_scatter
    from explorer.analyses import shattering as sh

    km = sh.knowledge_model(seed=args.seed)
    rel = km.graph.relation_index(EXAMPLE["relation"])
    panels = []
    edits = {method: sh.edit_fact(km, EXAMPLE["entity"], rel, EXAMPLE["distance"], method=method,
                                  **METHOD_OPTIONS.get(method, {})) for method in METHODS}
    for projection in ("pca", "isomap"):
        for method in METHODS:
            emb = sh.edit_embedding(km, edits[method], [0.0, 1.0], projection=projection)
            panels.append(_figures.fixed(plot_embedding(emb, order=EXAMPLE_ORDER), 560, 460))
    cols = len(METHODS)
    render_png(hv.Layout(panels).cols(cols).opts(shared_axes=False), FIGURES / "shattering_embedding.png",
               width=570 * cols, height=470 * 2)
    scatters, bars = [], []
    for method in METHODS:
        sweep = sh.stored_edit_sweep(km, n_edits=args.n_edits, method=method, **METHOD_OPTIONS.get(method, {}))
        scatters.append(_figures.fixed(plot_shattering_scatter(sweep), 560, 380))
        d = sweep["distance"].values
        R = sweep["R"].values
        rows = [(str(k), float(R[d == k].mean())) for k in sorted(set(d.tolist()))]
        err = [(i + 1, float(R[d == k].mean()), float(R[d == k].std() / np.sqrt((d == k).sum())))
               for i, k in enumerate(sorted(set(d.tolist())))]
        bars.append(_figures.fixed((hv.Bars(rows, "counterfactual distance", "mean R").opts(color="#1f77b4")
                            * hv.ErrorBars([(str(k), m, e) for (_, m, e), k in zip(err, sorted(set(d.tolist())))],
                                           "counterfactual distance", ["mean R", "err"]))
                           .opts(title=f"{method}: mean R by distance (± s.e.)"), 360, 300))
    render_png(hv.Layout(scatters).cols(cols).opts(shared_axes=False), FIGURES / "shattering_scatter.png",
               width=570 * cols, height=390)
    render_png(hv.Layout(bars).cols(cols).opts(shared_axes=False), FIGURES / "shattering_distance.png",
               width=370 * cols, height=310)
    page_screenshot(km, args)


def page_screenshot(km, args) -> None:
    from apps import theme
    from apps.shattering import ShatteringView
    from explorer.analyses import shattering as sh

    sweep = sh.stored_edit_sweep(km, n_edits=args.n_edits, method="rome")

    def page_factory():
        view = ShatteringView(km=km, sweep=sweep, entity=f"e{EXAMPLE['entity']}",
                              relation=EXAMPLE["relation"], distance=EXAMPLE["distance"],
                              order=EXAMPLE_ORDER)
        return theme.page([view], title="Explorer: representation shattering")

    with browser_on_pages({"shattering": page_factory}) as (url, browser):
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(f"{url}/shattering", timeout=120_000)
        page.wait_for_selector(".shattering-scatter canvas", state="attached", timeout=300_000)
        page.wait_for_selector(".shattering-embedding canvas", state="attached", timeout=300_000)
        page.wait_for_timeout(8000)
        page.screenshot(path=str(FIGURES / "shattering_page.png"), full_page=True)
        log("  wrote docs/figures/shattering_page.png")

PARTS = {"train": part_train, "sweep": part_sweep, "search": part_search,
         "figures": part_figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", action="append", choices=list(PARTS), help="part to run (repeatable)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default: 0)")
    p.add_argument("--n-edits", type=int, default=80, help="edits per method in the sweep (default: 80)")
    p.add_argument("--method", action="append", choices=list(SWEEPS),
                   help="sweep: edit method (repeatable; default: all)")
    p.add_argument("--retrain", action="store_true", help="train again even if the model is stored")
    p.add_argument("--search-scale", type=float, default=1.0,
                   help="search: fraction of every run's steps (default 1; below 1 a smoke run)")
    args = p.parse_args(argv)
    return _figures.run_parts(PARTS, args.part or list(PARTS), args)


if __name__ == "__main__":
    sys.exit(main())
