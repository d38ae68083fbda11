"""Evidence for docs/circuits.md: EAP-IG circuits of SmolLM2 on the four shipped tasks.

For each task: generate ``--n`` clean/corrupted pairs, keep the ones SmolLM2 answers right
(first answer token, `filter_task`), take at most ``--max-prompts`` of them, score every edge
by EAP-IG (``--steps`` steps, logit difference) and measure the faithfulness curve by
patching every non-circuit edge to its corrupted value (`faithfulness_curve`). With
``--eap`` the same curve for plain EAP scores is added. Each task's numbers are written to
``docs/figures/circuits_summary.json`` as soon as the task finishes, and a later run skips
tasks already there (so the evidence fills over several runs on a busy machine);
``--figures`` renders ``docs/figures/circuits_faithfulness.png`` from that file.

Usage::

    python benchmarks/circuits_evidence.py                      # all tasks, resumable
    python benchmarks/circuits_evidence.py --tasks add --eap
    python benchmarks/circuits_evidence.py --figures
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from explorer.defaults import DEFAULT_MODEL  # noqa: E402
from explorer import load_model  # noqa: E402
from explorer.analyses import circuits as C  # noqa: E402

import _figures  # benchmarks/_figures.py, beside this script

SUMMARY = ROOT / "docs" / "figures" / "circuits_summary.json"
FIGURE = ROOT / "docs" / "figures" / "circuits_faithfulness.png"
FRACTIONS = (0.0, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _load() -> dict[str, Any]:
    return json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {"tasks": {}}


def _save(summary: dict[str, Any]) -> None:
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")


def _curve_rows(curve) -> list[dict[str, Any]]:
    return [{"n_edges": int(s), "n_kept": int(curve["n_kept"].sel(n_edges=s)),
             "metric": float(curve["metric"].sel(n_edges=s)),
             "recovered": float(curve["recovered"].sel(n_edges=s)),
             "accuracy": float(curve["accuracy"].sel(n_edges=s))} for s in curve["n_edges"].values]


def run_task(model, name: str, args: argparse.Namespace, skip: frozenset = frozenset()) -> dict[str, Any]:
    t0 = time.perf_counter()
    task = C.make_task(name, args.n, seed=args.seed)
    acc = C.task_accuracy(model, task, batch_size=args.batch_size)
    usable = acc["correct"].values & acc["distinct"].values & acc["same_length"].values
    rows = np.nonzero(usable)[0][:args.max_prompts]
    if len(rows) == 0:
        return {"n_generated": len(task), "n_correct": 0, "note": "no usable prompts"}
    sub = task.subset(rows)
    n_total = len(C.circuit_graph(model).edges)
    sizes = sorted({int(round(f * n_total)) for f in FRACTIONS})
    out: dict[str, Any] = {
        "n_generated": len(task), "n_correct": int(acc["correct"].sum()),
        "clean_accuracy_all": float(acc["correct"].mean()), "n_prompts": len(sub),
        "example": {"clean": sub.clean[0], "corrupt": sub.corrupt[0], "answer": sub.answer[0],
                    "wrong": sub.wrong[0]},
        "n_edges_total": n_total, "methods": {},
    }
    methods = ["eap-ig"] + (["eap"] if args.eap else []) + (["random"] if args.random else [])
    for method in methods:
        if method in skip:
            continue
        ts = time.perf_counter()
        if method == "random":  # baseline: the same sizes, edges drawn at random
            scores = C.edge_scores(model, sub.subset([0]), method="eap")
            rng = np.random.default_rng(args.seed)
            scores["score"].values[:] = rng.random(scores.sizes["edge"])
        else:
            scores = C.edge_scores(model, sub, method=method, steps=args.steps,
                                   batch_size=args.batch_size, progress=True)
        score_s = time.perf_counter() - ts
        curve = C.faithfulness_curve(model, sub, scores, sizes=sizes, batch_size=args.batch_size,
                                     progress=True)
        top = np.argsort(-np.abs(scores["score"].values))[:15]
        circuit = C.select_circuit(scores, top_n=int(round(0.05 * n_total)))
        out["methods"][method] = {
            "score_seconds": score_s,
            "clean_metric": curve.attrs["clean_metric"], "corrupt_metric": curve.attrs["corrupt_metric"],
            "clean_accuracy": curve.attrs["clean_accuracy"],
            "corrupt_accuracy": curve.attrs["corrupt_accuracy"],
            "curve": _curve_rows(curve),
            "top_edges": [[str(scores["src"].values[i]), str(scores["dst"].values[i]),
                           float(scores["score"].values[i])] for i in top],
            "circuit_5pct_nodes": sorted(C.circuit_nodes(scores, circuit)),
        }
        print(f"{name} {method}: " + ", ".join(
            f"{r['n_edges']}:{r['recovered']:.2f}/{r['accuracy']:.2f}" for r in out["methods"][method]["curve"]),
            flush=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def render_png(obj: Any, path: Path, *, width: int, height: int) -> None:
    """Render a HoloViews object to PNG (see benchmarks/_figures.py)."""
    _figures.render_png(obj, path, width=width, height=height)
    print(f"wrote {path.relative_to(ROOT)}")


def figures(summary: dict[str, Any]) -> None:
    import colorcet as cc
    import holoviews as hv

    hv.extension("bokeh", logo=False)
    rec_curves, acc_curves = [], []
    colors = cc.palette["glasbey_category10"]
    for i, (name, res) in enumerate(summary["tasks"].items()):
        for method, m in res.get("methods", {}).items():
            rows = [r for r in m["curve"] if r["n_edges"] > 0]
            xs = [100 * r["n_edges"] / res["n_edges_total"] for r in rows]
            label = f"{name} ({method}, {res['n_prompts']} pairs)"
            dash = {"eap-ig": "solid", "eap": "dashed"}.get(method, "dotted")
            rec_curves.append(hv.Curve((xs, [r["recovered"] for r in rows]), "edges kept (%)",
                                       "metric recovered", label=label).opts(
                color=colors[i], line_dash=dash, line_width=2))
            acc_curves.append(hv.Curve((xs, [r["accuracy"] for r in rows]), "edges kept (%)",
                                       "exact-match accuracy", label=label).opts(
                color=colors[i], line_dash=dash, line_width=2))
    opts = dict(logx=True, height=400, show_grid=True)
    left = hv.Overlay(rec_curves).opts(title="Logit difference recovered (clean = 1, corrupted = 0)",
                                       width=520, show_legend=False, **opts)
    right = hv.Overlay(acc_curves).opts(title="Circuit-only model: first answer token right",
                                        width=800, legend_position="right", **opts)
    render_png((left + right).cols(2), FIGURE, width=1330, height=420)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="add,sub,ioi,greater-than")
    p.add_argument("--n", type=int, default=64, help="pairs generated per task")
    p.add_argument("--max-prompts", type=int, default=24, help="right-answered pairs kept")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eap", action="store_true", help="also plain EAP")
    p.add_argument("--random", action="store_true", help="also circuits of random edges")
    p.add_argument("--redo", action="store_true", help="recompute tasks already stored")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--figures", action="store_true", help="only render the figure")
    args = p.parse_args(argv)
    if args.figures:
        figures(_load())
        return 0
    torch.set_num_threads(args.threads)
    model = load_model(DEFAULT_MODEL)
    summary = _load()
    summary["settings"] = {"model": model.spec.name, "n": args.n, "max_prompts": args.max_prompts,
                           "steps": args.steps, "metric": "logit_diff", "batch_size": args.batch_size,
                           "seed": args.seed, "fractions": list(FRACTIONS),
                           "graph": "input, 270 heads, 30 MLPs, logits; heads read one combined "
                                    "q/k/v input"}
    for name in args.tasks.split(","):
        stored = summary["tasks"].get(name, {}).get("methods", {})
        if stored and not args.redo and (not args.eap or "eap" in stored) and (
                not args.random or "random" in stored):
            print(f"{name}: stored, skipped")
            continue
        result = run_task(model, name, args, skip=frozenset() if args.redo else frozenset(stored))
        if stored and not args.redo:  # keep the stored methods, add the new ones
            result["methods"] = {**stored, **{k: v for k, v in result["methods"].items()
                                              if k not in stored}}
        summary["tasks"][name] = result
        _save(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
