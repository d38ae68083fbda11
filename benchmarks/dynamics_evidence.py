"""Evidence for docs/dynamics.md: the full training runs of the two training-dynamics labs.

Parts (each writes its numbers into ``docs/figures/dynamics_summary.json``):

``parity``   The streaming-parity RNN with the paper's settings (van Rossem & Saxe, ICML 2025),
             trained from scratch and stored in the activation store (the run that
             ``explorer parity train`` re-trains and the page shows): wall time, the step at
             which the minimal automaton becomes the 2-state parity automaton, the step from
             which random strings up to length 10,000 are all classified correctly, and the
             automaton sizes over training. ``--parity-seeds 0,1,2`` repeats it per seed.
``batching`` The parity recipe's one-length minibatches against uniform minibatches over all
             lengths, same network and seed: SGD for the default 1,000 epochs and Adam for
             300; final and lowest training loss, final accuracy, and whether the loss stayed
             on the 0.25 plateau (predicting one half for both classes) at every checkpoint.
``icl``      One attention layer with H = 1, 2, 4 heads on in-context linear regression
             (He et al., ICML 2025; d = 5, L = 40, noise variance 0.1), stored likewise: wall
             time, the step (and seconds) from which the KQ/OV pattern holds, the final pattern
             metrics, the H = 1 vs H = 2 loss gap, agreement with debiased GD and the
             Bayes-optimal loss, loss against context length.
``icl4``     H = 4 trained longer (``--icl4-steps``, default 60,000, a checkpoint every 500 steps;
             stored, reused when present): when each pattern criterion holds for good, for all
             active heads and for the heads with at least 25% of the largest |mu|.
``ship``     Writes the seed-0 parity run that comes with the project
             (``datasets/dynamics/parity_seed0.safetensors``: float16 weights and the analysis
             of those weights), from the full-precision run in the store (trained if missing),
             and compares that analysis with the full-precision one.
``figures``  PNGs of the results (rendered by chromium) and of both pages.

Usage::

    python benchmarks/dynamics_evidence.py --part parity --part icl --part figures

Runs are stored in the activation store ($EXPLORER_CACHE). ``--threads 1`` (default) is
fastest for these tiny models, by far on a busy machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import _figures  # benchmarks/_figures.py, beside this script
from _figures import browser_on_pages, log, machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "dynamics_summary.json"
ICL_HEADS = (1, 2, 4)


def write_summary(part: str, data: dict[str, Any]) -> None:
    _figures.update_summary(SUMMARY, part, data)


# -- part 1: parity -------------------------------------------------------------------------

def part_parity(args: argparse.Namespace) -> None:
    from explorer.analyses.parity import (DEFAULTS, analysis_summary, parity_run,
                                          stored_parity_analysis)

    out: dict[str, Any] = {"params": dict(DEFAULTS), "machine_before": machine(), "seeds": {}}
    for seed in args.parity_seeds:
        log(f"parity: training seed {seed} ({DEFAULTS['epochs']} epochs)")
        t0 = time.perf_counter()
        run = parity_run(retrain=True, seed=seed)
        train_wall = time.perf_counter() - t0
        log(f"  trained in {train_wall:.0f} s; analysing {int(run.sizes['step'])} checkpoints")
        t0 = time.perf_counter()
        analysis = stored_parity_analysis(run, n_strings=args.n_strings)
        summary = analysis_summary(analysis)
        summary["analysis_seconds"] = round(time.perf_counter() - t0, 1)
        sizes = analysis["n_states"].values
        summary["max_merged_states"] = int(sizes.max())
        summary["max_merged_states_step"] = int(analysis["step"].values[sizes.argmax()])
        summary["n_strings_per_length"] = args.n_strings
        summary["steps_per_epoch"] = run.attrs["steps_per_epoch"]
        out["seeds"][str(seed)] = summary
        log(f"  transition (parity automaton) at step {summary['transition_step']} "
            f"(epoch {summary['transition_epoch']}, {summary['transition_seconds']} s into training); "
            f"all lengths correct from step {summary['generalisation_step']}")
    _figures.update_timed_summary(SUMMARY, "parity", out)


def part_batching(args: argparse.Namespace) -> None:
    from explorer.analyses.parity import DEFAULTS, train_parity_rnn

    runs = {"sgd_per_length": ("per-length", "sgd", DEFAULTS["epochs"], DEFAULTS["lr"]),
            "sgd_uniform": ("uniform", "sgd", DEFAULTS["epochs"], DEFAULTS["lr"]),
            "adam_per_length": ("per-length", "adam", 300, 1e-3),
            "adam_uniform": ("uniform", "adam", 300, 1e-3)}
    out: dict[str, Any] = {"params": dict(DEFAULTS), "machine_before": machine(), "runs": {}}
    for name, (batching, optimizer, epochs, lr) in runs.items():
        log(f"batching: {name} ({epochs} epochs, lr {lr})")
        t0 = time.perf_counter()
        run = train_parity_rnn(batching=batching, optimizer=optimizer, epochs=epochs, lr=lr,
                               checkpoint_every=10)
        loss = run["train_loss"].values
        out["runs"][name] = {
            "batching": batching, "optimizer": optimizer, "epochs": epochs, "lr": lr,
            "final_loss": round(float(loss[-1]), 4), "min_loss": round(float(loss.min()), 4),
            "final_accuracy": round(float(run["train_accuracy"].values[-1]), 4),
            "on_plateau_throughout": bool(np.all(np.abs(loss[1:] - 0.25) < 0.01)),
            "seconds": round(time.perf_counter() - t0, 1)}
        log(f"  {out['runs'][name]}")
    _figures.update_timed_summary(SUMMARY, "batching", out)


# -- part 2: linear ICL ---------------------------------------------------------------------

def part_icl(args: argparse.Namespace) -> None:
    from explorer.analyses.linear_icl import (DEFAULTS, analysis_summary, linear_icl_run,
                                              stored_linear_icl_analysis)

    analyses = {}
    out: dict[str, Any] = {"params": dict(DEFAULTS), "machine_before": machine()}
    for H in ICL_HEADS:
        log(f"icl: training H = {H} ({DEFAULTS['steps']} steps)")
        run = linear_icl_run(retrain=True, n_heads=H)
        log(f"  trained in {run.attrs['train_seconds']:.0f} s; analysing")
        analyses[H] = stored_linear_icl_analysis(run)
    summary = analysis_summary(analyses)
    out.update(summary)
    _figures.update_timed_summary(SUMMARY, "icl", out)
    for H, r in summary["runs"].items():
        log(f"  H = {H}: loss {r['final_test_loss']:.4f}, pattern from step {r['pattern_step']} "
            f"({r['pattern_seconds']} s), dgd R^2 {r['dgd_r2']:.4f}")


# -- H = 4, longer ---------------------------------------------------------------------------

def part_icl4(args: argparse.Namespace) -> None:
    import numpy as np

    from explorer.analyses.linear_icl import PATTERN_THRESHOLDS, linear_icl_run, stored_linear_icl_analysis
    from explorer.store import ActivationStore

    before = machine()
    t0, cpu0 = time.perf_counter(), time.process_time()
    run = linear_icl_run(n_heads=4, steps=args.icl4_steps, checkpoint_every=500)
    a = stored_linear_icl_analysis(run, store=ActivationStore())
    steps = a["step"].values

    def settled(flags) -> int | None:
        for i in range(len(flags)):
            if bool(np.all(flags[i:])):
                return int(steps[i])
        return None

    lim = PATTERN_THRESHOLDS
    mu = np.abs(a["mu"].values)
    out: dict[str, Any] = {"steps": args.icl4_steps, "train_seconds": run.attrs["train_seconds"],
                           "train_cpu_seconds": run.attrs.get("train_cpu_seconds"),
                           "wall_seconds_here": round(time.perf_counter() - t0, 1),
                           "cpu_seconds_here": round(time.process_time() - cpu0, 1), "machine": before}
    for name, share in (("active_heads", 0.05), ("strong_heads", 0.25)):
        keep = mu >= share * mu.max(1, keepdims=True)
        kq = np.nanmax(np.where(keep, a["kq_identity_error"].values, np.nan), 1)
        ov = np.nanmax(np.where(keep, a["ov_offy_ratio"].values, np.nan), 1)
        ms = a["mu_sum_ratio"].values
        out[name] = {"share_of_largest_mu": share,
                     "kq_from": settled(kq < lim["kq_identity_error_max"]),
                     "ov_from": settled(ov < lim["ov_offy_ratio_max"]),
                     "mu_sum_from": settled(ms < lim["mu_sum_ratio"]),
                     "all_from": settled((kq < lim["kq_identity_error_max"]) & (ov < lim["ov_offy_ratio_max"])
                                         & (ms < lim["mu_sum_ratio"])),
                     "final_kq_max": round(float(kq[-1]), 4), "final_ov_offy_max": round(float(ov[-1]), 4)}
        at = out[name]["all_from"]
        out[name]["all_from_wall_seconds"] = None if at is None else round(float(run["wall_seconds"].sel(step=at)), 1)
    out["final_mu"] = [round(float(v), 3) for v in a["mu"].values[-1]]
    out["final_ov_offy"] = [round(float(v), 4) for v in a["ov_offy_ratio"].values[-1]]
    out["final_kq_identity_error"] = [round(float(v), 4) for v in a["kq_identity_error"].values[-1]]
    out["final_mu_sum_ratio"] = round(float(a["mu_sum_ratio"].values[-1]), 4)
    out["final_test_loss"] = a.attrs["final_test_loss"]
    write_summary("icl_h4_long", out)
    log(f"icl4: {json.dumps(out)}")


# -- shipped parity run ----------------------------------------------------------------------

def part_ship(args: argparse.Namespace) -> None:
    import numpy as np

    from explorer.analyses import parity as par

    run = par.parity_run()
    if "source" in run.attrs:  # the shipped run itself: train the full-precision one
        log("ship: training the full-precision seed-0 parity run")
        run = par.parity_run(retrain=True)
    full = par.stored_parity_analysis(run)
    tmp = par.SHIPPED_RUN.with_suffix(".tmp")
    half, _ = par.load_parity_run_safetensors(par.save_parity_run_safetensors(run, tmp))
    log("ship: analysing the float16 weights")
    t0 = time.perf_counter()
    analysis = par.parity_analysis(half)
    seconds = time.perf_counter() - t0
    par.save_parity_run_safetensors(run, par.SHIPPED_RUN, analysis=analysis)
    tmp.unlink()
    diff = {name: int((analysis[name].values != full[name].values).sum())
            for name in ("n_states", "n_states_minimal", "is_parity_automaton", "all_correct")}
    weights_err = max(float(np.abs(half[n].values - run[n].values).max()) for n in par._WEIGHTS)
    out = {"file": str(par.SHIPPED_RUN.relative_to(ROOT)), "bytes": par.SHIPPED_RUN.stat().st_size,
           "max_abs_weight_rounding": weights_err,
           "checkpoints_differing_from_float32_analysis": diff,
           "transition_step": [full.attrs["transition_step"], analysis.attrs["transition_step"]],
           "generalisation_step": [full.attrs["generalisation_step"], analysis.attrs["generalisation_step"]],
           "analysis_seconds": round(seconds, 1), "machine": machine()}
    write_summary("parity_shipped", out)
    log(f"ship: {out['bytes']} bytes; transition float32/float16 {out['transition_step']}; "
        f"checkpoints that differ {diff}")


# -- part 3: figures ------------------------------------------------------------------------

def render_png(obj: Any, path: Path, *, width: int = 1100, height: int = 500) -> None:
    """Render a HoloViews object to PNG (see benchmarks/_figures.py)."""
    _figures.render_png(obj, path, width=width, height=height)
    log(f"  wrote {path.relative_to(ROOT)}")


def part_figures(args: argparse.Namespace) -> None:
    import holoviews as hv

    from apps import linear_icl as icl_app
    from apps import parity as parity_app
    from explorer.analyses.linear_icl import attention_patterns, linear_icl_run, stored_linear_icl_analysis
    from explorer.analyses.parity import (parity_automaton, parity_hidden_pca, parity_run,
                                          stored_parity_analysis)

    hv.extension("bokeh", logo=False)
    FIGURES.mkdir(parents=True, exist_ok=True)
    # Parity: the stored seed-0 run (trained here if the parity part has not run).
    run = parity_run(seed=0)
    analysis = stored_parity_analysis(run, n_strings=args.n_strings)
    transition = analysis.attrs["transition_step"] or int(run["step"].values[-1])
    tree = int(analysis["step"].values[int(analysis["n_states"].values.argmax())])
    curves = parity_app.plot_training_curves(analysis, transition)
    render_png(hv.Layout([_figures.fixed(p, 380, 280) for p in curves]).cols(3).opts(shared_axes=False),
               FIGURES / "dynamics_parity_training.png", width=1180, height=300)
    panels = []
    for step in (tree, int(run["step"].values[-1])):
        panels.append(_figures.fixed(parity_app.plot_hidden_pca(parity_hidden_pca(run, step)), 420, 340))
        panels.append(_figures.fixed(parity_app.plot_automaton(parity_automaton(run, step), minimal=False),
                                     420, 340))
    panels.append(_figures.fixed(parity_app.plot_automaton(parity_automaton(run, int(run["step"].values[-1])),
                                                   minimal=True), 420, 340))
    render_png(hv.Layout(panels).cols(2).opts(shared_axes=False), FIGURES / "dynamics_parity_automata.png",
               width=880, height=1080)
    acc = analysis["accuracy"]
    rows = [(int(s), str(int(n)), float(acc.sel(step=s, length=n))) for s in acc["step"].values
            for n in acc["length"].values]
    heat = hv.HeatMap(rows, ["training step", "string length"], "accuracy").opts(
        cmap=parity_app.theme.PROBABILITY_CMAP, clim=(0, 1), colorbar=True,
        width=1000, height=300, tools=["hover"],
        title="Accuracy on random strings by length (rows) over training (columns)")
    render_png(heat, FIGURES / "dynamics_parity_accuracy.png", width=1000, height=300)

    # Linear ICL: the stored runs for H = 1, 2, 4.
    runs = {H: linear_icl_run(n_heads=H) for H in ICL_HEADS}
    analyses = {H: stored_linear_icl_analysis(runs[H]) for H in ICL_HEADS}
    final = int(runs[2]["step"].values[-1])
    render_png(hv.Layout([_figures.fixed(icl_app.plot_loss_curves(analyses, final, 2), 560, 320),
                          _figures.fixed(icl_app.plot_loss_by_length(runs[2], analyses[2], final), 560, 320)])
               .cols(2).opts(shared_axes=False), FIGURES / "dynamics_icl_loss.png", width=1140, height=340)
    for H in (2, 4):
        pats = attention_patterns(runs[H].sel(step=final))
        render_png(icl_app.plot_kq_heatmaps(pats), FIGURES / f"dynamics_icl_kq_h{H}.png",
                   width=300 * H + 80, height=280)
        render_png(_figures.fixed(icl_app.plot_ov_heatmap(pats), 700, 90 + 36 * H),
                   FIGURES / f"dynamics_icl_ov_h{H}.png", width=700, height=90 + 36 * H)
    metrics = icl_app.plot_pattern_metrics(analyses[2], final)
    render_png(hv.Layout([_figures.fixed(p, 380, 280) for p in metrics]).cols(3).opts(shared_axes=False),
               FIGURES / "dynamics_icl_patterns.png", width=1180, height=300)
    page_screenshots(run, analysis, runs, analyses, transition)


def page_screenshots(run, analysis, runs, analyses, transition) -> None:
    """Screenshots of both pages at the interesting step."""
    from apps import theme
    from apps.linear_icl import LinearICLView
    from apps.parity import ParityView

    def parity_page():
        view = ParityView(run=run, analysis=analysis)
        view.step = transition
        return theme.page([view], title="Explorer: streaming parity")

    pages = {"parity": parity_page,
             "linear_icl": lambda: theme.page([LinearICLView(runs=runs, analyses=analyses)],
                                              title="Explorer: in-context linear regression")}
    with browser_on_pages(pages) as (url, browser):
        for slug in ("parity", "linear_icl"):
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"{url}/{slug}", timeout=120_000)
            css = {"parity": ".parity", "linear_icl": ".icl"}[slug]
            for part in ("-summary", "-curves" if slug == "parity" else "-metrics"):
                page.wait_for_selector(f"{css}{part}", state="attached", timeout=600_000)
            page.wait_for_selector(f"{css}-{'curves' if slug == 'parity' else 'metrics'} canvas",
                                   state="attached", timeout=600_000)
            page.wait_for_timeout(15000)  # every pane drawn
            page.screenshot(path=str(FIGURES / f"dynamics_{slug}_page.png"), full_page=True)
            log(f"  wrote docs/figures/dynamics_{slug}_page.png")
            page.close()

PARTS = {"parity": part_parity, "batching": part_batching, "icl": part_icl, "icl4": part_icl4, "ship": part_ship, "figures": part_figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", action="append", choices=list(PARTS), help="part to run (repeatable)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--parity-seeds", default="0", help="comma-separated seeds (default: 0)")
    p.add_argument("--icl4-steps", type=int, default=60000, help="icl4: steps of the long H = 4 run")
    p.add_argument("--n-strings", type=int, default=20,
                   help="random strings per length in the long-string test (default: 20)")
    args = p.parse_args(argv)
    args.parity_seeds = [int(s) for s in args.parity_seeds.split(",") if s.strip()]
    return _figures.run_parts(PARTS, args.part or list(PARTS), args)


if __name__ == "__main__":
    sys.exit(main())
