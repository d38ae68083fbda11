"""Evidence for docs/unlearning.md: mechanistic unlearning of athlete -> sport facts on SmolLM2.

Stages (each one process, each well under 10 minutes of one CPU thread on a quiet machine):

    python benchmarks/unlearning_evidence.py --stages localize
    python benchmarks/unlearning_evidence.py --stages train --methods fact_lookup,causal_tracing
    python benchmarks/unlearning_evidence.py --stages train --methods attribution_patching,all
    python benchmarks/unlearning_evidence.py --stages train --methods random
    python benchmarks/unlearning_evidence.py --stages figures

``localize`` keeps the facts SmolLM2 answers (trained format), splits forget / retain, and
computes the probe curve, causal tracing (MLP restores over the forget set and a layer x
position heatmap for one fact) and attribution patching. ``train`` runs
`unlearning_comparison` for the named methods with the same MLP budget and stores each
method's row. Everything lands in ``docs/figures/unlearning_summary.json``; ``figures``
draws the PNGs from it.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "unlearning_summary.json"

SETTINGS = dict(n_forget=8, n_retain=8, n_layers=4, steps=8, lr=2e-4, retain_weight=1.0,
                relearn_steps=3, relearn_lr=2e-5, seed=0)


def _load() -> dict[str, Any]:
    return json.loads(SUMMARY.read_text()) if SUMMARY.is_file() else {}


def _save(summary: dict[str, Any]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {SUMMARY.relative_to(ROOT)}")


def _facts(model, U):
    everything = U.load_attribute_facts()
    known = U.known_facts(model, everything)
    forget, retain = U.split_facts(known, SETTINGS["n_forget"], SETTINGS["n_retain"],
                                   seed=SETTINGS["seed"])
    return everything, known, forget, retain


def stage_localize(model, U, summary: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    everything, known, forget, retain = _facts(model, U)
    t1 = time.perf_counter()
    probe = U.attribute_probe_curve(model, everything, n_folds=4, seed=SETTINGS["seed"])
    t2 = time.perf_counter()
    trace = U.causal_trace(model, forget, positions=False, seed=SETTINGS["seed"])
    t3 = time.perf_counter()
    f0 = forget[0]
    first = U.subject_positions(model, f0)[0]
    n = len(model.tokenizer(U.fact_prompt(f0), add_special_tokens=False)["input_ids"])
    heat = U.causal_trace(model, [f0], positions=list(range(first, n)), seed=SETTINGS["seed"])
    t4 = time.perf_counter()
    ap = U.attribution_patching(model, forget, seed=SETTINGS["seed"])
    t5 = time.perf_counter()
    r = heat.restore_resid.isel(fact=0).values
    summary["localize"] = {
        "n_facts": len(everything), "n_known": len(known),
        "known_by_sport": {a: sum(f.attribute == a for f in known) for a in everything[0].attributes},
        "forget": [[f.subject, f.attribute] for f in forget],
        "retain": [[f.subject, f.attribute] for f in retain],
        "probe_accuracy": probe.probe_accuracy.values.tolist(),
        "embed_accuracy": float(probe.embed_accuracy), "chance": float(probe.chance),
        "ct_restore_mlp": trace.restore_mlp.mean("fact").values.tolist(),
        "ct_p_clean": trace.p_clean.values.tolist(), "ct_p_corrupt": trace.p_corrupt.values.tolist(),
        "ap_mlp": ap.ap_mlp.mean("fact").values.tolist(),
        "heatmap": {"subject": f0.subject, "positions": list(range(first, n)),
                    "tokens": [str(t) for t in heat.token.isel(fact=0).values[first:n]],
                    "p_answer": r[:, first:n].tolist(), "p_clean": float(heat.p_clean[0]),
                    "p_corrupt": float(heat.p_corrupt[0])},
        "seconds": {"known_filter": t1 - t0, "probe": t2 - t1, "causal_trace_mlp": t3 - t2,
                    "causal_trace_heatmap": t4 - t3, "attribution_patching": t5 - t4},
    }
    summary["settings"] = SETTINGS
    for m in ("fact_lookup", "causal_tracing", "attribution_patching", "random"):
        print(m, _localized(model, U, summary, m))


def _datasets(summary: dict[str, Any]):
    import xarray as xr

    loc = summary["localize"]
    probe = xr.Dataset({"probe_accuracy": ("layer", np.array(loc["probe_accuracy"])),
                        "embed_accuracy": loc["embed_accuracy"], "chance": loc["chance"]})
    trace = xr.Dataset({"restore_mlp": (("fact", "layer"), np.array([loc["ct_restore_mlp"]]))})
    ap = xr.Dataset({"ap_mlp": (("fact", "layer"), np.array([loc["ap_mlp"]]))})
    return probe, trace, ap


def _localized(model, U, summary, method):
    probe, trace, ap = _datasets(summary)
    return U.localized_layers(model, method, SETTINGS["n_layers"], probe=probe, trace=trace,
                              attribution=ap, seed=SETTINGS["seed"])


def stage_train(model, U, summary: dict[str, Any], methods: list[str]) -> None:
    if "localize" not in summary:
        raise SystemExit("run --stages localize first")
    facts = {f.subject: f for f in U.load_attribute_facts()}
    forget = [facts[s] for s, _ in summary["localize"]["forget"]]
    retain = [facts[s] for s, _ in summary["localize"]["retain"]]
    probe, trace, ap = _datasets(summary)
    t0 = time.perf_counter()
    ds = U.unlearning_comparison(
        model, forget, retain, methods=methods, n_layers=SETTINGS["n_layers"],
        steps=SETTINGS["steps"], lr=SETTINGS["lr"], retain_weight=SETTINGS["retain_weight"],
        relearn_steps=SETTINGS["relearn_steps"], relearn_lr=SETTINGS["relearn_lr"],
        probe=probe, trace=trace, attribution=ap, seed=SETTINGS["seed"],
        progress=lambda d, t: print(f"  step {d}/{t}", flush=True))
    wall = time.perf_counter() - t0
    rows = summary.setdefault("methods", {})
    for m in ds["localization"].values.tolist():
        rows[m] = {"layers": str(ds["trained_layers"].sel(localization=m).item()),
                   "n_params": int(ds.n_params.sel(localization=m)),
                   "seconds_per_step": _num(ds.seconds_per_step.sel(localization=m)),
                   "accuracy": {k: _num(ds.accuracy.sel(localization=m, metric=k))
                                for k in ds.metric.values.tolist()},
                   "loss": [_num(x) for x in ds.loss.sel(localization=m).values]}
    summary.setdefault("train_runs", []).append({"methods": methods, "wall_s": wall})
    for m, row in rows.items():
        print(m, row["layers"], row["n_params"], row["accuracy"])


def _num(x) -> float | None:
    v = float(x)
    return None if np.isnan(v) else round(v, 4)


def render_png(obj: Any, path: Path, *, width: int, height: int) -> None:
    """Render a HoloViews object to PNG at a fixed size (see benchmarks/_figures.py)."""
    _figures.render_png(obj.opts(responsive=False, width=width, height=height), path,
                        width=width, height=height)
    print(f"wrote {path.relative_to(ROOT)}")


def stage_figures(model, U, summary: dict[str, Any]) -> None:
    import xarray as xr

    from apps import unlearning as view

    probe, trace, ap = _datasets(summary)
    probe = probe.assign_coords(layer=np.arange(probe.sizes["layer"]))
    flu = _localized(model, U, summary, "fact_lookup")
    render_png(view.plot_probe_curve(probe, flu), FIGURES / "unlearning_probe.png",
               width=760, height=320)
    h = summary["localize"]["heatmap"]
    p = np.array(h["p_answer"])                                   # [layer, n_positions]
    n_pos = p.shape[1]
    heat = xr.Dataset(
        {"restore_resid": (("fact", "layer", "pos"), p[None]),
         "p_clean": ("fact", [h["p_clean"]]), "p_corrupt": ("fact", [h["p_corrupt"]])},
        coords={"fact": [0], "layer": np.arange(p.shape[0]), "pos": np.arange(n_pos),
                "subject": ("fact", [h["subject"]]), "token": (("fact", "pos"), [h["tokens"]])})
    render_png(view.plot_trace_heatmap(heat), FIGURES / "unlearning_trace.png", width=760, height=420)
    methods = summary.get("methods", {})
    order = [m for m in ("original", "fact_lookup", "causal_tracing", "attribution_patching",
                         "random", "all") if m in methods]
    rows = [(view.METRIC_LABELS[k], view.SHORT_NAMES[m], methods[m]["accuracy"][k] or 0.0)
            for k in view.METRIC_LABELS for m in order]
    render_png(view.plot_accuracy_bars(rows), FIGURES / "unlearning_accuracy.png",
               width=1000, height=380)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="localize,train,figures")
    ap.add_argument("--methods", default="fact_lookup,causal_tracing,attribution_patching,all")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from explorer import load_model
    from explorer.analyses import unlearning as U

    model = load_model("smollm2-135m")
    summary = _load()
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        if stage == "localize":
            stage_localize(model, U, summary)
        elif stage == "train":
            stage_train(model, U, summary, args.methods.split(","))
        elif stage == "figures":
            stage_figures(model, U, summary)
        else:
            raise SystemExit(f"unknown stage {stage!r}")
        summary.setdefault("stage_seconds", {})[stage] = time.perf_counter() - t0
        _save(summary)


if __name__ == "__main__":
    main()
