"""Evidence for docs/dynamics.md: task-vector emergence and the parity phase diagram.

Parts (each writes its numbers into ``docs/figures/task_emergence_summary.json``):

``emergence``  The small transformer on the sparse-regression task mixture (Han et al., ICML
               2025) with the default settings, trained from scratch for each of ``--seeds``
               and stored in the activation store (seed 0 is the run ``explorer
               task-emergence train`` re-trains and the page shows): wall and CPU time, task
               decodability per layer and ICL loss per task at every checkpoint, the steps
               (and CPU seconds) at which each rises, their correlation, and the step from
               which the loss stays below the task-agnostic reference. Seed 0's analysis is
               written to ``datasets/dynamics/task_emergence_seed0_analysis.safetensors``,
               which the page shows when the store holds no run.
``phase``      The streaming-parity phase diagram (van Rossem & Saxe, ICML 2025) over the
               default reduced grid of initialisation gain x longest training string, stored
               (the one ``explorer parity phase`` computes and the parity page shows).
``figures``    PNGs of both (rendered by chromium) and a screenshot of the page.

Usage::

    python benchmarks/task_emergence_evidence.py --part emergence --part phase --part figures
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _figures  # noqa: E402  (benchmarks/_figures.py)
from dynamics_evidence import FIGURES, log, machine, render_png  # noqa: E402

SUMMARY = FIGURES / "task_emergence_summary.json"


def _settled_below(values, level, steps):
    """First step from which ``values`` stays below ``level`` (None if it does not end below)."""
    below = [bool(v < level) for v in values]
    for i in range(len(below)):
        if all(below[i:]):
            return int(steps[i])
    return None


def part_emergence(args: argparse.Namespace) -> None:
    import numpy as np

    from explorer.analyses.task_emergence import (DEFAULTS, SHIPPED_ANALYSIS, emergence_summary,
                                                  save_analysis_safetensors, stored_task_emergence_analysis,
                                                  task_emergence_run)

    out: dict[str, Any] = {"params": dict(DEFAULTS), "machine_before": machine(), "seeds": {}}
    for seed in args.seeds:
        log(f"emergence: seed {seed} ({DEFAULTS['steps']} steps)")
        t0 = time.perf_counter()
        run = task_emergence_run(retrain=not args.reuse, seed=seed)
        res: dict[str, Any] = {"train_wall_seconds_measured_here": round(time.perf_counter() - t0, 1),
                               "train_seconds": run.attrs["train_seconds"],
                               "train_cpu_seconds": run.attrs.get("train_cpu_seconds")}
        log(f"  trained in {run.attrs['train_seconds']:.0f} s (CPU {run.attrs.get('train_cpu_seconds')} s); analysing")
        t0 = time.perf_counter()
        analysis = stored_task_emergence_analysis(run)
        res["analysis_seconds"] = round(time.perf_counter() - t0, 1)
        res.update({k: analysis.attrs[k] for k in emergence_summary(analysis)})
        steps = analysis["step"].values
        loss = analysis["icl_loss_mean"].values
        res["td_by_step_best_layer"] = [round(float(v), 3) for v in analysis["td"].values[:, res["best_layer"]]]
        res["td_by_step_per_layer"] = [[round(float(v), 3) for v in row] for row in analysis["td"].values]
        res["icl_loss_mean_by_step"] = [round(float(v), 4) for v in loss]
        res["steps"] = [int(s) for s in steps]
        res["below_agnostic_step"] = _settled_below(loss, float(analysis["agnostic_loss"].mean()), steps)
        res["below_task_mean_step"] = _settled_below(loss, float(analysis["task_mean_loss"].mean()), steps)
        if "cpu_seconds" in analysis.coords:
            cpu = dict(zip(steps.tolist(), analysis["cpu_seconds"].values.tolist()))
            for key in ("td_rise_step_50", "td_rise_step_90", "icl_rise_step_50", "icl_rise_step_90",
                        "below_agnostic_step"):
                step = res.get(key)
                res[key.replace("_step", "_cpu_seconds")] = None if step is None else round(cpu[step], 1)
        out["seeds"][str(seed)] = res
        if seed == DEFAULTS["seed"]:   # the analysis the page shows before any run is trained
            path = save_analysis_safetensors(analysis, SHIPPED_ANALYSIS)
            res["shipped_analysis_bytes"] = path.stat().st_size
            log(f"  wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")
        log(f"  TD rises half-way at step {res['td_rise_step_50']}, ICL at {res['icl_rise_step_50']}; "
            f"correlation {res['td_icl_correlation']}; below task-agnostic from {res['below_agnostic_step']}; "
            f"final TD {res['final_td']}, loss {np.mean(res['final_icl_loss']):.3f}")
    _figures.update_timed_summary(SUMMARY, "emergence", out)


def part_phase(args: argparse.Namespace) -> None:
    from explorer.analyses.parity import phase_summary, stored_parity_phase_diagram

    log("phase: parity phase diagram on the default grid")
    done = time.perf_counter()

    def progress(cells: int, total: int) -> None:
        log(f"  cell {cells}/{total} ({time.perf_counter() - done:.0f} s)")

    out = {"machine_before": machine()}
    phase = stored_parity_phase_diagram(recompute=not args.reuse, progress=progress)
    out.update(phase_summary(phase))
    _figures.update_timed_summary(SUMMARY, "phase", out)
    log(f"  parity automaton per cell: {out['is_parity_automaton']}; {out['total_seconds']} s")


def part_figures(args: argparse.Namespace) -> None:
    import holoviews as hv

    from apps.parity import plot_phase_diagram
    from apps.task_emergence import plot_emergence_curves, plot_task_projection, plot_td_by_layer
    from explorer.analyses.parity import stored_parity_phase_diagram
    from explorer.analyses.task_emergence import stored_task_emergence_analysis, task_emergence_run

    run = task_emergence_run()
    analysis = stored_task_emergence_analysis(run)
    steps = analysis["step"].values
    best = int(analysis.attrs["best_layer"])
    curves = plot_emergence_curves(analysis, None)
    render_png(hv.Layout([c.opts(responsive=False, width=620, height=340) for c in curves]).cols(2),
               FIGURES / "dynamics_task_emergence.png", width=1300, height=380)
    picks = [int(steps[0]), int(analysis.attrs["td_rise_step_50"] or steps[len(steps) // 2]), int(steps[-1])]
    panels = [plot_task_projection(analysis, s, best).opts(responsive=False, width=400, height=340)
              for s in picks]
    panels += [plot_td_by_layer(analysis, s, best).opts(responsive=False, width=400, height=300) for s in picks]
    render_png(hv.Layout(panels).cols(3).opts(shared_axes=False),
               FIGURES / "dynamics_task_emergence_projection.png", width=1250, height=700)
    seed_curves(args)
    phase = stored_parity_phase_diagram(compute=False)
    if phase is not None:
        render_png(plot_phase_diagram(phase).opts(responsive=False, width=900, height=360),
                   FIGURES / "dynamics_parity_phase.png", width=960, height=400)
    page_screenshot(analysis)


def seed_curves(args: argparse.Namespace) -> None:
    """TD (best layer) and mean ICL loss over training for every stored seed, in one figure."""
    import holoviews as hv

    from explorer.analyses.task_emergence import DEFAULTS, stored_task_emergence_analysis
    from explorer.analyses.task_emergence import run_key_parts
    from explorer.store import ActivationStore

    store = ActivationStore()
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    tds, losses, refs = [], [], None
    for i, seed in enumerate(args.seeds):
        stored = store.get(store.key(run_key_parts({**DEFAULTS, "seed": seed})), verify=False)
        if stored is None:
            continue
        a = stored_task_emergence_analysis(stored.load(), store=store)
        best, steps, c = int(a.attrs["best_layer"]), a["step"].values, colours[i % len(colours)]
        tds.append(hv.Curve((steps, a["td"].values[:, best]), "training step", "TD (best layer)",
                            label=f"seed {seed} (layer {best})").opts(color=c, line_width=2))
        losses.append(hv.Curve((steps, a["icl_loss_mean"].values), "training step", "ICL loss (mean over tasks)",
                               label=f"seed {seed}").opts(color=c, line_width=2))
        refs = a
    if refs is None:
        return
    n_tasks = int(refs.sizes["task"])
    lines = [hv.HLine(float(refs[name].mean())).opts(color="grey", line_dash=dash, line_width=1)
             for name, dash in (("agnostic_loss", "dotdash"), ("task_mean_loss", "dashed"), ("oracle_loss", "dotted"))]
    left = hv.Overlay(tds + [hv.HLine(1 / n_tasks).opts(color="grey", line_dash="dashed", line_width=1)]).opts(
        ylim=(0, 1.05), legend_position="bottom_right", title="Task decodability (chance dashed)",
        responsive=False, width=620, height=340)
    low = min(float(refs["oracle_loss"].mean()), min(float(c.data.iloc[:, 1].min()) for c in losses)) / 1.5
    right = hv.Overlay(losses + lines).opts(
        logy=True, legend_position="top_right", responsive=False, width=620, height=340, ylim=(low, 4),
        title="ICL loss (dot-dash: agnostic; dashed: task mean; dotted: task known)")
    render_png(hv.Layout([left, right]).cols(2).opts(shared_axes=False),
               FIGURES / "task_emergence_seeds.png", width=1300, height=380)


def page_screenshot(analysis) -> None:
    from apps import theme
    from apps.task_emergence import TaskEmergenceView

    step = int(analysis.attrs["td_rise_step_50"] or analysis["step"].values[-1])

    def page():
        return theme.page([TaskEmergenceView(analysis=analysis, step=step)], title="Task-vector emergence")

    with _figures.browser_on_pages({"task_emergence": page}) as (url, browser):
        pg = browser.new_page(viewport={"width": 1500, "height": 1100})
        pg.goto(f"{url}/task_emergence", timeout=180_000)
        pg.wait_for_selector(".emergence-curves canvas", state="attached", timeout=180_000)
        pg.wait_for_timeout(3000)
        pg.screenshot(path=str(FIGURES / "dynamics_task_emergence_page.png"), full_page=True)
    log("  wrote docs/figures/dynamics_task_emergence_page.png")

PARTS = {"emergence": part_emergence, "phase": part_phase, "figures": part_figures}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=sorted(PARTS), required=True)
    parser.add_argument("--reuse", action="store_true", help="use stored runs instead of training again")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--seeds", default="0,1,2", help="emergence: comma-separated seeds (default: 0,1,2)")
    args = parser.parse_args(argv)
    args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    torch.set_num_threads(args.threads)
    for part in args.part:
        PARTS[part](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
