"""Evidence for docs/dynamics.md: task-vector emergence and the parity phase diagram.

Parts (each writes its numbers into ``docs/figures/task_emergence_summary.json``):

``emergence``  The small transformer on the sparse-regression task mixture (Han et al., ICML
               2025) with the default settings, trained from scratch and stored in the
               activation store (the run ``explorer task-emergence train`` re-trains and the page
               shows): wall and CPU time, task decodability per layer and ICL loss per task at
               every checkpoint, the steps at which each rises and their correlation.
``phase``      The streaming-parity phase diagram (van Rossem & Saxe, ICML 2025) over the
               default reduced grid of initialisation gain x longest training string, stored
               (the one ``explorer parity phase`` computes and the parity page shows).
``figures``    PNGs of both (rendered by chromium) and a screenshot of the page.

Usage::

    python benchmarks/task_emergence_evidence.py --part emergence --part phase --part figures
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dynamics_evidence import CHROMIUM, CHROMIUM_ARGS, FIGURES, log, machine, render_png  # noqa: E402

SUMMARY = FIGURES / "task_emergence_summary.json"


def write_summary(part: str, data: dict[str, Any]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    old = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    old[part] = data
    SUMMARY.write_text(json.dumps(old, indent=1) + "\n")


def part_emergence(args: argparse.Namespace) -> None:
    from explorer.analyses.task_emergence import (DEFAULTS, emergence_summary, stored_task_emergence_analysis,
                                                  task_emergence_run)

    out: dict[str, Any] = {"params": dict(DEFAULTS), "machine_before": machine()}
    log(f"emergence: training ({DEFAULTS['steps']} steps)")
    t0 = time.perf_counter()
    run = task_emergence_run(retrain=not args.reuse)
    out["train_wall_seconds_measured_here"] = round(time.perf_counter() - t0, 1)
    out["train_seconds"] = run.attrs["train_seconds"]
    out["train_cpu_seconds"] = run.attrs.get("train_cpu_seconds")
    log(f"  trained in {run.attrs['train_seconds']:.0f} s (CPU {run.attrs.get('train_cpu_seconds')} s); analysing")
    t0 = time.perf_counter()
    analysis = stored_task_emergence_analysis(run)
    out["analysis_seconds"] = round(time.perf_counter() - t0, 1)
    out.update({k: analysis.attrs[k] for k in emergence_summary(analysis)})
    out["td_by_step_best_layer"] = [round(float(v), 3) for v in analysis["td"].values[:, out["best_layer"]]]
    out["icl_loss_mean_by_step"] = [round(float(v), 4) for v in analysis["icl_loss_mean"].values]
    out["steps"] = [int(s) for s in analysis["step"].values]
    out["machine_after"] = machine()
    write_summary("emergence", out)
    log(f"  TD rises half-way at step {out['td_rise_step_50']}, ICL at {out['icl_rise_step_50']}; "
        f"correlation {out['td_icl_correlation']}")


def part_phase(args: argparse.Namespace) -> None:
    from explorer.analyses.parity import phase_summary, stored_parity_phase_diagram

    log("phase: parity phase diagram on the default grid")
    done = time.perf_counter()

    def progress(cells: int, total: int) -> None:
        log(f"  cell {cells}/{total} ({time.perf_counter() - done:.0f} s)")

    out = {"machine_before": machine()}
    phase = stored_parity_phase_diagram(recompute=not args.reuse, progress=progress)
    out.update(phase_summary(phase))
    out["machine_after"] = machine()
    write_summary("phase", out)
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
    phase = stored_parity_phase_diagram(compute=False)
    if phase is not None:
        render_png(plot_phase_diagram(phase).opts(responsive=False, width=900, height=360),
                   FIGURES / "dynamics_parity_phase.png", width=960, height=400)
    page_screenshot(analysis)


def page_screenshot(analysis) -> None:
    import socket

    import panel as pn
    from playwright.sync_api import sync_playwright

    from apps import theme
    from apps.task_emergence import TaskEmergenceView

    theme.enable_extension()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    step = int(analysis.attrs["td_rise_step_50"] or analysis["step"].values[-1])

    def page():
        return theme.page([TaskEmergenceView(analysis=analysis, step=step)], title="Task-vector emergence")

    srv = pn.serve({"task_emergence": page}, port=port, address="127.0.0.1", threaded=True, show=False,
                   websocket_origin=[f"127.0.0.1:{port}"])
    try:
        time.sleep(2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            pg = browser.new_page(viewport={"width": 1500, "height": 1100})
            pg.goto(f"http://127.0.0.1:{port}/task_emergence", timeout=180_000)
            pg.wait_for_selector(".emergence-curves canvas", state="attached", timeout=180_000)
            pg.wait_for_timeout(3000)
            pg.screenshot(path=str(FIGURES / "dynamics_task_emergence_page.png"), full_page=True)
            browser.close()
        log("  wrote docs/figures/dynamics_task_emergence_page.png")
    finally:
        srv.stop()


PARTS = {"emergence": part_emergence, "phase": part_phase, "figures": part_figures}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=sorted(PARTS), required=True)
    parser.add_argument("--reuse", action="store_true", help="use stored runs instead of training again")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for part in args.part:
        PARTS[part](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
